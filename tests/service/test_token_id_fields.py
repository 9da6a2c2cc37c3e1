"""vLLM's return_token_ids and return_tokens_as_token_ids on both endpoints, streamed and not (real processes)."""

from __future__ import annotations

import json

import httpx

PROMPT_IDS = [504, 3575, 282, 4649, 314]  # "The capital of France is" in SmolLM2's vocabulary


def events(http: httpx.Client, path: str, body: dict) -> list[dict]:
    with http.stream("POST", path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_completions_return_the_prompts_and_outputs_token_ids(service, http):
    body = {"model": service.model_dir, "prompt": PROMPT_IDS, "max_tokens": 6, "temperature": 0, "ignore_eos": True,
            "return_token_ids": True}
    whole = http.post("/v1/completions", json=body).json()
    choice = whole["choices"][0]
    assert choice["prompt_token_ids"] == PROMPT_IDS
    assert len(choice["token_ids"]) == whole["usage"]["completion_tokens"] == 6
    text = http.post("/detokenize", json={"tokens": choice["token_ids"]}).json()["prompt"]
    assert text == choice["text"]
    chunks = events(http, "/v1/completions", body)
    assert chunks[0]["choices"][0]["prompt_token_ids"] == PROMPT_IDS
    assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
    assert [t for c in chunks for t in c["choices"][0]["token_ids"]] == choice["token_ids"]
    assert "token_ids" not in http.post("/v1/completions", json={**body, "return_token_ids": False}).json()["choices"][0]


def test_chat_returns_the_rendered_prompts_ids_and_each_choices(service, http):
    body = {"model": service.model_dir, "messages": [{"role": "user", "content": "Hi there"}], "max_tokens": 5,
            "temperature": 0, "ignore_eos": True, "return_token_ids": True, "n": 2, "seed": 3}
    whole = http.post("/v1/chat/completions", json=body).json()
    assert len(whole["prompt_token_ids"]) == whole["usage"]["prompt_tokens"]
    rendered = http.post("/tokenize", json={"messages": body["messages"]}).json()["tokens"]
    assert whole["prompt_token_ids"] == rendered
    assert [len(c["token_ids"]) for c in whole["choices"]] == [5, 5]
    chunks = events(http, "/v1/chat/completions", body)
    assert chunks[0]["prompt_token_ids"] == rendered
    for index in (0, 1):
        streamed = [t for c in chunks for ch in c["choices"] if ch["index"] == index for t in ch.get("token_ids", [])]
        assert streamed == whole["choices"][index]["token_ids"]


def test_logprobs_name_tokens_by_id_when_asked(service, http):
    body = {"model": service.model_dir, "prompt": PROMPT_IDS, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
            "logprobs": 2, "return_token_ids": True, "return_tokens_as_token_ids": True}
    choice = http.post("/v1/completions", json=body).json()["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in choice["token_ids"]]
    assert all(k.startswith("token_id:") for top in choice["logprobs"]["top_logprobs"] for k in top)
    chat = http.post("/v1/chat/completions", json={
        "model": service.model_dir, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3,
        "temperature": 0, "ignore_eos": True, "logprobs": True, "top_logprobs": 1, "return_token_ids": True,
        "return_tokens_as_token_ids": True}).json()["choices"][0]
    entries = chat["logprobs"]["content"]
    assert [e["token"] for e in entries] == [f"token_id:{t}" for t in chat["token_ids"]]
    assert all(e["bytes"] == list(e["token"].encode()) for e in entries)
