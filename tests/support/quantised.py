"""Two runs of an 8-bit KV cache compared: the same tokens, up to a divergence at a tie within the cache's noise.

NOTE: why not bit-exact. Recomputing a sequence (recompute preemption, migration) or batching it differently (after
a swap, beside a fork) computes its K/V through GEMMs of other shapes, whose float32 results differ in the last
bits (measured on SmolLM2: 76% of a float32 cache's elements differ, by <= 2.6e-5, between a decoded and a
prefilled copy of one sequence). A float cache keeps that difference invisible; an 8-bit code sitting on a rounding
boundary flips by one step (1% of the int8 codes), and the next layers carry it on: the sampled tokens' logprobs
differ by up to 0.021 nats between such runs (torch backend). So the check is exact where it can be: the same
tokens, with the same distribution at every position (each token's probability within PROB_NOISE, where stale
scales move it by far more), and a divergence only where the draw sits on a tie: greedy, the two best within
NOISE; seeded, the uniform between two nearly equal cumulative sums (observable only as both runs agreeing there).
"""

from __future__ import annotations

import math

# NOTE: measured over tests/worker/test_kv_quant_tokens.py and tests/service/test_kv_quant_failover.py: two runs
# of one stream differ by <= 0.018 in any token's probability on the torch backend, <= 0.060 on the CPU kernel's
# int8 paths (its Q.K in int8 quantises the queries too); a copy-on-write or swap-in that drops the scales moves
# one by 0.57 to 0.62. The bounds sit about 3x from both.
NOISE = 0.25  # nats, between the two best logprobs: a greedy tie
PROB_NOISE = 0.2  # the most one token's probability may differ between two runs of one stream


def assert_close(position: int, got, want) -> None:
    """Two runs' distributions at one position agree within PROB_NOISE: the most likely token's probability
    (continuous even where two tokens swap places) and every token's both top lists hold."""
    def diff(a: float, b: float) -> float:
        return abs(math.exp(a) - math.exp(b))

    assert diff(got.top[0].logprob, want.top[0].logprob) < PROB_NOISE, \
        f"position {position}: the distributions differ (top {got.top[0]} vs {want.top[0]})"
    got_top = {t.token_id: t.logprob for t in got.top}
    for t in want.top:
        if t.token_id in got_top:
            assert diff(got_top[t.token_id], t.logprob) < PROB_NOISE, \
                f"position {position}: the distributions differ: token {t.token_id}: logprob " \
                f"{got_top[t.token_id]} vs {t.logprob}"


def assert_same_up_to_noise(got: list[int], got_logprobs, want: list[int], want_logprobs, greedy: bool) -> bool:
    """`got` equals `want` (token ids, each with its PositionLogprobs, in step or wire form: .sampled and .top, at
    least 2), with the same distribution at each position, except that a divergence at a tie ends the check;
    returns whether the two were identical throughout."""
    assert len(got_logprobs) == len(got) and len(want_logprobs) == len(want), "every token needs its logprobs"
    for i, (g, w) in enumerate(zip(got, want)):
        gl, wl = got_logprobs[i], want_logprobs[i]
        assert_close(i, gl, wl)
        if g != w:
            if greedy:
                gap = wl.top[0].logprob - wl.top[1].logprob
                assert gap < NOISE, f"diverged at {i} off a tie (gap {gap:.3f}): {got} != {want}"
            return False
    assert len(got) == len(want), (got, want)
    return True
