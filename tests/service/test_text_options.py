"""The text options on both APIs, with the real default model: include_stop_str_in_output, skip_special_tokens and
completions' echo (the official `openai` client for HTTP, the gRPC stubs for gRPC)."""

from __future__ import annotations

import pytest

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc
from tests.support.service import RPC_TIMEOUT, assert_idle_and_serving, started_service

PROMPT = "The capital of France is"
COLOR = [{"role": "user", "content": "Name a color. Answer in one word."}]
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def service(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("text-options") / "scheduler.log"
    with started_service(model_dir, "--max-num-seqs", "8", kv_memory=str(64 << 20),
                         log=log) as s:
        yield s
        assert_idle_and_serving(s)  # every block went back


def generate(service, **fields) -> list[list[pb.GenerateResponse]]:
    """The gRPC API's responses, per sample."""
    sampling = fields.pop("sampling", {})
    with service.channel() as ch:
        msgs = list(generate_pb2_grpc.GenerationStub(ch).Generate(
            pb.GenerateRequest(**fields, sampling=pb.SamplingParams(**sampling)), timeout=RPC_TIMEOUT))
    out: dict[int, list] = {}
    for m in msgs:
        out.setdefault(m.index, []).append(m)
    return [out[i] for i in sorted(out)]


def joined(responses: list[pb.GenerateResponse]) -> tuple[str, list[int]]:
    return "".join(m.text for m in responses), [t for m in responses for t in m.token_ids]


def test_include_stop_str_in_output_ends_the_text_with_the_stop_string(service, client):
    greedy = {"model": service.model_dir, "prompt": PROMPT, "max_tokens": 16, "temperature": 0}
    full = client.completions.create(**greedy, extra_body={"ignore_eos": True}).choices[0].text
    stop = full.split()[2]  # a word in the middle of the greedy text
    cut = full.index(stop)
    without = client.completions.create(**greedy, stop=[stop]).choices[0]
    assert (without.text, without.finish_reason) == (full[:cut], "stop")
    kept = client.completions.create(**greedy, stop=[stop], extra_body={"include_stop_str_in_output": True})
    assert (kept.choices[0].text, kept.choices[0].finish_reason) == (full[:cut + len(stop)], "stop")
    streamed = client.completions.create(**greedy, stop=[stop], stream=True,
                                         extra_body={"include_stop_str_in_output": True})
    assert "".join(c.choices[0].text for c in streamed) == full[:cut + len(stop)]
    # gRPC: the same field of SamplingParams
    (sample,) = generate(service, prompt=PROMPT, sampling={"max_tokens": 16, "temperature": 0, "stop": [stop],
                                                           "include_stop_str_in_output": True})
    assert joined(sample)[0] == full[:cut + len(stop)]
    assert sample[-1].finish_reason == pb.FINISH_REASON_STOP_STRING


def test_skip_special_tokens_false_keeps_the_closing_special_tokens_text(service, client, tok):
    chat = {"model": service.model_dir, "messages": COLOR, "max_tokens": 64, "temperature": 0}
    default = client.chat.completions.create(**chat).choices[0]
    assert default.finish_reason == "stop" and "<|im_end|>" not in default.message.content
    kept = client.chat.completions.create(**chat, extra_body={"skip_special_tokens": False}).choices[0]
    assert kept.message.content == default.message.content + tok.eos_token
    streamed = client.chat.completions.create(**chat, stream=True, extra_body={"skip_special_tokens": False})
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == kept.message.content
    # gRPC: unset is true; the ids (the end-of-sequence one included) come back either way
    messages = [pb.ChatMessage(**m) for m in COLOR]
    sampling = {"max_tokens": 64, "temperature": 0}
    (skipped,) = generate(service, messages=messages, sampling=sampling)
    (special,) = generate(service, messages=messages, sampling={**sampling, "skip_special_tokens": False})
    assert joined(skipped)[0] == default.message.content and joined(special)[0] == kept.message.content
    assert joined(skipped)[1] == joined(special)[1] and joined(special)[1][-1] in tok.eos_token_ids


def test_echo_puts_the_prompt_first_in_each_choice(service, client, tok):
    args = {"model": service.model_dir, "max_tokens": 8, "temperature": 1.0, "seed": 11, "n": 2,
            "extra_body": {"ignore_eos": True}}
    plain = client.completions.create(prompt=PROMPT, **args)
    echoed = client.completions.create(prompt=PROMPT, echo=True, **args)
    assert [c.text for c in echoed.choices] == [PROMPT + c.text for c in plain.choices]
    assert echoed.usage == plain.usage  # the prompt counts as the prompt, once
    # streamed: the first chunk of each choice is the prompt's text
    chunks = list(client.completions.create(prompt=PROMPT, echo=True, stream=True, **args))
    for index, choice in enumerate(plain.choices):
        texts = [c.choices[0].text for c in chunks if c.choices[0].index == index]
        assert texts[0] == PROMPT and "".join(texts[1:]) == choice.text
    # token ids as the prompt: their decoded text comes first
    ids = tok.encode(PROMPT)
    by_ids = client.completions.create(prompt=ids, echo=True, **args)
    assert [c.text for c in by_ids.choices] == [tok.decode(ids) + c.text for c in plain.choices]


def test_echo_with_logprobs_leads_with_the_prompts_logprobs(service, client, tok):
    """OpenAI's legacy shape (tests/service/test_prompt_logprobs.py checks the values against transformers): the
    prompt's tokens first, the first without a logprob, then the completion's."""
    ids = tok.encode(PROMPT)
    out = client.completions.create(model=service.model_dir, prompt=PROMPT, max_tokens=2, echo=True, logprobs=1,
                                    temperature=0)
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 2 and lp.tokens[:len(ids)] == [tok.decode([t]) for t in ids]
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    assert all(len(top) == 1 for top in lp.top_logprobs[1:])
    assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    prompt_only = client.completions.create(model=service.model_dir, prompt=PROMPT, max_tokens=0, echo=True,
                                            logprobs=1)
    assert prompt_only.choices[0].text == PROMPT and prompt_only.usage.completion_tokens == 0
    assert prompt_only.choices[0].logprobs.token_logprobs == lp.token_logprobs[:len(ids)]


def test_grpc_echo_sends_the_prompt_first_for_each_sample(service, tok):
    sampling = {"max_tokens": 6, "temperature": 1.0, "seed": 5, "n": 2, "ignore_eos": True}
    plain = generate(service, prompt=PROMPT, sampling=sampling)
    echoed = generate(service, prompt=PROMPT, sampling=sampling, echo=True)
    ids = tok.encode(PROMPT)
    for ref, sample in zip(plain, echoed, strict=True):
        first = sample[0]
        assert (first.text, list(first.token_ids), len(first.logprobs), first.finish_reason) == (PROMPT, ids, 0, 0)
        assert joined(sample[1:]) == joined(ref)
        usage = sample[-1].usage
        assert (usage.prompt_tokens, usage.completion_tokens) == (len(ids), 6)
