"""Penalties, logit_bias, min_tokens and bad_words through a real scheduler and worker serving the default model, on
both APIs (gRPC and the official `openai` client): each changes a greedy output as it should, against transformers'
own generate (repetition_penalty) or a float64 reference of the rules over transformers' forward (presence and
frequency)."""

from __future__ import annotations

import re
from collections import Counter

import openai
import pytest
import torch

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc
from tests.support.service import idle, started_service, wait_until
from pagedserve_common.sampling import SamplingParams
from tests.support.worker import assert_same_within_ties, reference_model, reference_rules

NEW = 40
POEM = [{"role": "user", "content": "Write a short poem about the sea."}]
HI = [{"role": "user", "content": "Say hi."}]  # greedy: 24 tokens, then EOS


@pytest.fixture(scope="module")
def service(model_dir, tmp_path_factory):
    with started_service(model_dir, "--max-num-seqs", "8", kv_memory=str(64 << 20),
                         log=tmp_path_factory.mktemp("controls") / "scheduler.log") as s:
        yield s


@pytest.fixture(scope="module")
def model(model_dir):
    return reference_model(model_dir)


def grpc_tokens(service, messages=None, prompt_token_ids=None, **sampling) -> list[int]:
    with service.channel() as ch:
        msgs = list(generate_pb2_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
            messages=[pb.ChatMessage(**m) for m in messages or ()], prompt_token_ids=prompt_token_ids,
            sampling=pb.SamplingParams(max_tokens=NEW, temperature=0, **sampling)), timeout=300))
    return [t for m in msgs for t in m.token_ids]


def http_completion(client, service, prompt_ids: list[int], **extra):
    """A greedy completion of token ids over HTTP; the body's extra fields as vLLM's clients send them."""
    return client.completions.create(model=service.model_dir, prompt=prompt_ids, max_tokens=NEW, temperature=0,
                                     extra_body=extra)


def reference_generate(model, prompt: list[int], **kwargs) -> tuple[list[int], list[float]]:
    """transformers' greedy generate: the new tokens and each step's gap between the two best processed scores."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=NEW, pad_token_id=2,
                             output_scores=True, return_dict_in_generate=True, **kwargs)
    gaps = [float(v[0] - v[1]) for v in (torch.topk(s[0].double(), 2).values for s in out.scores)]
    return out.sequences[0, len(prompt):].tolist(), gaps


def test_repetition_penalty_matches_transformers_generate_on_both_apis(service, client, tok, model):
    prompt = tok.encode_chat(POEM)
    plain = grpc_tokens(service, prompt_token_ids=prompt)
    got = grpc_tokens(service, prompt_token_ids=prompt, repetition_penalty=1.3)
    assert got != plain
    assert_same_within_ties(got, *reference_generate(model, prompt, repetition_penalty=1.3))
    out = http_completion(client, service, prompt, repetition_penalty=1.3)
    assert out.choices[0].text == tok.decode(got)


def test_presence_and_frequency_penalties_match_a_float64_reference_on_both_apis(service, client, tok, model):
    prompt = tok.encode_chat(POEM)
    plain = grpc_tokens(service, prompt_token_ids=prompt)
    got = grpc_tokens(service, prompt_token_ids=prompt, presence_penalty=0.8, frequency_penalty=0.6)
    assert got != plain
    sp = SamplingParams(presence_penalty=0.8, frequency_penalty=0.6)
    assert_same_within_ties(got, *reference_rules(model, prompt, sp, NEW, tok.eos_token_ids))
    out = client.completions.create(model=service.model_dir, prompt=prompt, max_tokens=NEW, temperature=0,
                                    presence_penalty=0.8, frequency_penalty=0.6)  # OpenAI's own parameters
    assert out.choices[0].text == tok.decode(got)


def test_logit_bias_minus_100_bans_a_token_and_plus_100_forces_one(service, client, tok):
    prompt = tok.encode_chat(POEM)
    plain = grpc_tokens(service, prompt_token_ids=prompt)
    first = plain[0]
    banned = grpc_tokens(service, prompt_token_ids=prompt, logit_bias={first: -100.0})
    assert banned and first not in banned
    forced_id = tok.encode(" banana", add_special_tokens=False)[0]
    assert grpc_tokens(service, prompt_token_ids=prompt, logit_bias={forced_id: 100.0}) == [forced_id] * NEW
    out = client.completions.create(model=service.model_dir, prompt=prompt, max_tokens=NEW, temperature=0,
                                    logit_bias={str(first): -100})
    assert out.choices[0].text == tok.decode(banned)
    chat = client.chat.completions.create(model=service.model_dir, messages=POEM, max_tokens=8, temperature=0,
                                          logit_bias={str(forced_id): 100})
    assert chat.choices[0].message.content == tok.decode([forced_id] * 8)


def test_min_tokens_30_outlasts_a_reply_that_ends_early(service, client):
    plain = client.chat.completions.create(model=service.model_dir, messages=HI, max_tokens=100, temperature=0)
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens < 30
    out = client.chat.completions.create(model=service.model_dir, messages=HI, max_tokens=100, temperature=0,
                                         extra_body={"min_tokens": 30})
    assert out.usage.completion_tokens >= 30
    assert out.choices[0].message.content.startswith(plain.choices[0].message.content.rstrip("?!."))
    with service.channel() as ch:
        msgs = list(generate_pb2_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
            messages=[pb.ChatMessage(**m) for m in HI],
            sampling=pb.SamplingParams(max_tokens=100, temperature=0, min_tokens=30)), timeout=300))
    assert sum(len(m.token_ids) for m in msgs) == out.usage.completion_tokens
    # without max_tokens (a chat runs to the end of the context): the same reply
    unbounded = client.chat.completions.create(model=service.model_dir, messages=HI, temperature=0,
                                               extra_body={"min_tokens": 30})
    assert unbounded.choices[0].message.content == out.choices[0].message.content


def test_min_tokens_holds_back_a_stop_string_until_then(service, client):
    plain = client.chat.completions.create(model=service.model_dir, messages=HI, max_tokens=40, temperature=0,
                                           stop=["there"])
    assert plain.choices[0].finish_reason == "stop" and plain.usage.completion_tokens < 5
    out = client.chat.completions.create(model=service.model_dir, messages=HI, max_tokens=40, temperature=0,
                                         stop=["there"], extra_body={"min_tokens": 5})
    assert out.usage.completion_tokens >= 5


def words(text: str) -> list[str]:
    return re.findall(r"[A-Za-z]+", text)


def test_bad_words_remove_a_word_on_both_apis(service, client, tok):
    plain = client.chat.completions.create(model=service.model_dir, messages=POEM, max_tokens=NEW, temperature=0)
    text = plain.choices[0].message.content
    word = Counter(w for w in words(text) if len(w) > 4).most_common(1)[0][0]  # "canvas", twice
    out = client.chat.completions.create(model=service.model_dir, messages=POEM, max_tokens=NEW, temperature=0,
                                         extra_body={"bad_words": [word]})
    assert word in words(text) and word not in words(out.choices[0].message.content)
    got = grpc_tokens(service, messages=POEM, bad_words=[word])
    assert tok.decode(got) == out.choices[0].message.content
    # the client's own token sequences: banning the word's tokenization after a space does the same
    by_ids = grpc_tokens(service, messages=POEM, bad_words_token_ids=[
        pb.TokenIds(token_ids=tok.encode(" " + word, add_special_tokens=False)),
        pb.TokenIds(token_ids=tok.encode(word, add_special_tokens=False))])
    assert by_ids == got


def test_a_refused_control_leaves_the_service_serving(service, client):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=service.model_dir, prompt="hi", max_tokens=4, logit_bias={"99999": 5})
    assert e.value.body["param"] == "logit_bias" and "vocabulary" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=service.model_dir, prompt="hi", max_tokens=4, frequency_penalty=3)
    assert e.value.body["param"] == "frequency_penalty"
    wait_until(lambda: idle(service))
