"""`pagedserve serve MODEL` as a vLLM user runs it (real processes): served model names, API keys from --api-key,
the utility routes (/tokenize, /detokenize, /version, /ping, /metrics), continuous usage stats."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import httpx
import openai
import pytest

from pagedserve_common.ports import free_port
from tests.support.processes import stop_all

KEY = "serve-test-key"


TEMPLATE = "{% for m in messages %}[{{ m.content }}]{% endfor %}"
MAX_NEW_TOKENS = 9  # the served model's generation_config.json


@pytest.fixture(scope="module")
def served(tiny_served_model, tmp_path_factory):
    """The tiny model with a generation_config.json that makes greedy the default, served with a chat template of
    its own."""
    model_dir = tmp_path_factory.mktemp("served") / "model"
    shutil.copytree(tiny_served_model, model_dir)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": 2, "temperature": 0.0,
                                                                  "max_new_tokens": MAX_NEW_TOKENS}))
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pagedserve_cli.main", "serve", str(model_dir), "--host", "127.0.0.1", "--port",
         str(port), "--served-model-name", "my-model", "alias", "--api-key", KEY, "--listen",
         f"127.0.0.1:{free_port()}", "--worker-listen", f"127.0.0.1:{free_port()}", "--metrics", "", "--kv-memory",
         "4MiB", "--threads", "1", "--dtype", "float32", "--seed", "7", "--chat-template", TEMPLATE],
        stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        line = proc.stdout.readline()  # NOTE: `up` prints it once serving (or exits: then it is empty)
        assert line.startswith("pagedserve is up"), line
        yield f"127.0.0.1:{port}", str(model_dir)
    finally:
        stop_all(proc)


def openai_at(address: str, key: str = KEY) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{address}/v1", api_key=key, max_retries=0, timeout=300)


def test_every_served_name_answers_and_another_is_a_404(served):
    address, model_dir = served
    c = openai_at(address)
    assert [m.id for m in c.models.list().data] == ["my-model", "alias"]
    texts = {name: c.completions.create(model=name, prompt="The capital of France", max_tokens=8, temperature=0)
             for name in ("my-model", "alias")}
    assert texts["my-model"].choices[0].text == texts["alias"].choices[0].text
    assert texts["alias"].model == "alias"
    with pytest.raises(openai.NotFoundError) as exc:
        c.completions.create(model=model_dir, prompt="x", max_tokens=1)
    assert "`my-model`, `alias`" in exc.value.message


def test_the_api_key_is_required_as_a_bearer_or_x_api_key(served):
    address, _ = served
    with pytest.raises(openai.AuthenticationError):
        openai_at(address, "wrong").models.list()
    assert httpx.get(f"http://{address}/v1/models", headers={"x-api-key": KEY}).status_code == 200
    assert httpx.get(f"http://{address}/v1/models").status_code == 401
    both = httpx.get(f"http://{address}/v1/models", headers={"x-api-key": KEY, "authorization": f"Bearer {KEY}"})
    assert both.status_code == 401 and "more than one" in both.json()["error"]["message"]


def test_ping_version_are_open_and_metrics_and_tokenize_need_the_key(served):
    address, _ = served
    assert httpx.get(f"http://{address}/ping").status_code == 200
    assert httpx.post(f"http://{address}/ping").status_code == 200
    from importlib.metadata import version
    assert httpx.get(f"http://{address}/version").json() == {"version": version("pagedserve")}
    assert httpx.get(f"http://{address}/metrics").status_code == 401
    text = httpx.get(f"http://{address}/metrics", headers={"authorization": f"Bearer {KEY}"}).text
    assert 'vllm:num_requests_running{model_name="my-model"}' in text
    assert httpx.post(f"http://{address}/tokenize", json={"prompt": "hi"}).status_code == 401


def test_tokenize_counts_what_a_request_is_charged_and_detokenize_inverts_it(served):
    address, _ = served
    auth = {"authorization": f"Bearer {KEY}"}
    prompt = "Tokens are counted the same way everywhere."
    tok = httpx.post(f"http://{address}/tokenize", json={"model": "my-model", "prompt": prompt}, headers=auth).json()
    used = openai_at(address).completions.create(model="my-model", prompt=prompt, max_tokens=1).usage.prompt_tokens
    assert tok["count"] == len(tok["tokens"]) == used and tok["max_model_len"] > 0
    back = httpx.post(f"http://{address}/detokenize", json={"tokens": tok["tokens"]}, headers=auth).json()
    assert back["prompt"].endswith(prompt)
    messages = [{"role": "user", "content": "Hello there"}]
    chat = httpx.post(f"http://{address}/tokenize", json={"messages": messages}, headers=auth).json()
    used = openai_at(address).chat.completions.create(model="my-model", messages=messages, max_tokens=1)
    assert chat["count"] == used.usage.prompt_tokens
    bad = httpx.post(f"http://{address}/detokenize", json={"tokens": [10 ** 9]}, headers=auth)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    unknown = httpx.post(f"http://{address}/v1/nothing", headers=auth)
    assert unknown.status_code == 404 and "POST /v1/chat/completions" in unknown.json()["error"]["message"]


def test_continuous_usage_stats_put_the_usage_so_far_in_every_chunk(served):
    address, _ = served
    chunks = list(openai_at(address).completions.create(
        model="my-model", prompt="Count with me: one, two", max_tokens=6, temperature=0, stream=True,
        extra_body={"ignore_eos": True}, stream_options={"include_usage": True, "continuous_usage_stats": True}))
    with_text = [c for c in chunks if c.choices]
    assert with_text and all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in with_text]
    assert counts == sorted(counts) and counts[-1] == 6
    assert chunks[-1].usage.completion_tokens == 6 and not chunks[-1].choices
    assert {c.usage.prompt_tokens for c in chunks} == {chunks[-1].usage.prompt_tokens}


def test_the_models_generation_config_sets_the_defaults_and_the_chat_template_is_the_flags(served):
    address, _ = served
    c = openai_at(address)
    prompt = "Once upon a time"
    default = c.completions.create(model="my-model", prompt=prompt, max_tokens=12, extra_body={"ignore_eos": True})
    greedy = c.completions.create(model="my-model", prompt=prompt, max_tokens=12, temperature=0,
                                  extra_body={"ignore_eos": True})
    sampled = [c.completions.create(model="my-model", prompt=prompt, max_tokens=12, temperature=1.0, seed=s,
                                    extra_body={"ignore_eos": True}).choices[0].text for s in (1, 2)]
    assert default.choices[0].text == greedy.choices[0].text  # generation_config.json: temperature 0
    assert greedy.choices[0].text not in sampled  # NOTE: a set temperature wins (a random model samples apart)
    auth = {"authorization": f"Bearer {KEY}"}
    # max_tokens unset: generation_config.json's max_new_tokens, for completions (the default's place) and for chat
    # (which would otherwise generate to the context's end), as vLLM
    unset = [c.completions.create(model="my-model", prompt=prompt, extra_body={"ignore_eos": True}),
             c.chat.completions.create(model="my-model", messages=[{"role": "user", "content": prompt}],
                                       extra_body={"ignore_eos": True})]
    assert [(u.usage.completion_tokens, u.choices[0].finish_reason) for u in unset] == [(MAX_NEW_TOKENS, "length")] * 2
    chat = httpx.post(f"http://{address}/tokenize", headers=auth,
                      json={"messages": [{"role": "user", "content": "Hello there"}]}).json()
    text = httpx.post(f"http://{address}/tokenize", headers=auth, json={"prompt": "[Hello there]"}).json()
    assert chat["tokens"] == text["tokens"]
