"""The warm-up at start: a few small steps through the real paths (prefill, a prefix hit, decode, the sampler, the
attention kernel), so that the first request pays neither for first calls (kernel builds, allocator growth) nor for
a thread count the CPU's load does not allow (worker_svc.threads)."""

from __future__ import annotations

import time
from collections.abc import Callable

from pagedserve_common.kv_geometry import KVGroups
from pagedserve_common.sampling import SamplingParams
from pagedserve_common.step import NewSequence, SequenceDelta, StepPlan

NUM_DECODE_STEPS = 2
# NOTE: both sampler paths (greedy's argmax; temperature with top-k/top-p/min-p and logprobs) and both attention
# cases (a prompt from scratch over more than one block; one whose first block is a prefix-cache hit, batched with
# a decode)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
RANDOM = SamplingParams(temperature=0.8, top_p=0.9, top_k=40, min_p=0.01, logprobs=2, max_tokens=8)


def warm_up_plans(block_size: int, num_blocks: int, vocab_size: int, groups: KVGroups | None = None) -> list[StepPlan]:
    """The warm-up's plans: sequence A (a prompt of one block and a half) prefills, then decodes beside sequence B,
    which shares A's first block as a cached prefix; the last plan drops both. Empty when the pool is too small
    (fewer than 3 logical blocks). `groups`: the pool's KV groups (None: one), a block per group per logical block."""
    table = (groups or KVGroups.of((0,))).table
    if num_blocks < len(table(range(3))):
        return []
    prompt = [(7 * i + 3) % vocab_size for i in range(block_size + block_size // 2)]
    other = prompt[:block_size] + [(11 * i + 5) % vocab_size for i in range(block_size // 2 + 1)]
    a = NewSequence(seq_id=0, token_ids=prompt, block_ids=table([0, 1]), num_computed_tokens=0,
                    num_scheduled_tokens=len(prompt), sampling=GREEDY, seed=1)
    b = NewSequence(seq_id=1, token_ids=other, block_ids=table([0, 2]), num_computed_tokens=block_size,
                    num_scheduled_tokens=len(other) - block_size, sampling=RANDOM, seed=2)
    plans = [StepPlan(step_id=0, new_seqs=[a])]
    plans.append(StepPlan(step_id=1, new_seqs=[b], running=[SequenceDelta(0, [], 1)]))
    for step in range(2, 2 + NUM_DECODE_STEPS):
        plans.append(StepPlan(step_id=step, running=[SequenceDelta(0, [], 1), SequenceDelta(1, [], 1)]))
    plans.append(StepPlan(step_id=len(plans), finished_seq_ids=[0, 1]))
    return plans


def warm_up(runner, after_step: Callable[[], None] | None = None) -> tuple[int, float]:
    """Runs the warm-up on `runner` (a ModelRunner), calling `after_step` after each step (the thread governor's
    tick), then forgets its sequences (runner.reset(): the pool's contents are never read before the scheduler's own
    plans write them). (steps run, seconds taken).

    NOTE: the governor's tick matters as much as the steps: on a CPU that other processes keep busy, a forward on
    every core ran 50x slower than on one (4.7 s against 0.09 s here, on 2 cores); the first request paid that for
    its first step until the governor, ticking only between plans, gave a thread up. Ticking here, it settles
    before the worker registers."""
    geometry = runner.pool.geometry
    plans = warm_up_plans(geometry.block_size, runner.pool.num_blocks, runner.loaded.vocab_size, runner.pool.groups)
    t0 = time.perf_counter()
    try:
        for plan in plans:
            runner.step(plan)  # NOTE: its sampled tokens come back to the host: the device is done with the step
            if after_step is not None:
                after_step()
    finally:
        runner.reset()
    return len(plans), time.perf_counter() - t0
