"""vLLM's allowed_token_ids through a real scheduler and worker (the tiny served model, float32 on both sides): a
greedy output on either HTTP endpoint and over gRPC is transformers' own generate under a LogitsProcessor that masks
every other id, and every token, sampled or greedy, is on the list; min_tokens masks the listed EOS until then; an
id outside the vocabulary, or EOS alone with min_tokens, is a 400 naming the field, and the server goes on
serving."""

from __future__ import annotations

import random

import httpx
import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc
from scheduler_svc.frontend import Tokenizer
from tests.support.service import idle, wait_until
from tests.support.worker import assert_same_within_ties, reference_model

NEW = 12
PROMPT = "The capital of France is"
CHAT = [{"role": "user", "content": "Name a colour."}]
VOCAB = 49152  # the tiny served model's (SmolLM2's tokenizer)


@pytest.fixture(scope="module")
def model(service):
    return reference_model(service.model_dir)


@pytest.fixture(scope="module")
def allowed(service, http) -> list[int]:
    """40 ids, none an end-of-sequence token (every output runs its NEW tokens) nor a token of the unrestricted
    greedy output (so the list changes it)."""
    plain = complete(http, service, PROMPT)[1]
    banned = {*Tokenizer.from_model_dir(service.model_dir).eos_token_ids, *plain}
    rng = random.Random(0)
    return sorted(rng.sample(sorted(set(range(VOCAB)) - banned), 40))


class AllowOnly(LogitsProcessor):
    """transformers' side: -inf on every score but the listed ids'."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = torch.tensor(ids)

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        mask = torch.full_like(scores, float("-inf"))
        mask[:, self.ids] = 0.0
        return scores + mask


def reference(model, prompt: list[int], allowed: list[int]) -> tuple[list[int], list[float]]:
    """transformers' greedy generate under AllowOnly: the new tokens and each step's gap between the two best
    processed scores (a near tie may go either way)."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW, pad_token_id=2,
                             logits_processor=LogitsProcessorList([AllowOnly(allowed)]), output_scores=True,
                             return_dict_in_generate=True)
    gaps = [float(v[0] - v[1]) for v in (torch.topk(s[0].double(), 2).values for s in out.scores)]
    return out.sequences[0, len(prompt):].tolist(), gaps


def complete(http: httpx.Client, service, prompt, **fields) -> tuple[list[int], list[int]]:
    """(prompt ids, output ids) of a greedy /v1/completions."""
    r = http.post("/v1/completions", json={"model": service.model_dir, "prompt": prompt, "max_tokens": NEW,
                                           "temperature": 0, "return_token_ids": True, **fields})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["prompt_token_ids"], choice["token_ids"]


def shuffled_with_repeats(ids: list[int]) -> list[int]:
    """The list as a client may send it: out of order, some ids twice (the server sorts and dedupes)."""
    return list(reversed(ids)) + ids[:5]


def test_completions_greedy_output_is_transformers_generate_under_the_same_mask(service, http, model, allowed):
    prompt, got = complete(http, service, PROMPT, allowed_token_ids=shuffled_with_repeats(allowed))
    assert len(got) == NEW and set(got) <= set(allowed)
    assert_same_within_ties(got, *reference(model, prompt, allowed))


def test_chat_greedy_output_is_transformers_generate_under_the_same_mask(service, http, model, allowed):
    r = http.post("/v1/chat/completions", json={"model": service.model_dir, "messages": CHAT, "max_tokens": NEW,
                                                "temperature": 0, "return_token_ids": True,
                                                "allowed_token_ids": allowed})
    assert r.status_code == 200, r.text
    body = r.json()
    got = body["choices"][0]["token_ids"]
    assert len(got) == NEW and set(got) <= set(allowed)
    assert_same_within_ties(got, *reference(model, body["prompt_token_ids"], allowed))


def test_grpc_gives_the_http_tokens(service, http, allowed):
    prompt, by_http = complete(http, service, PROMPT, allowed_token_ids=allowed)
    with service.channel() as ch:
        msgs = list(generate_pb2_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
            prompt_token_ids=prompt, sampling=pb.SamplingParams(max_tokens=NEW, temperature=0,
                                                                allowed_token_ids=shuffled_with_repeats(allowed))),
            timeout=300))
    assert [t for m in msgs for t in m.token_ids] == by_http


def test_sampled_tokens_stay_on_the_list(service, http, allowed):
    r = http.post("/v1/completions", json={"model": service.model_dir, "prompt": PROMPT, "max_tokens": NEW,
                                           "temperature": 1.0, "seed": 5, "n": 3, "return_token_ids": True,
                                           "allowed_token_ids": allowed})
    assert r.status_code == 200, r.text
    for choice in r.json()["choices"]:
        assert len(choice["token_ids"]) == NEW and set(choice["token_ids"]) <= set(allowed)


def test_min_tokens_masks_a_listed_eos_until_then(service, http):
    eos = Tokenizer.from_model_dir(service.model_dir).eos_token_ids[0]
    word = 1000
    _, got = complete(http, service, PROMPT, allowed_token_ids=[eos, word], min_tokens=3, max_tokens=6)
    assert got[:3] == [word] * 3 and set(got) <= {eos, word}
    # with ignore_eos, EOS neither ends the sample nor is masked: a list of EOS alone is served
    _, got = complete(http, service, PROMPT, allowed_token_ids=[eos], min_tokens=3, max_tokens=4, ignore_eos=True)
    assert got == [eos] * 4


def test_an_id_outside_the_vocabulary_is_a_400_naming_the_field_and_the_server_goes_on(service, http, allowed):
    before = complete(http, service, PROMPT, allowed_token_ids=allowed)
    r = http.post("/v1/completions", json={"model": service.model_dir, "prompt": PROMPT, "max_tokens": NEW,
                                           "allowed_token_ids": [5, VOCAB]})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "allowed_token_ids" and str(VOCAB) in err["message"] and "vocabulary" in err["message"]
    eos = Tokenizer.from_model_dir(service.model_dir).eos_token_ids
    r = http.post("/v1/chat/completions", json={"model": service.model_dir, "messages": CHAT, "max_tokens": NEW,
                                                "allowed_token_ids": list(eos), "min_tokens": 2})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "allowed_token_ids" and "min_tokens" in r.json()["error"]["message"]
    assert complete(http, service, PROMPT, allowed_token_ids=allowed) == before
    wait_until(lambda: idle(service))
