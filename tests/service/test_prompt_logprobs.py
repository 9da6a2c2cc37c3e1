"""Prompt logprobs on every API against a real scheduler and worker (a small --max-num-batched-tokens: every prompt
here is prefilled in chunks): transformers' float32 log_softmax over a held-out text within 1e-4, through gRPC
(GenerateResponse.prompt_logprobs), OpenAI's legacy echo + logprobs, and vLLM's prompt_logprobs field on completions
and chat, streamed and not; every position again on a prefix-cache hit; the same on each of n samples."""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import httpx
import pytest
import torch
from transformers import AutoTokenizer

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc
from tests.support.service import idle, started_service, wait_until
from tests.support.worker import reference_model

TOL = 1e-4
BUDGET = 16  # --max-num-batched-tokens
HELD_OUT = (Path(__file__).parent / "data" / "heldout.txt").read_text().strip()
MAX_ERRORS: dict[str, float] = {}  # what each API measured, printed at the end (-s)


@pytest.fixture(scope="module")
def service(tiny_served_model, tmp_path_factory):
    log = tmp_path_factory.mktemp("prompt-logprobs") / "scheduler.log"
    with started_service(tiny_served_model, "--max-num-seqs", "64", "--max-num-batched-tokens", str(BUDGET),
                         log=log) as s:
        yield s
    print("\nmax |prompt logprob - transformers float32|:", json.dumps(MAX_ERRORS))


@pytest.fixture(scope="module")
def tokenizer(service):
    return AutoTokenizer.from_pretrained(service.model_dir)


@pytest.fixture(scope="module")
def reference(service):
    """ids -> transformers' float32 log_softmax at each row of the prompt (row j scores position j + 1)."""
    model = reference_model(service.model_dir)

    def log_softmax(ids: list[int]) -> torch.Tensor:
        with torch.inference_mode():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return log_softmax


@pytest.fixture(scope="module")
def http(service):
    with httpx.Client(base_url=f"http://{service.http}/v1", timeout=300) as c:
        yield c


def generate(service, **fields) -> list:
    sampling = fields.pop("sampling", {})
    with service.channel() as ch:
        return list(generate_pb2_grpc.GenerationStub(ch).Generate(
            pb.GenerateRequest(**fields, sampling=pb.SamplingParams(**sampling)), timeout=300))


def from_pb(entries) -> list:
    """GenerateResponse.prompt_logprobs as [None, (token, logprob, rank, [(token, logprob), ...]), ...]."""
    return [(e.sampled.token_id, e.sampled.logprob, e.rank, [(t.token_id, t.logprob) for t in e.top])
            if e.HasField("sampled") else None for e in entries]


def from_vllm(entries: list, ids: list[int]) -> list:
    """vLLM's list in the from_pb form: its entry holds the prompt's token (first) and the top ones by rank."""
    out = []
    for p, entry in enumerate(entries):
        if entry is None:
            out.append(None)
            continue
        own = entry[str(ids[p])]
        top = sorted(((int(t), v) for t, v in entry.items() if t != str(ids[p]) or v["rank"] == 1),
                     key=lambda kv: kv[1]["rank"])
        out.append((ids[p], own["logprob"], own["rank"], [(t, v["logprob"]) for t, v in top]))
    return out


def check(got: list, ids: list[int], ref: torch.Tensor, num_top: int, api: str) -> None:
    """Every position against transformers: the token, its logprob and rank, the top ones (within TOL; a near tie
    may order either way), and None first."""
    assert len(got) == len(ids) and got[0] is None, got[:2]
    worst = 0.0
    for p in range(1, len(ids)):
        token, logprob, rank, top = got[p]
        row = ref[p - 1]
        assert token == ids[p]
        worst = max(worst, abs(logprob - row[token].item()))
        assert (row > logprob + TOL).sum() + 1 <= rank <= (row >= logprob - TOL).sum()
        assert len(top) >= min(num_top, len(top)) and len(top) <= num_top + 1
        for (t, v), want in zip(top[:num_top], row.topk(num_top).values):
            worst = max(worst, abs(v - row[t].item()), abs(v - want.item()))
    MAX_ERRORS[api] = max(MAX_ERRORS.get(api, 0.0), worst)
    assert worst <= TOL, (api, worst)


def test_grpc_prompt_logprobs_are_transformers_float32_ones(service, tokenizer, reference):
    ids = tokenizer.encode(HELD_OUT)
    assert len(ids) > 4 * BUDGET  # several prefill chunks
    msgs = generate(service, prompt_token_ids=ids, sampling={"max_tokens": 3, "temperature": 0, "prompt_logprobs": 5})
    got = from_pb(msgs[0].prompt_logprobs)
    check(got, ids, reference(ids), 5, "grpc")
    assert all(len(e[3]) == 5 for e in got[1:])
    assert not any(m.prompt_logprobs for m in msgs[1:])  # on the first message only
    assert sum(len(m.token_ids) for m in msgs) == 3
    # a text prompt: the same, over its own tokens; 0 gives the prompt tokens' own logprobs only
    text = generate(service, prompt=HELD_OUT, sampling={"max_tokens": 1, "prompt_logprobs": 0})
    assert [e[:3] for e in from_pb(text[0].prompt_logprobs)[1:]] == [e[:3] for e in got[1:]]
    assert all(not e[3] for e in from_pb(text[0].prompt_logprobs)[1:])
    wait_until(lambda: idle(service))


def test_grpc_echo_carries_them_and_max_tokens_0_scores_the_prompt_alone(service, tokenizer, reference):
    ids = tokenizer.encode(HELD_OUT)[:40]
    msgs = generate(service, prompt_token_ids=ids, echo=True, sampling={"max_tokens": 2, "prompt_logprobs": 1})
    assert list(msgs[0].token_ids) == ids and msgs[0].text == tokenizer.decode(ids)
    check(from_pb(msgs[0].prompt_logprobs), ids, reference(ids), 1, "grpc")
    assert sum(len(m.token_ids) for m in msgs[1:]) == 2 and not any(m.prompt_logprobs for m in msgs[1:])
    only = generate(service, prompt_token_ids=ids, echo=True, sampling={"max_tokens": 0, "prompt_logprobs": 1})
    assert [list(m.token_ids) for m in only] == [ids, []] and only[1].text == ""
    assert (only[1].finish_reason, only[1].usage.completion_tokens, only[1].usage.prompt_tokens) == \
        (pb.FINISH_REASON_LENGTH, 0, len(ids))
    assert from_pb(only[0].prompt_logprobs) == from_pb(msgs[0].prompt_logprobs)
    with pytest.raises(grpc.RpcError) as e:  # without echo, max_tokens 0 asks for nothing
        generate(service, prompt_token_ids=ids, sampling={"max_tokens": 0})
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_tokens" in e.value.details()
    wait_until(lambda: idle(service))


def test_a_prefix_cache_hit_still_returns_every_position(service, tokenizer):
    ids = tokenizer.encode("A prompt that will be cached. " + HELD_OUT)
    first, second = (generate(service, prompt_token_ids=ids, sampling={"max_tokens": 1, "prompt_logprobs": 2})
                     for _ in range(2))
    assert from_pb(second[0].prompt_logprobs) == from_pb(first[0].prompt_logprobs)  # bit for bit
    assert len(second[0].prompt_logprobs) == len(ids) and second[-1].usage.cached_prompt_tokens == 0
    plain = generate(service, prompt_token_ids=ids, sampling={"max_tokens": 1})  # the cache was filled
    assert plain[-1].usage.cached_prompt_tokens >= len(ids) // 16 * 16 - 16 > 0
    wait_until(lambda: idle(service))


def test_each_of_n_samples_carries_the_same_prompt_logprobs(service, tokenizer, http):
    ids = tokenizer.encode(HELD_OUT)[:50]
    msgs = generate(service, prompt_token_ids=ids, sampling={"max_tokens": 4, "n": 3, "temperature": 1.0,
                                                            "prompt_logprobs": 2})
    firsts = {}
    for m in msgs:
        if m.prompt_logprobs:
            assert m.index not in firsts
            firsts[m.index] = from_pb(m.prompt_logprobs)
    assert sorted(firsts) == [0, 1, 2] and firsts[0] == firsts[1] == firsts[2]
    body = http.post("/completions", json={"model": service.model_dir, "prompt": ids, "max_tokens": 2, "n": 2,
                                           "temperature": 1.0, "prompt_logprobs": 2}).json()
    lists = [c["prompt_logprobs"] for c in body["choices"]]
    assert len(lists) == 2 and lists[0] == lists[1] and from_vllm(lists[0], ids) == firsts[0]
    wait_until(lambda: idle(service))


def legacy(choice: dict) -> tuple:
    lp = choice["logprobs"]
    return lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], lp["text_offset"]


def sse_chunks(http, body: dict) -> list[dict]:
    with http.stream("POST", "/completions" if "prompt" in body else "/chat/completions", json=body) as r:
        assert r.status_code == 200
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("max_tokens", [1, 0])
def test_completions_echo_with_logprobs_leads_with_the_prompts(service, tokenizer, reference, http, max_tokens):
    ids = tokenizer.encode(HELD_OUT)[:60]
    text = tokenizer.decode(ids)
    ref = reference(ids)
    body = {"model": service.model_dir, "prompt": ids, "echo": True, "logprobs": 1, "max_tokens": max_tokens,
            "temperature": 0}
    out = http.post("/completions", json=body).json()
    (choice,) = out["choices"]
    tokens, token_logprobs, top, offsets = legacy(choice)
    assert len(tokens) == len(ids) + max_tokens and choice["text"].startswith(text)
    assert token_logprobs[0] is None and top[0] is None and offsets[0] == 0 and offsets == sorted(offsets)
    got = [None] + [(ids[p], token_logprobs[p], None, []) for p in range(1, len(ids))]
    worst = max(abs(got[p][1] - ref[p - 1, ids[p]].item()) for p in range(1, len(ids)))
    MAX_ERRORS["http echo"] = max(MAX_ERRORS.get("http echo", 0.0), worst)
    assert worst <= TOL
    for p in range(1, len(ids)):  # top-1: the model's argmax there; lm-eval's is_greedy compares with it
        (value,) = top[p].values()
        assert abs(value - ref[p - 1].max().item()) <= TOL
        assert (value == token_logprobs[p]) == (ref[p - 1].argmax().item() == ids[p])
    assert from_vllm(choice["prompt_logprobs"], ids)[1:] and \
        [e[1] for e in from_vllm(choice["prompt_logprobs"], ids)[1:]] == token_logprobs[1:len(ids)]
    if max_tokens == 0:  # vLLM's: the prompt alone is scored, nothing generated
        assert choice["text"] == text and choice["finish_reason"] == "length"
        assert out["usage"]["completion_tokens"] == 0 and out["usage"]["prompt_tokens"] == len(ids)
    # streamed: the echo chunk carries the prompt's part, the same values
    chunks = sse_chunks(http, {**body, "stream": True})
    streamed = [c["choices"][0] for c in chunks if c["choices"]]
    assert legacy(streamed[0]) == (tokens[:len(ids)], token_logprobs[:len(ids)], top[:len(ids)], offsets[:len(ids)])
    assert "".join(c["text"] for c in streamed) == choice["text"]
    wait_until(lambda: idle(service))


def test_vllm_prompt_logprobs_field_on_completions_and_chat(service, tokenizer, reference, http):
    ids = tokenizer.encode(HELD_OUT)[:48]
    ref = reference(ids)
    body = {"model": service.model_dir, "prompt": ids, "max_tokens": 2, "prompt_logprobs": 3, "temperature": 0}
    out = http.post("/completions", json=body).json()
    entries = out["choices"][0]["prompt_logprobs"]
    assert entries[0] is None and out["choices"][0]["logprobs"] is None
    for entry, token in zip(entries[1:], ids[1:]):  # the prompt's token first, then the top 3 (4 at most)
        assert next(iter(entry)) == str(token) and 3 <= len(entry) <= 4
        assert all(set(v) == {"logprob", "rank", "decoded_token"} for v in entry.values())
        assert entry[str(token)]["decoded_token"] == tokenizer.decode([token])
    check(from_vllm(entries, ids), ids, ref, 3, "http completions")
    chunks = sse_chunks(http, {**body, "stream": True})
    carrying = [c for c in chunks if c["choices"] and "prompt_logprobs" in c["choices"][0]]
    assert len(carrying) == 1 and carrying[0]["choices"][0]["prompt_logprobs"] == entries

    # chat: vLLM puts it on the response (one prompt, whatever n); streamed, on the first chunk after the prompt
    messages = [{"role": "user", "content": HELD_OUT[:200]}]
    chat_ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    chat_ids = list(chat_ids["input_ids"] if hasattr(chat_ids, "keys") else chat_ids)  # a BatchEncoding or ids
    chat = {"model": service.model_dir, "messages": messages, "max_tokens": 2, "prompt_logprobs": 2}
    out = http.post("/chat/completions", json=chat).json()
    assert out["usage"]["prompt_tokens"] == len(chat_ids)
    check(from_vllm(out["prompt_logprobs"], chat_ids), chat_ids, reference(chat_ids), 2, "http chat")
    chunks = sse_chunks(http, {**chat, "stream": True})
    carrying = [c for c in chunks if "prompt_logprobs" in c]
    assert len(carrying) == 1 and carrying[0]["prompt_logprobs"] == out["prompt_logprobs"]
    assert chunks.index(carrying[0]) > 0  # not the role chunk: that one goes before the prompt is computed
    wait_until(lambda: idle(service))


@pytest.mark.parametrize("value", [21, -1])
def test_out_of_range_is_refused_by_name(service, http, value):
    for path, body in (("/completions", {"prompt": "Hi"}), ("/chat/completions",
                                                           {"messages": [{"role": "user", "content": "Hi"}]})):
        r = http.post(path, json={"model": service.model_dir, **body, "max_tokens": 1, "prompt_logprobs": value})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_logprobs", r.text
        assert "prompt_logprobs must be in [0, 20]" in r.json()["error"]["message"]
    r = http.post("/completions", json={"model": service.model_dir, "prompt": "Hi", "max_tokens": 0})
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens", r.text  # 0 only with echo
    if value > 0:
        with pytest.raises(grpc.RpcError) as e:
            generate(service, prompt="Hi", sampling={"max_tokens": 1, "prompt_logprobs": value})
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_logprobs" in e.value.details()
