"""Drives the Scheduler over a trace, as bench/peers/vllm_sched.py drives vLLM's V1 Scheduler.

All requests are submitted at once (max_tokens = len(decode), ignore_eos); each step a fake worker hands every
sequence that reached the end of its known tokens its next trace decode token. Each step's plan is converted to
protobuf and serialised, as the gRPC service would. One warm-up run, then --runs timed runs; prints each run's
wall and steps and, last, `median_wall_s=X`.
usage: python bench/sched_trace.py TRACE.jsonl [--max-num-seqs 64] [--max-batched-tokens 8192]
       [--block-size 16] [--num-blocks 8192] [--runs 3] [--profile]
"""

import argparse
import json
import statistics
import time

from pagedserve_common.wire import plan_to_pb
from scheduler_svc.core.request import Request
from pagedserve_common.sampling import SamplingParams
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.scheduler import Scheduler


def read_trace(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run(trace: list[dict], cfg: SchedulerConfig) -> tuple[float, int, int]:
    s = Scheduler(cfg)
    t0 = time.perf_counter()
    # Timed from here, as the peer times from building its requests (which hashes their blocks).
    reqs = [Request(str(i), r["prompt"], SamplingParams(max_tokens=len(r["decode"]), ignore_eos=True))
            for i, r in enumerate(trace)]
    for r in reqs:
        s.add_request(r)
    decodes = [r["decode"] for r in trace]  # NOTE: seq ids are handed out in submission order: seq_id == i
    num_plan_bytes = 0
    while s.has_unfinished_requests():
        step = s.schedule()
        plan = step.plan
        num_plan_bytes += len(plan_to_pb(plan).SerializeToString())
        sampled = {}
        for p in plan.new_seqs:
            if p.num_computed_tokens + p.num_scheduled_tokens == len(p.token_ids):
                sampled[p.seq_id] = decodes[p.seq_id][len(p.token_ids) - len(trace[p.seq_id]["prompt"])]
        for p in plan.running:
            r = reqs[p.seq_id]
            if r.num_computed_tokens + p.num_scheduled_tokens == len(r.all_token_ids):
                sampled[p.seq_id] = decodes[p.seq_id][len(r.output_token_ids)]
        s.update(step, sampled)
    wall = time.perf_counter() - t0
    assert all(list(r.output_token_ids) == trace[i]["decode"] for i, r in enumerate(reqs))
    assert s.kv.pool.num_free_blocks == cfg.num_blocks
    return wall, s.steps, num_plan_bytes


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("trace")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-batched-tokens", type=int, default=8192)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=8192)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--profile", action="store_true", help="cProfile one run instead (top 25 by tottime)")
    a = p.parse_args()
    trace = read_trace(a.trace)
    max_len = max(len(r["prompt"]) + len(r["decode"]) for r in trace) + a.block_size  # as the peer does
    cfg = SchedulerConfig(num_blocks=a.num_blocks, max_model_len=max_len, max_num_seqs=a.max_num_seqs,
                          max_num_batched_tokens=a.max_batched_tokens, block_size=a.block_size)
    if a.profile:
        import cProfile
        import pstats
        cProfile.runctx("run(trace, cfg)", globals(), {"trace": trace, "cfg": cfg}, "/tmp/sched_trace.prof")
        pstats.Stats("/tmp/sched_trace.prof").sort_stats("tottime").print_stats(25)
        return
    run(trace, cfg)  # warm-up
    walls = []
    for _ in range(a.runs):
        wall, steps, num_bytes = run(trace, cfg)
        walls.append(wall)
    print(f"pagedserve Scheduler(max_num_seqs={a.max_num_seqs}) runs={['%.2f' % w for w in walls]} steps={steps} "
          f"plan_bytes={num_bytes}")
    print(f"median_wall_s={statistics.median(walls):.4f}")


if __name__ == "__main__":
    main()
