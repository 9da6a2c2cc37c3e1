"""Counter-based uniforms: one float64 in [0, 1) per (seed, position), computed for a whole batch at once."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

GOLDEN_GAMMA = 0x9E3779B97F4A7C15  # SplitMix64's Weyl increment (odd: k -> k * gamma is a bijection mod 2**64)
MIX_1 = 0xBF58476D1CE4E5B9
MIX_2 = 0x94D049BB133111EB
STREAM_SALT = 0x5851F42D4C957F2D  # keeps seed 0's stream start away from mix(0) = 0
U64 = 1 << 64


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser on uint64 words: a bijection with full avalanche (numpy uint64 wraps, >> is logical)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(MIX_1)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(MIX_2)
    return z ^ (z >> np.uint64(31))


def seeded_uniforms(seeds: Sequence[int], positions: Sequence[int]) -> np.ndarray:
    """Row i's uniform is output number positions[i] of a SplitMix64 stream whose start is a hash of seeds[i].

    NOTE: a pure function of (seed, position), so a seeded sequence draws the same token whatever else is
    batched, its row or the batch size, and after a preemption or a migration it redraws exactly what it drew.
    For a fixed seed, distinct positions map to distinct 64-bit words (and vice versa), as every stage is a
    bijection. Any Python int is a valid seed: it is taken modulo 2**64.
    """
    n = len(seeds)
    if len(positions) != n:
        raise ValueError(f"{n} seeds but {len(positions)} positions")
    s = np.fromiter((seed % U64 for seed in seeds), np.uint64, n)
    k = np.fromiter(positions, np.uint64, n) + np.uint64(1)
    z = _mix(_mix(s ^ np.uint64(STREAM_SALT)) + k * np.uint64(GOLDEN_GAMMA))
    # The top 53 bits scaled by 2**-53: every float64 multiple of 2**-53 in [0, 1), equally likely.
    return (z >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))
