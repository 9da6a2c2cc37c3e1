"""Accuracy of the KV cache dtypes on Newton's Opticks, through the worker's runner and paged pool (issue 25)."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from pagedserve_cli.bench.corpus import corpus_token_ids
from pagedserve_cli.bench.greedy import agreement, greedy_tokens, held_out_prompts
from pagedserve_cli.bench.perplexity import compare, kl_sum, nll, perplexity, scoring_runner, sibling_runner
from tests.support.network import CORPUS_MARK

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def text(model_dir) -> list[int]:
    return corpus_token_ids(model_dir)


@pytest.fixture(scope="module")
def float32_runner(model_dir):
    """A float32 cache, built as `pagedserve worker` builds it (the C++ kernel where it loads)."""
    return scoring_runner(model_dir, "float32", kv_memory=64 << 20, threads=1)


@CORPUS_MARK
def test_float32_cache_perplexity_is_transformers_own(model_dir, text, float32_runner):
    """One 512-token window prefilled 128 tokens per step (each chunk reading the earlier chunks' KV from the
    pool) scores the same summed NLL as transformers' forward over the whole window."""
    tokens = text[:512]
    scored = perplexity(float32_runner, tokens, window=512, chunk=128)
    ref_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    with torch.inference_mode():
        logits = ref_model.eval()(torch.tensor([tokens])).logits[0, :-1]
    expected = nll(logits, tokens[1:])
    assert scored.num_tokens == 511
    assert abs(scored.nll_sum - expected) <= 1e-4 * expected, (scored.nll_sum, expected)


@CORPUS_MARK
def test_8bit_caches_stay_within_the_bounds_and_their_kl_against_float32_is_small(text, float32_runner):
    runners = {"float32": float32_runner, "int8": sibling_runner(float32_runner, "int8"),
               "fp8_e4m3": sibling_runner(float32_runner, "fp8_e4m3")}
    scored = compare(runners, "float32", text[:1024], window=1024, chunk=256)
    base = scored["float32"].perplexity
    assert all(s.num_tokens == 1023 for s in scored.values())
    assert scored["float32"].kl_sum == 0.0
    assert abs(scored["int8"].perplexity / base - 1) <= 0.01
    assert abs(scored["fp8_e4m3"].perplexity / base - 1) <= 0.03
    assert 0 < scored["int8"].mean_kl < scored["fp8_e4m3"].mean_kl < 0.05


@CORPUS_MARK
def test_a_cache_dtype_against_itself_on_another_pool_has_kl_zero(text, float32_runner):
    twin = sibling_runner(float32_runner, "float32")
    scored = compare({"float32": float32_runner, "twin": twin}, "float32", text[:256], window=256, chunk=128)
    assert scored["twin"].kl_sum == 0.0 and scored["twin"].perplexity == scored["float32"].perplexity


def test_kl_of_a_distribution_against_itself_is_zero_and_positive_otherwise():
    p = torch.randn(300, 64, generator=torch.Generator().manual_seed(0))
    assert kl_sum(p, p) == 0.0
    assert kl_sum(p, p + 0.1 * torch.randn(300, 64)) > 0


@CORPUS_MARK
def test_greedy_agreement_of_a_runner_with_itself_is_total(text, float32_runner):
    prompts = held_out_prompts(text, 1024, num_prompts=4, prompt_len=32)
    first, again = greedy_tokens(float32_runner, prompts, 16, batch=3), greedy_tokens(float32_runner, prompts, 16)
    a = agreement(first, again)
    assert (a.share, a.mean_first_divergence, a.num_positions) == (1.0, 16.0, 64)
    assert all(len(t) == 16 for t in first)


def test_agreement_counts_equal_positions_and_tokens_before_the_first_difference():
    a = agreement([[1, 2, 3, 4], [5, 6, 7, 8]], [[1, 2, 9, 4], [5, 6, 7, 8]])
    assert (a.num_equal, a.num_positions, a.share) == (7, 8, 7 / 8)
    assert a.mean_first_divergence == (2 + 4) / 2


def test_held_out_prompts_are_disjoint_and_past_the_scored_slice():
    prompts = held_out_prompts(list(range(1000)), 200, num_prompts=8, prompt_len=10)
    assert len(prompts) == 8 and all(len(p) == 10 for p in prompts)
    assert min(p[0] for p in prompts) == 200 and len({t for p in prompts for t in p}) == 80
    with pytest.raises(ValueError, match="disjoint"):
        held_out_prompts(list(range(300)), 200, num_prompts=8, prompt_len=20)
