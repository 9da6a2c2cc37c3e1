"""Counter-based uniforms: a pure function of (seed, position), in [0, 1), 53 bits, uniform and uncorrelated."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest

from worker_svc.uniforms import GOLDEN_GAMMA, MIX_1, MIX_2, STREAM_SALT, seeded_uniforms

MASK = (1 << 64) - 1


def reference(seed: int, position: int) -> float:
    """The same formula on Python ints, masked by hand: pins numpy's wrapping and logical shifts."""
    def mix(z: int) -> int:
        z = ((z ^ (z >> 30)) * MIX_1) & MASK
        z = ((z ^ (z >> 27)) * MIX_2) & MASK
        return z ^ (z >> 31)

    z = mix((mix((seed % (1 << 64)) ^ STREAM_SALT) + (position + 1) * GOLDEN_GAMMA) & MASK)
    return (z >> 11) / 2**53


EDGE_SEEDS = [0, 1, 2, 2**31, 2**63 - 1, 2**63, 2**64 - 1, -1, -(2**70), 3 * 2**64 + 5]
EDGE_POSITIONS = [0, 1, 2, 255, 256, 10**6, 2**40, 2**63]


def grid(num_seeds: int, num_positions: int) -> tuple[list[int], list[int]]:
    rng = random.Random(2024)
    seeds = [rng.getrandbits(64) for _ in range(num_seeds)]
    return [s for s in seeds for _ in range(num_positions)], list(range(num_positions)) * num_seeds


def test_matches_the_reference_at_the_edges():
    seeds = [s for s in EDGE_SEEDS for _ in EDGE_POSITIONS]
    positions = EDGE_POSITIONS * len(EDGE_SEEDS)
    got = seeded_uniforms(seeds, positions)
    assert got.dtype == np.float64 and got.shape == (len(seeds),)
    assert got.tolist() == [reference(s, p) for s, p in zip(seeds, positions)]


def test_a_row_depends_only_on_its_seed_and_position():
    seeds, positions = grid(8, 64)
    batched = seeded_uniforms(seeds, positions)
    assert seeded_uniforms(seeds, positions).tolist() == batched.tolist()  # same inputs, same values
    alone = [seeded_uniforms([s], [p])[0] for s, p in zip(seeds, positions)]
    assert batched.tolist() == alone  # whatever the batch size
    order = list(range(len(seeds)))
    random.Random(3).shuffle(order)
    shuffled = seeded_uniforms([seeds[i] for i in order], [positions[i] for i in order])
    assert shuffled.tolist() == [batched[i] for i in order]  # whatever the row
    assert seeded_uniforms([], []).shape == (0,)


def test_different_positions_or_seeds_give_different_values():
    n = 20_000
    for seed in (0, 1, 2**64 - 1):  # one stream: every position its own value
        assert len(set(seeded_uniforms([seed] * n, range(n)).tolist())) == n
    for position in (0, 1, 500):  # one position: every seed its own value, siblings (seed + index) included
        assert len(set(seeded_uniforms(range(n), [position] * n).tolist())) == n


def test_values_lie_in_0_1_with_53_bits():
    seeds, positions = grid(64, 1024)
    u = seeded_uniforms(seeds, positions)
    assert u.min() >= 0.0 and u.max() < 1.0
    ints = u * 2**53
    assert np.array_equal(ints, np.floor(ints))  # multiples of 2**-53: nothing rounded away
    low_bit = (ints.astype(np.uint64) & np.uint64(1)).mean()
    assert abs(low_bit - 0.5) < 0.01  # the lowest of the 53 bits is random too (a float32 path would zero it)


def test_values_are_uniform_and_uncorrelated():
    num_seeds, num_positions = 64, 1024
    seeds, positions = grid(num_seeds, num_positions)
    u = seeded_uniforms(seeds, positions)
    n = u.size
    # Chi-square over 256 equal bins, 255 degrees of freedom: mean 255, sd 22.6; 370 is p ~ 1e-6.
    counts = np.bincount((u * 256).astype(np.int64), minlength=256)
    expected = n / 256
    assert ((counts - expected) ** 2 / expected).sum() < 370
    # Kolmogorov-Smirnov: sup |F_n - F| < 1.95 / sqrt(n) is p = 0.001.
    s = np.sort(u)
    i = np.arange(1, n + 1)
    assert max((i / n - s).max(), (s - (i - 1) / n).max()) < 1.95 / math.sqrt(n)
    # Consecutive positions of one stream, and sibling seeds (seed, seed + 1) at one position, are uncorrelated:
    # |r| < 5 / sqrt(m) for m pairs.
    by_stream = u.reshape(num_seeds, num_positions)
    lag1 = np.corrcoef(by_stream[:, :-1].ravel(), by_stream[:, 1:].ravel())[0, 1]
    assert abs(lag1) < 5 / math.sqrt(num_seeds * (num_positions - 1))
    m = 20_000
    base = seeded_uniforms(range(0, 2 * m, 2), [7] * m)
    sibling = seeded_uniforms(range(1, 2 * m, 2), [7] * m)
    assert abs(np.corrcoef(base, sibling)[0, 1]) < 5 / math.sqrt(m)


def test_mismatched_lengths_are_rejected():
    with pytest.raises(ValueError, match="positions"):
        seeded_uniforms([1, 2], [0])
