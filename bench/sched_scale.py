"""One Scheduler at scale with a fake worker: scheduling time per step vs batch size, prefix-cache size, block size.

Per point: a Scheduler over --num-blocks blocks (optionally with that many cached free blocks put in the prefix
cache first), --requests requests queued at once (a few shared 512-token system prompts + a random suffix, random
decode lengths), then --warmup steps and --steps timed steps. A fake worker hands each sequence that finished its
prompt or decoded a token derived from (seq_id, position). Timed per step, as the service does it on its loop
(scheduler_svc/step_loop.py, StepLoop.run): schedule(); plan_to_pb() + SerializeToString(); StepResult parse +
result_from_pb() + update(), in this thread's CPU time by default (--clock); full GC pauses are counted apart,
except in median_step_ms/max_step_ms (the largest batch, every step whole), under the scheduler process's GC
policy (scheduler_svc/gc_policy.py).
Not timed: the worker, gRPC transport, asyncio, StepLoop._publish (streams, detokenization), metrics. At the end
every request's tokens are checked, all are aborted and every block must be back in the pool.
usage: python bench/sched_scale.py [--quick] [--out DIR] [--profile]   (table, JSON and PNG under --out)
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import statistics
import sys
import time
from array import array
from dataclasses import dataclass, replace
from pathlib import Path

from pagedserve.v1 import worker_pb2

from pagedserve_common.sampling import SamplingParams
from pagedserve_common.wire import plan_to_pb, result_from_pb
from scheduler_svc import gc_policy
from scheduler_svc.core.request import Request, token_ids
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.scheduler import Scheduler

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its sibling, when run as a script
from sched_scale_report import report  # noqa: E402

CLOCKS = {"cpu": time.thread_time, "wall": time.perf_counter}
VOCAB = 32000


@dataclass(slots=True)
class Workload:
    prompts: list[array]  # array('i'), as a Request holds token ids: each Request keeps its prompt, no copy
    max_tokens: list[int]


@dataclass(slots=True)
class Point:
    axis: str  # "batch", "prefix_cache" or "block_size"
    batch_size: int
    num_cached_blocks: int  # cached free blocks put in the pool before the run
    block_size: int
    num_steps: int
    full_frac: float  # share of timed steps whose batch was the full batch_size
    mean_ms: float  # all timed steps, less time in full (gen-2) GC collections, which are reported apart
    median_ms: float
    p99_ms: float
    decode_median_ms: float  # steps that admitted nobody
    admit_median_ms: float  # steps that admitted new sequences (nan when none)
    admit_frac: float
    sched_ms: float  # mean of each part
    pb_ms: float
    update_ms: float
    num_plan_bytes: float  # mean serialized plan size
    num_evictions: int
    setup_s: float
    mean_incl_gc_ms: float  # mean_ms plus full collections amortised: what the loop pays per step on average
    num_full_gcs: int  # full collections inside timed steps
    full_gc_ms: float  # their mean pause
    young_gc_ms: float  # gen-0/1 collections per step (mean), already inside mean_ms
    # NOTE: every step whole, full collections included (also one the fake worker's allocations set off: the
    # pause is the scheduler process's, the heap it walks the scheduler's)
    median_step_ms: float
    max_step_ms: float


def make_workload(num_requests: int, seed: int, num_prefixes: int = 8, prefix_len: int = 512,
                  suffix: tuple[int, int] = (32, 256), decode: tuple[int, int] = (32, 256)) -> Workload:
    rng = random.Random(seed)
    vocab = range(VOCAB)
    prefixes = [rng.choices(vocab, k=prefix_len) for _ in range(num_prefixes)]
    prompts = [token_ids(rng.choice(prefixes) + rng.choices(vocab, k=rng.randint(*suffix)))
               for _ in range(num_requests)]
    return Workload(prompts, [rng.randint(*decode) for _ in range(num_requests)])


def token(seq_id: int, pos: int) -> int:
    """What the fake worker samples for a sequence's pos-th output."""
    return (seq_id * 131 + pos * 7919 + 1) % VOCAB


def fill_cache(s: Scheduler, num_blocks: int) -> None:
    """Puts `num_blocks` cached free blocks in the pool (distinct chains of 64 blocks), as a long-running server
    would hold. NOTE: the first token of each chain differs, so no workload prompt ever hits them."""
    kv, bs = s.kv, s.kv.block_size
    for j in range(-(-num_blocks // 64)):
        n = min(64, num_blocks - 64 * j)
        tokens = [VOCAB + j] + [0] * (n * bs - 1)
        kv.allocate(("fill", j), n * bs, tokens)
        kv.free(("fill", j))
    assert s.kv.pool.num_cached_free_blocks == num_blocks


class GCClock:
    """Seconds spent in garbage collection so far, by kind (full: generation 2; young: 0 and 1)."""

    def __init__(self, now) -> None:
        self.now = now
        self.full = self.young = self._t0 = 0.0
        self.num_full = 0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._t0 = self.now()
        elif info["generation"] == 2:
            self.full += self.now() - self._t0
            self.num_full += 1
        else:
            self.young += self.now() - self._t0


def run_point(wl: Workload, axis: str, batch_size: int, num_cached: int, block_size: int, a) -> Point:
    t_setup = time.perf_counter()
    gc.disable()  # NOTE: setup is not timed; a collection afterwards leaves the heap as a filled server's
    max_len = max(map(len, wl.prompts)) + max(wl.max_tokens) + block_size
    s = Scheduler(SchedulerConfig(num_blocks=a.num_blocks, max_model_len=max_len, max_num_seqs=batch_size,
                                  max_num_batched_tokens=a.max_batched_tokens, block_size=block_size))
    fill_cache(s, num_cached)
    reqs = [Request(str(i), p, SamplingParams(max_tokens=m, ignore_eos=True))
            for i, (p, m) in enumerate(zip(wl.prompts, wl.max_tokens))]
    for r in reqs:
        s.add_request(r)  # NOTE: seq ids follow submission order: seq_id == index in reqs
    gc.enable()
    gc.collect()
    setup_s = time.perf_counter() - t_setup
    rows = drive(s, reqs, a.warmup + a.steps, CLOCKS[a.clock])[a.warmup:]
    num_evictions = s.kv.pool.num_evictions
    check_and_drain(s, reqs, a.num_blocks)
    return summarize(rows, axis, batch_size, num_cached, block_size, num_evictions, setup_s)


def drive(s: Scheduler, reqs: list[Request], num_steps: int, now=time.perf_counter) -> list[tuple]:
    """Runs up to `num_steps` steps (fewer when all is done). Per step: schedule, plan_to_pb + serialise,
    result parse + update (each less full collections), full GC, young GC, num_seqs, num_new, plan bytes, full GC
    while the fake worker ran."""
    clock = GCClock(now)
    gc.callbacks.append(clock)
    rows = []
    try:
        for _ in range(num_steps):
            g0, y0, t0 = clock.full, clock.young, now()
            step = s.schedule()
            if step is None:
                break
            g1, t1 = clock.full, now()
            plan = step.plan
            data = plan_to_pb(plan).SerializeToString()
            g2, y2, t2 = clock.full, clock.young, now()
            result = fake_worker(plan, reqs).SerializeToString()  # the worker's side: not timed
            g3, y3, t3 = clock.full, clock.young, now()
            s.update(step, result_from_pb(worker_pb2.StepResult.FromString(result)).sampled)
            g4, y4, t4 = clock.full, clock.young, now()
            rows.append((t1 - t0 - (g1 - g0), t2 - t1 - (g2 - g1), t4 - t3 - (g4 - g3), g2 - g0 + g4 - g3,
                         y2 - y0 + y4 - y3, plan.num_seqs, len(plan.new_seqs), len(data), g3 - g2))
    finally:
        gc.callbacks.remove(clock)
    return rows


def fake_worker(plan, reqs: list[Request]) -> worker_pb2.StepResult:
    """One token for each sequence whose known tokens are all computed after this step."""
    res = worker_pb2.StepResult(step_id=plan.step_id)
    add = res.tokens.add
    for p in plan.new_seqs:
        if p.num_computed_tokens + p.num_scheduled_tokens == len(p.token_ids):
            add(seq_id=p.seq_id, token_id=token(p.seq_id, len(reqs[p.seq_id].output_token_ids)))
    for p in plan.running:
        r = reqs[p.seq_id]
        if r.num_computed_tokens + p.num_scheduled_tokens == len(r.all_token_ids):
            add(seq_id=p.seq_id, token_id=token(p.seq_id, len(r.output_token_ids)))
    return res


def check_and_drain(s: Scheduler, reqs: list[Request], num_blocks: int) -> None:
    """Every request's tokens are the fake worker's so far; the pool's ref counts match the live tables; after
    aborting everything every block is free again."""
    for r in reqs:
        out = r.output_token_ids
        assert list(out) == [token(r.seq_id, k) for k in range(len(out))], r.request_id
        assert r.all_token_ids == r.prompt_token_ids + out, r.request_id
        assert (r.is_finished and len(out) == r.sampling.max_tokens) or (not r.is_finished
                                                                          and len(out) < r.sampling.max_tokens)
    pool, tables = s.kv.pool, [s.kv.block_table(r.seq_id) for r in s.running]
    assert sum(pool.ref_cnt) == sum(map(len, tables))
    assert pool.num_used_blocks == len({b for t in tables for b in t})
    for r in list(s.waiting):  # NOTE: queue order: each abort finds its request at the deque's head
        s.abort(r.request_id)
    for r in list(s.running):
        s.abort(r.request_id)
    step = s.schedule()  # tells the worker to drop the aborted sequences
    if step is not None:
        s.update(step, {})
    assert not s.has_unfinished_requests() and s.schedule() is None
    assert pool.num_free_blocks == num_blocks and not any(pool.ref_cnt)


def summarize(rows, axis, batch_size, num_cached, block_size, num_evictions, setup_s) -> Point:
    ms = [1e3 * (a + b + c) for a, b, c, *_ in rows]  # NOTE: full collections are reported apart
    full = [1e3 * r[3] for r in rows if r[3] > 0]
    decode = [t for t, r in zip(ms, rows) if r[6] == 0]
    admit = [t for t, r in zip(ms, rows) if r[6] > 0]
    whole = [t + 1e3 * (r[3] + r[8]) for t, r in zip(ms, rows)]
    mean = lambda i: 1e3 * statistics.fmean(r[i] for r in rows)  # noqa: E731
    return Point(axis, batch_size, num_cached, block_size, len(rows),
                 sum(r[5] == batch_size for r in rows) / len(rows), statistics.fmean(ms), statistics.median(ms),
                 sorted(ms)[min(len(ms) - 1, int(0.99 * len(ms)))],
                 statistics.median(decode) if decode else math.nan, statistics.median(admit) if admit else math.nan,
                 len(admit) / len(rows), mean(0), mean(1), mean(2), statistics.fmean(r[7] for r in rows),
                 num_evictions, setup_s, statistics.fmean(ms) + sum(full) / len(rows), len(full),
                 statistics.fmean(full) if full else 0.0, mean(4), statistics.median(whole), max(whole))


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("--quick", action="store_true", help="test-sized: 2,000 requests, 50,000 blocks, few steps")
    p.add_argument("--requests", type=int, default=100_000)
    p.add_argument("--num-blocks", type=int, default=1_000_000)
    p.add_argument("--max-batched-tokens", type=int, default=8192)
    p.add_argument("--batch-sizes", default="1,4,16,64,256,512,1024")
    p.add_argument("--cached-blocks", default="100000,900000,1000000", help="pre-cached free blocks, at --fixed-b")
    p.add_argument("--block-sizes", default="32,64,128", help="at --fixed-b")
    p.add_argument("--fixed-b", type=int, default=256)
    p.add_argument("--warmup", type=int, default=300, help="steps before timing (the first wave to mix)")
    p.add_argument("--steps", type=int, default=300, help="timed steps per point")
    p.add_argument("--repeat", type=int, default=3, help="runs per point; the one with the lowest mean is kept")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clock", choices=tuple(CLOCKS), default="cpu",
                   help="cpu: this thread's CPU time (steady on a shared machine); wall: perf_counter")
    p.add_argument("--out", default=None, help="default bench/out/sched_scale-YYYYmmdd-HHMMSS")
    p.add_argument("--profile", action="store_true", help="cProfile the largest batch size only (top 25)")
    a = p.parse_args()
    if a.quick:
        a.requests, a.num_blocks, a.warmup, a.steps, a.repeat = 2000, 50_000, 20, 20, 1
        a.batch_sizes, a.cached_blocks, a.block_sizes, a.fixed_b = "1,16,256", "50000", "32", 16
    out = Path(a.out or Path(__file__).parent / "out" / time.strftime("sched_scale-%Y%m%d-%H%M%S"))
    gc_policy.settle()  # NOTE: the scheduler process's own policy, set once its start-up is done
    wl = make_workload(a.requests, a.seed)
    batch_sizes = [int(x) for x in a.batch_sizes.split(",")]
    if a.profile:
        import cProfile
        import pstats
        cProfile.runctx("run_point(wl, 'batch', max(batch_sizes), 0, 16, a)", globals(), locals(), "/tmp/ss.prof")
        pstats.Stats("/tmp/ss.prof").sort_stats("tottime").print_stats(25)
        return
    grid = [("batch", b, 0, 16) for b in batch_sizes]
    grid += [("prefix_cache", a.fixed_b, int(c), 16) for c in a.cached_blocks.split(",") if c]
    grid += [("block_size", a.fixed_b, 0, int(bs)) for bs in a.block_sizes.split(",") if bs]
    # NOTE: the best of --repeat runs per point, the grid swept whole each time: other processes on a small shared
    # machine only ever add time, and a busy spell then spoils one run of a few points, not all runs of one.
    runs = [[run_point(wl, *g, a) for g in grid] for _ in range(a.repeat)]
    # NOTE: the kept run is picked by mean_ms, which leaves full collections out; its longest step is the longest
    # of every run, so that no pause is left out by the pick.
    points = [replace(min(tries, key=lambda p: p.mean_ms), max_step_ms=max(p.max_step_ms for p in tries))
              for tries in zip(*runs)]
    print(f"sched_scale out={out}")
    for line in report(points, a, out, [[round(p.mean_ms, 4) for p in tries] for tries in zip(*runs)]):
        print(line)


if __name__ == "__main__":
    main()
