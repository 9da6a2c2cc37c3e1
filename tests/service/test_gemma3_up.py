"""Gemma 3 270M served by `pagedserve up --model <its GGUF file>`: real scheduler and worker processes, the file's
quantised blocks run as stored (the default), greedy tokens identical to transformers' generate on the dequantised
weights, for a short prompt and, at the same time, one longer than the model's 512-token sliding window. The file is
a pretrained (not instruction-tuned) model and carries no chat template: a conversation is refused by name."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch
from transformers import AutoTokenizer

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc
from pagedserve_common.ports import free_port
from tests.support.gemma3 import gemma3_dir as converted_gemma3
from tests.support.gemma3 import gemma3_gguf, long_prompt
from tests.support.processes import stop_all, up
from tests.support.worker import assert_same_greedy, reference_greedy, reference_model

pytestmark = pytest.mark.slow
LONG_TOKENS = 600  # past the 512-token window


@pytest.fixture(scope="module")
def gemma3_dir() -> str:
    return str(converted_gemma3())


@pytest.fixture(scope="module")
def served(gemma3_dir):
    """`up` on the GGUF file itself (resolved to the converted dir gemma3_dir is), KV room for both prompts."""
    listen = f"127.0.0.1:{free_port()}"
    proc = up(str(gemma3_gguf()), listen, "--kv-memory", "96MiB")
    try:
        line = proc.stdout.readline()
        assert line.startswith(f"pagedserve is up: {listen}"), line
        yield listen
    finally:
        stop_all(proc)


def generate(listen: str, prompt_ids: list[int], max_tokens: int) -> list[int]:
    with grpc.insecure_channel(listen) as ch:
        stream = generate_pb2_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
            prompt_token_ids=prompt_ids, sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0,
                                                                     ignore_eos=True)), timeout=600)
        return [t for m in stream for t in m.token_ids]


def test_up_serves_gemma3_from_its_gguf_exactly_across_the_sliding_window(served, gemma3_dir):
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(gemma3_dir)
    prompts, new = [tok("The capital of France is")["input_ids"], long_prompt(tok, LONG_TOKENS)], [20, 24]
    with ThreadPoolExecutor(2) as pool:  # at once: the short one decodes beside the long one's prefill chunks
        got = list(pool.map(lambda p, n: generate(served, p, n), prompts, new))
    reference = reference_model(gemma3_dir)
    for ids, prompt, n in zip(got, prompts, new):
        assert_same_greedy(ids, *reference_greedy(reference, prompt, n))


def test_a_conversation_is_refused_naming_the_missing_chat_template(served):
    with grpc.insecure_channel(served) as ch, pytest.raises(grpc.RpcError) as e:
        list(generate_pb2_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
            messages=[pb.ChatMessage(role="user", content="Hello")], sampling=pb.SamplingParams(max_tokens=4)),
            timeout=60))
    assert e.value.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION)
    assert "no chat template" in e.value.details(), e.value.details()
    assert generate(served, [2, 651, 6037], 3).__len__() == 3  # and it keeps serving
