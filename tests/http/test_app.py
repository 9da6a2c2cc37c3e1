"""The OpenAI-compatible HTTP front against a real scheduler and worker: the official `openai` client and curl."""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess

import httpx
import openai
import pytest

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc
from tests.support.service import idle, recv_until, wait_until

PROMPT = "The capital of France is"


def grpc_samples(service, **fields) -> list[dict]:
    """Per sample: text, token ids and finish reason, through the gRPC API (the reference)."""
    sampling = fields.pop("sampling", {})
    with service.channel() as ch:
        msgs = list(generate_pb2_grpc.GenerationStub(ch).Generate(
            pb.GenerateRequest(**fields, sampling=pb.SamplingParams(**sampling)), timeout=120))
    out: dict[int, dict] = {}
    for m in msgs:
        s = out.setdefault(m.index, {"text": "", "token_ids": [], "finish_reason": None})
        s["text"] += m.text
        s["token_ids"] += list(m.token_ids)
        if m.finish_reason:
            s["finish_reason"] = pb.FinishReason.Name(m.finish_reason)
    return [out[i] for i in sorted(out)]


def test_models_and_health(service, client):
    models = client.models.list().data
    assert [m.id for m in models] == [service.model_dir] and models[0].max_model_len == 512
    r = httpx.get(f"http://{service.http}/health", timeout=10)
    assert (r.status_code, r.json()) == (200, {"status": "ok"})


def test_models_retrieve_names_the_served_model_and_404s_any_other(service, client):
    model = client.models.retrieve(service.model_dir)  # NOTE: a path: the client sends its slashes as %2F
    assert (model.id, model.object, model.owned_by) == (service.model_dir, "model", "pagedserve")
    assert model.max_model_len == 512
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("gpt-4o")
    assert (e.value.body["param"], e.value.body["code"]) == ("model", "model_not_found")
    assert "gpt-4o" in e.value.body["message"] and e.value.body["type"] == "invalid_request_error"


@pytest.mark.parametrize("method, path, status", [("get", "/nowhere", 404), ("get", "/completions", 405),
                                                  ("delete", "/models", 405)])
def test_unknown_routes_and_methods_answer_in_openais_shape(service, client, method, path, status):
    with pytest.raises(openai.APIStatusError) as e:
        getattr(client, method)(path, cast_to=httpx.Response)
    assert e.value.status_code == status
    assert set(e.value.body) == {"message", "type", "param", "code"}  # the client hands over the "error" object
    assert f"{method.upper()} /v1{path}" in e.value.body["message"]


def test_completion_greedy_equals_the_grpc_api(service, client):
    ref = grpc_samples(service, prompt=PROMPT, sampling={"max_tokens": 12, "temperature": 0, "ignore_eos": True})
    out = client.completions.create(model=service.model_dir, prompt=PROMPT, max_tokens=12, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert [c.text for c in out.choices] == [ref[0]["text"]] and out.choices[0].finish_reason == "length"
    assert out.object == "text_completion" and out.id.startswith("cmpl-")
    assert (out.usage.completion_tokens, out.usage.total_tokens) == (12, out.usage.prompt_tokens + 12)
    # token ids as the prompt, and streamed: the same text
    ids = ref[0]["token_ids"][:3]
    by_ids = grpc_samples(service, prompt_token_ids=ids, sampling={"max_tokens": 6, "temperature": 0,
                                                                   "ignore_eos": True})
    chunks = list(client.completions.create(model=service.model_dir, prompt=ids, max_tokens=6, temperature=0,
                                            stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks) == by_ids[0]["text"]
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.usage is None for c in chunks)  # no include_usage: no usage chunk


def test_streamed_completion_with_include_usage_ends_with_the_usage_chunk(service, client):
    chunks = list(client.completions.create(model=service.model_dir, prompt=PROMPT, max_tokens=5, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 5 and last.usage.prompt_tokens > 0
    assert all(c.usage is None for c in body) and body[-1].choices[0].finish_reason == "length"


def test_n2_with_a_seed_gives_the_grpc_apis_samples(service, client):
    sampling = {"max_tokens": 8, "temperature": 1.0, "seed": 1234, "n": 2, "ignore_eos": True}
    ref = grpc_samples(service, prompt=PROMPT, sampling=sampling)
    out = client.completions.create(model=service.model_dir, prompt=PROMPT, max_tokens=8, temperature=1.0,
                                    seed=1234, n=2, extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1]
    assert [c.text for c in out.choices] == [s["text"] for s in ref]
    assert out.usage.completion_tokens == 16


def test_a_batch_of_prompts_numbers_its_choices_prompt_major(service, client):
    prompts = [PROMPT, "Once upon a time"]
    refs = [grpc_samples(service, prompt=p, sampling={"max_tokens": 4, "temperature": 0, "n": 2,
                                                      "ignore_eos": True}) for p in prompts]
    out = client.completions.create(model=service.model_dir, prompt=prompts, max_tokens=4, temperature=0, n=2,
                                    extra_body={"ignore_eos": True})
    assert [c.index for c in out.choices] == [0, 1, 2, 3]
    assert [c.text for c in out.choices] == [s["text"] for ref in refs for s in ref]


def test_a_stop_string_ends_the_text_before_it(service, client):
    ref = grpc_samples(service, prompt=PROMPT, sampling={"max_tokens": 16, "temperature": 0, "ignore_eos": True})
    text = ref[0]["text"]
    stop = text[len(text) // 2:len(text) // 2 + 3]
    assert stop.strip(), text
    stopped = grpc_samples(service, prompt=PROMPT, sampling={"max_tokens": 16, "temperature": 0,
                                                             "ignore_eos": True, "stop": [stop]})
    out = client.completions.create(model=service.model_dir, prompt=PROMPT, max_tokens=16, temperature=0,
                                    stop=stop, extra_body={"ignore_eos": True})
    assert out.choices[0].text == stopped[0]["text"] == text[:text.index(stop)]
    assert out.choices[0].finish_reason == "stop" and stopped[0]["finish_reason"] == "FINISH_REASON_STOP_STRING"


def test_logprobs_come_per_token(service, client):
    out = client.completions.create(model=service.model_dir, prompt=PROMPT, max_tokens=4, temperature=0,
                                    logprobs=2, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == out.choices[0].text
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert len(top) == 2 and logprob <= 0 and top[token] == pytest.approx(logprob)  # greedy: the top one


def test_chat_sync_and_async_streaming_equal_the_grpc_apis_chat(service, client):
    messages = [{"role": "user", "content": "Name a color."}]
    ref = grpc_samples(service, messages=[pb.ChatMessage(**m) for m in messages],
                       sampling={"max_tokens": 10, "temperature": 0, "ignore_eos": True})
    out = client.chat.completions.create(model=service.model_dir, messages=messages, max_completion_tokens=10,
                                         temperature=0, extra_body={"ignore_eos": True})
    assert out.object == "chat.completion" and out.choices[0].message.role == "assistant"
    assert out.choices[0].message.content == ref[0]["text"] and out.choices[0].finish_reason == "length"

    async def stream() -> tuple[str, list]:
        async with openai.AsyncOpenAI(base_url=f"http://{service.http}/v1", api_key="unused",
                                      max_retries=0) as aclient:
            chunks = [c async for c in await aclient.chat.completions.create(
                model=service.model_dir, messages=messages, max_tokens=10, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True})]
            plain = await aclient.chat.completions.create(model=service.model_dir, messages=messages, max_tokens=10,
                                                          temperature=0, extra_body={"ignore_eos": True})
        return plain.choices[0].message.content, chunks

    plain, chunks = asyncio.run(stream())
    assert plain == ref[0]["text"]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ref[0]["text"]
    assert chunks[-1].usage.completion_tokens == 10 and chunks[-2].choices[0].finish_reason == "length"


def test_chat_without_max_tokens_runs_to_the_context_or_eos(service, client):
    out = client.chat.completions.create(model=service.model_dir, temperature=0,
                                         messages=[{"role": "user", "content": "Hi"}])
    u = out.usage
    assert out.choices[0].finish_reason in ("stop", "length")
    if out.choices[0].finish_reason == "length":  # the tiny model: 512 tokens of context, or what the pool holds
        assert u.prompt_tokens + u.completion_tokens in (512, 40 * 16)
    assert idle(service) or wait_until(lambda: idle(service)) is None


@pytest.mark.parametrize("kwargs, status, param", [
    ({"temperature": -1}, 400, "temperature"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"n": 0}, 400, "n"),
    ({"extra_body": {"top_k": -5}}, 400, "top_k"),
    ({"extra_body": {"stop_token_ids": [10**9]}}, 400, "stop_token_ids"),
    ({"logprobs": 21}, 400, "logprobs"),
    ({"extra_body": {"use_beam_search": True}}, 400, "use_beam_search"),
    ({"frequency_penalty": 2.5}, 400, "frequency_penalty"),  # beyond [-2, 2]
    ({"prompt": [49152]}, 400, "prompt"),
    ({"prompt": "x " * 600}, 400, "prompt"),
    ({"model": "gpt-4o"}, 404, "model"),
])
def test_errors_come_in_openais_shape_naming_the_parameter(service, client, kwargs, status, param):
    args = {"model": service.model_dir, "prompt": PROMPT, "max_tokens": 4, **kwargs}
    with pytest.raises(openai.APIStatusError) as e:
        client.completions.create(**args)
    assert e.value.status_code == status
    body = e.value.body  # the client hands over the "error" object
    assert body["param"] == param and param in body["message"] or status == 404, body
    assert body["type"] == ("invalid_request_error" if status in (400, 404) else body["type"])
    ok = client.completions.create(model=service.model_dir, prompt=PROMPT, max_tokens=2)  # still serving
    assert ok.usage.completion_tokens >= 1
    wait_until(lambda: idle(service))  # and nothing holds a block


def test_a_bad_chat_and_a_bad_body_are_400s(service, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=service.model_dir, messages=[], max_tokens=4)
    assert e.value.body["param"] == "messages"
    r = httpx.post(f"http://{service.http}/v1/completions", content=b"{not json", timeout=10,
                   headers={"content-type": "application/json"})
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(f"http://{service.http}/v1/completions", json={"max_tokens": 3}, timeout=10)
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


@pytest.mark.skipif(shutil.which("curl") is None, reason="curl is not installed")
def test_curl_sees_sse_frames_ending_with_done(service):
    body = {"model": service.model_dir, "prompt": PROMPT, "max_tokens": 5, "temperature": 0, "stream": True,
            "ignore_eos": True, "stream_options": {"include_usage": True}}
    out = subprocess.run(["curl", "-sN", f"http://{service.http}/v1/completions", "-H",
                          "Content-Type: application/json", "-d", json.dumps(body)],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert out.endswith("\n\n") and not out.endswith("\n\n\n")
    events = out[:-2].split("\n\n")
    assert all(e.startswith("data: ") and "\n" not in e for e in events), out
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(e[6:]) for e in events[:-1]]
    assert [c["object"] for c in chunks] == ["text_completion"] * len(chunks)
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    ref = grpc_samples(service, prompt=PROMPT, sampling={"max_tokens": 5, "temperature": 0, "ignore_eos": True})
    assert "".join(c["choices"][0]["text"] for c in chunks if c["choices"]) == ref[0]["text"]


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_frees_its_blocks(service, stream):
    """A long request is cut off by its client while it holds blocks: the request leaves the scheduler and its
    blocks the pool at once, as an abort (no end-to-end latency is recorded: it never finished).

    NOTE: the worker is paused (SIGSTOP) for the cut, so the request cannot run to its end first: the tiny model
    makes its 500 tokens in about a second, less than a loaded machine may keep this test waiting. Paused, its
    first step stays in flight, and the state asserted is the scheduler's (GetKVState), polled."""
    import socket

    finished = service.metric("pagedserve_e2e_seconds_count")
    body = json.dumps({"model": service.model_dir, "prompt": PROMPT, "max_tokens": 500, "temperature": 0,
                       "stream": stream, "ignore_eos": True}).encode()
    host, port = service.http.rsplit(":", 1)
    with service.worker_paused():
        with socket.create_connection((host, int(port)), timeout=60) as sock:
            sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: %s\r\nContent-Type: application/json\r\n"
                         b"Content-Length: %d\r\n\r\n%s" % (service.http.encode(), len(body), body))
            wait_until(lambda: len(service.live_request_ids()) == 1)  # admitted: holds blocks, a step in flight
            if stream:  # the event stream is open: its headers came before any token
                head = recv_until(sock, b"\r\n\r\n")
                assert head.startswith(b"HTTP/1.1 200") and b"text/event-stream" in head
        wait_until(lambda: service.live_request_ids() == [])  # the disconnect aborted it; its blocks are free
    wait_until(lambda: idle(service))  # the gauges, exported after the worker's next step
    assert service.metric("pagedserve_e2e_seconds_count") == finished
    out = grpc_samples(service, prompt=PROMPT, sampling={"max_tokens": 3, "temperature": 0, "ignore_eos": True})
    assert len(out[0]["token_ids"]) == 3  # and the worker, resumed, serves on
