"""vLLM's chat prompt fields (add_generation_prompt, continue_final_message, add_special_tokens) and chat echo on a
real server: the prompt's ids are transformers' for the same model directory, on /v1/chat/completions and /tokenize;
continue_final_message with add_generation_prompt is a 400 naming both, and the server keeps serving.
(tests/service/test_chat_prompt_fields_scripted.py: a tokenizer that adds a BOS, documents, a template's refusal.)"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.support.service import idle, wait_until

CONTINUED = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello, I"}]
ASKED = [{"role": "user", "content": "Complete this: the sky is"}]
CONTINUE = {"add_generation_prompt": False, "continue_final_message": True}


@pytest.fixture(scope="module")
def hf(service):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(service.model_dir)


def chat(http: httpx.Client, service, **fields) -> dict:
    r = http.post("/v1/chat/completions", json={"model": service.model_dir, "max_tokens": 4, "temperature": 0,
                                                "ignore_eos": True, "return_token_ids": True, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def events(http: httpx.Client, service, **fields) -> list[dict]:
    body = {"model": service.model_dir, "max_tokens": 4, "temperature": 0, "ignore_eos": True, "stream": True,
            **fields}
    with http.stream("POST", "/v1/chat/completions", json=body) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def tokenized(http: httpx.Client, **fields) -> list[int]:
    r = http.post("/tokenize", json=fields)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


@pytest.mark.parametrize("messages", [CONTINUED, ASKED])
@pytest.mark.parametrize("fields", [CONTINUE, {"add_generation_prompt": False}, {}, {"add_special_tokens": True}])
def test_the_prompt_is_transformers_apply_chat_template(service, http, hf, messages, fields):
    """continue_final_message also continues a user's message, as transformers does (it checks no role)."""
    options = {"add_generation_prompt": True, **fields}
    if options.pop("add_special_tokens", False):
        text = hf.apply_chat_template(messages, tokenize=False, **options)
        reference = hf(text, add_special_tokens=True)["input_ids"]
    else:
        reference = hf.apply_chat_template(messages, tokenize=True, return_dict=False, **options)
    answer = chat(http, service, messages=messages, **fields)
    assert answer["prompt_token_ids"] == reference and answer["usage"]["prompt_tokens"] == len(reference)
    assert tokenized(http, messages=messages, **fields) == reference


def test_a_continued_message_ends_the_prompt_inside_it(service, http, hf):
    ids = tokenized(http, messages=CONTINUED, **CONTINUE)
    assert hf.decode(ids).endswith("<|im_start|>assistant\nHello, I")
    assert tokenized(http, messages=CONTINUED) != ids  # the default opens a new assistant turn


@pytest.mark.parametrize("fields", [{}, {"add_special_tokens": False}])
def test_completions_add_special_tokens_as_transformers(service, http, hf, fields):
    prompt = "The capital of France is"
    r = http.post("/v1/completions", json={"model": service.model_dir, "prompt": prompt, "max_tokens": 1,
                                           "return_token_ids": True, **fields})
    assert r.status_code == 200, r.text
    reference = hf(prompt, **fields)["input_ids"]
    assert r.json()["choices"][0]["prompt_token_ids"] == reference
    assert tokenized(http, prompt=prompt, **fields) == reference


def test_echo_puts_the_final_assistant_message_first_streamed_and_not(service, http):
    plain = chat(http, service, messages=CONTINUED, **CONTINUE)["choices"][0]["message"]["content"]
    whole = chat(http, service, messages=CONTINUED, echo=True, **CONTINUE)
    assert whole["choices"][0]["message"]["content"] == "Hello, I" + plain
    assert whole["usage"]["completion_tokens"] == 4  # the echo is the prompt's: not counted as output
    chunks = events(http, service, messages=CONTINUED, echo=True, n=2, **CONTINUE)
    for index in (0, 1):
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"][0]["index"] == index]
        assert deltas[0] == {"role": "assistant", "content": ""}
        assert deltas[1] == {"content": "Hello, I"}  # a chunk of its own, right after the role's
        assert "".join(d.get("content") or "" for d in deltas) == "Hello, I" + plain


def test_echo_of_a_final_user_message_adds_nothing(service, http):
    plain = chat(http, service, messages=ASKED)["choices"][0]["message"]["content"]
    assert chat(http, service, messages=ASKED, echo=True)["choices"][0]["message"]["content"] == plain
    chunks = events(http, service, messages=ASKED, echo=True)
    assert "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks) == plain


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_continue_final_message_with_add_generation_prompt_is_refused_naming_both(service, http, path):
    extra = {"model": service.model_dir, "max_tokens": 1} if path.startswith("/v1") else {}
    for generation_prompt in ({"add_generation_prompt": True}, {}):  # sent, or its default (true), as in vLLM
        r = http.post(path, json={"messages": CONTINUED, "continue_final_message": True, **generation_prompt,
                                  **extra})
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "continue_final_message" and "add_generation_prompt" in error["message"], error
    r = http.post(path, json={"messages": CONTINUED, **CONTINUE, **extra})
    assert r.status_code == 200, r.text  # the server keeps serving
    wait_until(lambda: idle(service))
