"""The worker protocol's hot path: one step's plan encoded, sent and decoded, at a batch of B decoding sequences.

Per step, as the service does it: the scheduler's plan -> protobuf -> bytes (scheduler), bytes -> protobuf -> the
worker's plan (worker); and the answer: the worker's result -> bytes -> the scheduler's result. Two shapes: a
steady decode step (B running deltas) and an admission step (B new sequences of --prompt-len tokens). Also timed,
for the design choice: the same plan built directly as protobuf messages, with no in-memory dataclass (what using
the generated messages as the in-memory type would cost). Prints one line per figure, medians of --repeat runs.
usage: python bench/plan_codec.py [--batch 256] [--prompt-len 512] [--steps 200] [--repeat 5]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedserve.v1 import worker_pb2  # noqa: E402
from pagedserve_common import wire  # noqa: E402
from pagedserve_common.step import NewSequence, SequenceDelta, StepPlan, StepResult  # noqa: E402
from pagedserve_common.sampling import SamplingParams  # noqa: E402

SAMPLING = SamplingParams(max_tokens=128, temperature=0.8, seed=7)


def decode_plan(step: int, batch: int) -> StepPlan:
    # NOTE: every 16th step each sequence crosses into a new block: the delta then carries one block id
    new_block = step % 16 == 0
    return StepPlan(step, running=[SequenceDelta(i, [batch * 8 + i] if new_block else [], 1) for i in range(batch)])


def admit_plan(step: int, batch: int, prompt_len: int) -> StepPlan:
    blocks = -(-prompt_len // 16)
    return StepPlan(step, new_seqs=[NewSequence(i, list(range(i, i + prompt_len)), list(range(i * blocks,
                                                                                             (i + 1) * blocks)),
                                                0, prompt_len, SAMPLING, 1000 + i) for i in range(batch)])


def time_round_trip(plans: list[StepPlan], batch: int) -> float:
    """Mean ms per step: plan -> bytes -> plan, and a result of `batch` tokens -> bytes -> result."""
    result = StepResult(0, {i: 100 + i for i in range(batch)})
    t0 = time.perf_counter()
    for plan in plans:
        data = wire.plan_to_pb(plan).SerializeToString()
        wire.plan_from_pb(worker_pb2.StepPlan.FromString(data))
        result.step_id = plan.step_id
        wire.result_from_pb(worker_pb2.StepResult.FromString(wire.result_to_pb(result).SerializeToString()))
    return 1e3 * (time.perf_counter() - t0) / len(plans)


def time_direct_messages(plans: list[StepPlan], batch: int) -> float:
    """The alternative: the scheduler fills protobuf messages as it plans (no dataclass) and the worker reads the
    message's fields where it needs them (its batch still copies ids into lists). Same bytes on the wire."""
    sampling_pb = wire.sampling_to_pb(SAMPLING)
    t0 = time.perf_counter()
    for plan in plans:
        pb = worker_pb2.StepPlan(step_id=plan.step_id)
        add_new, add_delta = pb.new_seqs.add, pb.running.add
        for s in plan.new_seqs:  # NOTE: the scheduler would call add() where it now builds a NewSequence
            add_new(seq_id=s.seq_id, token_ids=s.token_ids, block_ids=s.block_ids,
                    num_computed_tokens=s.num_computed_tokens, num_scheduled_tokens=s.num_scheduled_tokens,
                    sampling=sampling_pb, seed=s.seed)
        for r in plan.running:
            add_delta(seq_id=r.seq_id, new_block_ids=r.new_block_ids, num_scheduled_tokens=r.num_scheduled_tokens)
        got = worker_pb2.StepPlan.FromString(pb.SerializeToString())
        for n in got.new_seqs:
            list(n.token_ids), list(n.block_ids), n.num_computed_tokens, n.num_scheduled_tokens
        for r in got.running:
            r.seq_id, list(r.new_block_ids), r.num_scheduled_tokens
        res = worker_pb2.StepResult(step_id=plan.step_id)
        for i in range(batch):
            res.tokens.add(seq_id=i, token_id=100 + i)
        {t.seq_id: t.token_id for t in worker_pb2.StepResult.FromString(res.SerializeToString()).tokens}
    return 1e3 * (time.perf_counter() - t0) / len(plans)


def time_build(make, steps: int) -> tuple[list[StepPlan], float]:
    t0 = time.perf_counter()
    plans = [make(s) for s in range(steps)]
    return plans, 1e3 * (time.perf_counter() - t0) / steps


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--batch", type=int, default=256)
    p.add_argument("--prompt-len", type=int, default=512)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--repeat", type=int, default=5)
    args = p.parse_args()
    b = args.batch
    shapes = {"decode": lambda s: decode_plan(s, b), "admit": lambda s: admit_plan(s, b, args.prompt_len)}
    for name, make in shapes.items():
        steps = args.steps if name == "decode" else max(1, args.steps // 20)
        build, codec, direct = [], [], []
        for _ in range(args.repeat):
            plans, ms = time_build(make, steps)
            build.append(ms)
            codec.append(time_round_trip(plans, b))
            direct.append(time_direct_messages(plans, b))
        print(f"plan_codec shape={name} batch={b} build_ms={statistics.median(build):.3f} "
              f"encode_decode_ms={statistics.median(codec):.3f} "
              f"dataclass_total_ms={statistics.median(build) + statistics.median(codec):.3f} "
              f"direct_messages_ms={statistics.median(direct):.3f}")


if __name__ == "__main__":
    main()
