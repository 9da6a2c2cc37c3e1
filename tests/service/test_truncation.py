"""vLLM's truncate_prompt_tokens and truncation_side (real processes): the prompt's last (or first) N tokens run, a
prompt longer than the context is served with -1, a bad value is refused by name."""

from __future__ import annotations

import httpx
import pytest


@pytest.fixture(scope="module")
def http(service):
    with httpx.Client(base_url=f"http://{service.http}/v1", timeout=120) as c:
        yield c


def complete(http: httpx.Client, service, **fields) -> dict:
    r = http.post("/completions", json={"model": service.model_dir, "max_tokens": 4, "temperature": 0,
                                        "ignore_eos": True, "return_token_ids": True, **fields})
    assert r.status_code == 200, r.text
    return r.json()


def test_the_last_or_first_tokens_run_as_if_sent_alone(service, http):
    ids = list(range(1000, 1010))
    kept = complete(http, service, prompt=ids, truncate_prompt_tokens=3)
    alone = complete(http, service, prompt=ids[-3:])
    assert kept["choices"][0]["prompt_token_ids"] == ids[-3:] and kept["usage"]["prompt_tokens"] == 3
    assert kept["choices"][0]["token_ids"] == alone["choices"][0]["token_ids"]
    right = complete(http, service, prompt=ids, truncate_prompt_tokens=3, truncation_side="right")
    assert right["choices"][0]["prompt_token_ids"] == ids[:3]
    short = complete(http, service, prompt=ids[:2], truncate_prompt_tokens=3)  # shorter: as it is
    assert short["choices"][0]["prompt_token_ids"] == ids[:2]


def test_minus_one_serves_a_prompt_longer_than_the_context(service, http):
    max_model_len = http.get("/models").json()["data"][0]["max_model_len"]
    ids = [1000 + i % 50 for i in range(max_model_len + 20)]
    refused = http.post("/completions", json={"model": service.model_dir, "prompt": ids, "max_tokens": 1})
    assert refused.status_code == 400
    served = complete(http, service, prompt=ids, truncate_prompt_tokens=-1, max_tokens=1)
    assert served["choices"][0]["prompt_token_ids"] == ids[-(max_model_len - 1):]
    text = " ".join(["word"] * (max_model_len + 20))
    assert complete(http, service, prompt=text, truncate_prompt_tokens=-1, max_tokens=1)["usage"]["prompt_tokens"] \
        == max_model_len - 1


@pytest.mark.parametrize("fields, param", [({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
                                           ({"truncate_prompt_tokens": -2}, "truncate_prompt_tokens"),
                                           ({"truncate_prompt_tokens": 10 ** 6}, "truncate_prompt_tokens"),
                                           ({"truncate_prompt_tokens": 2, "truncation_side": "middle"},
                                            "truncation_side")])
def test_a_value_out_of_range_is_refused_by_name(service, http, fields, param):
    r = http.post("/completions", json={"model": service.model_dir, "prompt": "hello there", "max_tokens": 1,
                                        **fields})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
