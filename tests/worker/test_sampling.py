"""Sampler tests: greedy, filters, distribution, per-request seed reproducibility, logprobs, validation."""

import dataclasses
import math
import random

import pytest
import torch

from pagedserve_common.sampling import SamplingParams
from pagedserve_common.step import PositionLogprobs
from worker_svc.sampling import Sampler, SampleOutput

S = SamplingParams


def draws(logits_row: torch.Tensor, opt: SamplingParams, n: int, seed: int) -> list[int]:
    """n draws from one distribution as one batch: one seed, row i at position i (n independent uniforms)."""
    seeded = dataclasses.replace(opt, seed=seed)
    out = Sampler().sample(logits_row.expand(n, -1).contiguous(), [seeded] * n, list(range(n)))
    return out.token_ids


def test_greedy_is_argmax_including_mixed_batches():
    torch.manual_seed(0)
    logits = torch.randn(8, 100)
    logits[3, 7] = logits[3, 9] = logits[3].max() + 1  # tie: lowest id wins, like torch.argmax
    opts = [S(temperature=0) if i % 2 else S(temperature=1.5, top_k=10) for i in range(8)]
    out = Sampler().sample(logits, opts, [0] * 8)
    assert isinstance(out, SampleOutput) and len(out.token_ids) == 8
    argmax = logits.argmax(dim=-1).tolist()
    assert argmax[3] == 7
    for i in range(1, 8, 2):
        assert out.token_ids[i] == argmax[i]
    all_greedy = Sampler().sample(logits, [S(temperature=0)] * 8, [0] * 8)
    assert all_greedy.token_ids == argmax
    assert all_greedy.logprobs == [None] * 8


@pytest.mark.parametrize("temperature", [1e-38, 1e-20, 9.9e-6])
def test_a_temperature_under_1e_5_is_greedy_as_in_vllm(temperature):
    """Dividing logits by 1e-38 overflows them to inf: it sampled garbage (issue 50); vLLM's epsilon is 1e-5."""
    logits = torch.randn(6, 300, generator=torch.Generator().manual_seed(11))
    opts = [S(temperature=temperature, seed=i) for i in range(6)]
    assert Sampler().sample(logits, opts, list(range(6))).token_ids == logits.argmax(dim=-1).tolist()
    assert S(temperature=temperature).greedy and not S(temperature=1e-5).greedy


def test_top_k_1_always_picks_argmax():
    logits = torch.randn(50, generator=torch.Generator().manual_seed(1))
    assert set(draws(logits, S(top_k=1), 500, seed=2)) == {int(logits.argmax())}


def test_top_k_samples_only_within_top_k():
    logits = torch.randn(200, generator=torch.Generator().manual_seed(3))
    top5 = set(torch.topk(logits, 5).indices.tolist())
    got = draws(logits, S(temperature=2.0, top_k=5), 3000, seed=4)
    assert set(got) <= top5
    assert len(set(got)) == 5  # high temperature: every allowed token turns up


def test_top_p_samples_only_within_hand_computed_nucleus():
    # 0.5 + 0.3 = 0.8 reaches top_p, so the nucleus is exactly {0, 1}.
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    got = draws(logits, S(top_p=0.8), 3000, seed=5)
    assert set(got) == {0, 1}
    # Renormalised inside the nucleus: 0.5/0.8 = 0.625.
    assert abs(got.count(0) / len(got) - 0.625) < 0.03
    assert set(draws(logits, S(top_p=0.81), 3000, seed=6)) == {0, 1, 2}
    assert set(draws(logits, S(top_p=0.1), 300, seed=7)) == {0}  # the top token is always kept
    # Row-wise: the same nucleus when the vocab is permuted.
    perm = torch.tensor([3, 1, 0, 2])
    assert set(draws(logits[perm], S(top_p=0.8), 3000, seed=8)) == {1, 2}


def test_min_p_never_samples_below_threshold():
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    # min_p 0.3 -> threshold 0.12: ids 3, 4, 5 go.
    got = draws(torch.log(probs), S(min_p=0.3), 4000, seed=9)
    assert set(got) == {0, 1, 2}


def test_filters_combine_per_row_in_one_batch():
    logits = torch.randn(64, generator=torch.Generator().manual_seed(10))
    order = torch.argsort(logits, descending=True).tolist()
    opts = [S(top_k=1), S(top_k=3), S(temperature=0), S(min_p=1.0), S()] * 200
    out = Sampler().sample(logits.expand(len(opts), -1).contiguous(), opts, [0] * len(opts))
    for i, tok in enumerate(out.token_ids):
        kind = i % 5
        if kind in (0, 2, 3):
            assert tok == order[0]
        elif kind == 1:
            assert tok in order[:3]
    unfiltered = {tok for i, tok in enumerate(out.token_ids) if i % 5 == 4}
    assert len(unfiltered) > 10  # the unfiltered row is not accidentally masked by its neighbours


@pytest.mark.parametrize("seeded", [True, False])
def test_temperature_1_matches_softmax(seeded: bool):
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 0.3])
    n = 20_000
    if seeded:
        got = draws(logits, S(), n, seed=11)
    else:
        torch.manual_seed(12)  # unseeded rows use the global RNG; fixing it keeps the test deterministic
        got = Sampler().sample(logits.expand(n, -1).contiguous(), [S()] * n, [0] * n).token_ids
    expected = torch.softmax(logits, dim=-1).tolist()
    counts = [got.count(i) for i in range(len(expected))]
    chi2 = sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, expected))
    assert chi2 < 24.3  # 7 degrees of freedom: p = 0.001


def test_temperature_scales_the_distribution():
    logits = torch.tensor([1.0, 0.0])
    n = 20_000
    got = draws(logits, S(temperature=0.5), n, seed=13)
    p0 = 1 / (1 + math.exp(-2.0))  # softmax(logits / 0.5)[0]
    assert abs(got.count(0) / n - p0) < 4 * math.sqrt(p0 * (1 - p0) / n)


def step_logits(step: int, v: int) -> torch.Tensor:
    return torch.randn(v, generator=torch.Generator().manual_seed(1000 + step)) * 2


def test_seeded_request_is_reproducible_across_batches_and_positions():
    v, steps = 500, 20
    target = S(temperature=0.9, top_p=0.95, top_k=100, seed=1234)
    sampler = Sampler()
    start = 37  # the prompt's length: the position of the first sampled token

    alone = [sampler.sample(step_logits(s, v)[None], [target], [start + s]).token_ids[0] for s in range(steps)]

    rng = random.Random(0)
    torch.manual_seed(99)
    batched = []
    for s in range(steps):
        rows = [step_logits(s, v)] + [torch.randn(v) * 3 for _ in range(5)]
        opts = [target] + [
            S(temperature=rng.choice([0.0, 0.7, 1.3]), top_k=rng.choice([0, 5]), min_p=rng.choice([0.0, 0.1]),
              seed=7 + i if i % 2 else None)
            for i in range(5)
        ]
        positions = [start + s] + [rng.randrange(1000) for _ in range(5)]
        perm = list(range(6))
        rng.shuffle(perm)  # the target lands in a different row each step
        out = sampler.sample(torch.stack([rows[p] for p in perm]), [opts[p] for p in perm],
                             [positions[p] for p in perm])
        batched.append(out.token_ids[perm.index(0)])

    assert batched == alone
    assert len(set(alone)) > 5  # a real random sequence, not a degenerate constant
    other = dataclasses.replace(target, seed=4321)
    other_seed = [sampler.sample(step_logits(s, v)[None], [other], [start + s]).token_ids[0] for s in range(steps)]
    assert other_seed != alone
    # The position, not the call count, drives the draw: the same logits at shifted positions draw differently.
    shifted = [sampler.sample(step_logits(s, v)[None], [target], [start + 1 + s]).token_ids[0] for s in range(steps)]
    assert shifted != alone


def test_seed_is_taken_modulo_2_64():
    logits = torch.zeros(4, 1000)
    for seed in (0, 5, 2**64 - 1):
        for alias in (seed - 2**64, seed + 2**64, seed + 3 * 2**64):
            a = Sampler().sample(logits, [S(seed=seed)] * 4, [0, 1, 2, 3]).token_ids
            b = Sampler().sample(logits, [S(seed=alias)] * 4, [0, 1, 2, 3]).token_ids
            assert a == b


def test_logprobs_come_from_raw_logits():
    torch.manual_seed(14)
    logits = torch.randn(4, 300) * 3
    opts = [
        S(temperature=0, logprobs=5),
        S(temperature=2.0, top_k=20, logprobs=0),
        S(),
        S(temperature=0.5, logprobs=20),
    ]
    opts[1] = dataclasses.replace(opts[1], seed=1)
    out = Sampler().sample(logits, opts, [10, 11, 12, 13])
    lsm = torch.log_softmax(logits, dim=-1)
    assert out.logprobs[2] is None
    for i in (0, 1, 3):
        entry = out.logprobs[i]
        assert isinstance(entry, PositionLogprobs)
        assert entry.sampled.token_id == out.token_ids[i]
        # Raw-logit logprobs, whatever the temperature and filters.
        assert abs(entry.sampled.logprob - lsm[i, entry.sampled.token_id].item()) < 1e-6
        n = opts[i].logprobs
        assert len(entry.top) == n
        if n:
            vals, ids = torch.topk(lsm[i], n)
            assert [t.token_id for t in entry.top] == ids.tolist()
            assert all(abs(t.logprob - b) < 1e-6 for t, b in zip(entry.top, vals.tolist()))
            assert [t.logprob for t in entry.top] == sorted((t.logprob for t in entry.top), reverse=True)
    assert out.logprobs[0].top[0].token_id == out.token_ids[0]  # greedy: the sampled token heads the list


def test_default_options_are_valid():
    S().validate()
    S(temperature=0, top_p=0.01, top_k=1, min_p=1.0, seed=2**64 - 1, logprobs=20).validate()
    S(logprobs=0).validate()
    S(prompt_logprobs=0).validate()
    S(prompt_logprobs=20).validate()
    S(allowed_token_ids=(0, 5, 49151)).validate()


@pytest.mark.parametrize(
    "field, value",
    [
        ("max_tokens", 0),
        ("n", 0),
        ("temperature", -1.0),
        ("top_p", float("nan")),
        ("min_p", 2.0),
        ("seed", 2**64),
        ("seed", -1),
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("top_p", 0.0),
        ("top_p", 1.01),
        ("top_k", -1),
        ("min_p", -0.01),
        ("min_p", 1.5),
        ("logprobs", -1),
        ("logprobs", 21),
        ("prompt_logprobs", -1),  # NOTE: vLLM's -1 (the whole vocabulary) is out of the bound too
        ("prompt_logprobs", 21),
        ("allowed_token_ids", (-1, 3)),
        ("allowed_token_ids", (5, 3)),  # NOTE: the client APIs sort and dedupe a list (pagedserve_common.sampling)
        ("allowed_token_ids", (3, 3)),
    ],
)
def test_validate_names_the_bad_field(field: str, value):
    with pytest.raises(ValueError, match=field):
        S(**{field: value}).validate()


def test_batch_size_mismatch_is_rejected():
    with pytest.raises(ValueError, match="positions"):
        Sampler().sample(torch.zeros(2, 4), [S(), S()], [0])


def test_nucleus_wider_than_the_candidates_takes_the_full_sort_path():
    # 1,000 equally likely tokens: top_p 0.5 keeps 500 of them (the first 500 by vocab order: a stable sort),
    # more than the CANDIDATES the fast path looks at.
    from worker_svc.sampling import CANDIDATES

    got = draws(torch.zeros(1000), S(top_p=0.5), 6000, seed=21)
    assert set(got) <= set(range(500))
    assert len(set(got)) > CANDIDATES


def test_top_k_and_top_p_together_renormalise_within_top_k_first():
    # top_k 3 keeps 0.4, 0.3, 0.2 (renormalised: 0.444, 0.333, 0.222); top_p 0.7 then keeps the first two.
    logits = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.06, 0.04]))
    got = draws(logits, S(top_k=3, top_p=0.7), 4000, seed=22)
    assert set(got) == {0, 1}
    assert abs(got.count(0) / len(got) - 0.4 / 0.7) < 0.03


def test_greedy_bfloat16_logits_take_the_float32_argmax_ties_to_the_lowest_id():
    # A bfloat16 model's logits skip the [B, V] float32 copy on the all-greedy path: same ids, ties included.
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 1000, generator=gen).to(torch.bfloat16)
    logits[2, 10] = logits[2, 700] = 50.0  # a tie: the lowest id wins
    greedy = [SamplingParams(temperature=0.0)] * 6
    got = Sampler().sample(logits, greedy, [0] * 6)
    assert got.token_ids == logits.float().argmax(dim=-1).tolist() and got.token_ids[2] == 10
    assert got.logprobs == [None] * 6
    # a row asking for logprobs takes the float32 path, with the same token
    with_lp = Sampler().sample(logits, [SamplingParams(temperature=0.0, logprobs=1)] * 6, [0] * 6)
    assert with_lp.token_ids == got.token_ids and all(lp is not None for lp in with_lp.logprobs)
