"""Where a worker step's time goes: decode at batch 1/16/64 and one 2,048-token prefill chunk, by category.

Each case builds real plans over the real ModelRunner (model loading and the KV fill are never timed), times
`--steps` steps without the profiler (wall ms/step), then profiles the same steps with torch.profiler and splits
the time into: matmuls (aten::linear/mm/addmm/bmm outside attention), attention (the backend's forward),
KV writes, other torch ops (norms, rotary, activations, embedding...), sampling, plan/metadata (persistent
batch + AttentionMetadata), and python/dispatch (the wall time no torch op accounts for).

usage: python bench/profile_step.py [--model smollm2-135m-instruct] [--threads N] [--ctx 256] [--steps 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile, record_function

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from worker_step import BLOCK_SIZE, GREEDY, prefill_template  # noqa: E402

from worker_svc.attention import TorchAttentionBackend  # noqa: E402
from worker_svc.kv_pool import KVPool  # noqa: E402
from worker_svc.model_store import DEFAULT_MODEL, resolve_model  # noqa: E402
from worker_svc.models import load_model  # noqa: E402
from worker_svc.plan import NewSeq, SeqDelta, StepPlan  # noqa: E402
from worker_svc.runner import ModelRunner  # noqa: E402

MATMUL_OPS = ("aten::mm", "aten::addmm", "aten::bmm", "aten::matmul", "aten::linear")
REGIONS = ("ps.attention", "ps.write_kv", "ps.sample", "ps.plan")


class Traced(TorchAttentionBackend):
    def write_kv(self, *a, **k):
        with record_function("ps.write_kv"):
            return super().write_kv(*a, **k)

    def forward(self, *a, **k):
        with record_function("ps.attention"):
            return super().forward(*a, **k)


def make_runner(loaded, num_blocks, traced: bool):
    runner = ModelRunner(loaded, KVPool(loaded.kv_layout(BLOCK_SIZE), num_blocks),
                         Traced() if traced else TorchAttentionBackend())
    sample, apply = runner.sampler.sample, runner.batch.apply

    def traced_sample(*a, **k):
        with record_function("ps.sample"):
            return sample(*a, **k)

    def traced_apply(*a, **k):
        with record_function("ps.plan"):
            return apply(*a, **k)
    if traced:
        runner.sampler.sample, runner.batch.apply = traced_sample, traced_apply
    return runner


def decode_plans(tpl, batch: int, steps: int):
    """Plans for `batch` sequences decoding `steps` tokens after a cached context; and the blocks they need."""
    ctx = len(tpl.tokens)
    npb = -(-(ctx + steps) // BLOCK_SIZE)
    tables = [list(range(i * npb, (i + 1) * npb)) for i in range(batch)]
    plans = [StepPlan(0, new_seqs=[NewSeq(i, list(tpl.tokens), tables[i], ctx - 1, 1, GREEDY)
                                   for i in range(batch)])]
    plans += [StepPlan(s, running=[SeqDelta(i, [], 1) for i in range(batch)]) for s in range(1, steps)]
    return plans, batch * npb, tables


def run_case(loaded, name: str, plans_fn, steps: int) -> dict:
    """Wall ms/step (median of `steps`, no profiler) and a per-category split from a profiled rerun."""
    res = {}
    for traced in (False, True):
        plans, num_blocks, fill = plans_fn()
        runner = make_runner(loaded, num_blocks, traced)
        fill(runner)
        times = []
        prof = profile(activities=[ProfilerActivity.CPU]) if traced else None
        if prof:
            prof.__enter__()
        for i, plan in enumerate(plans):
            t0 = time.perf_counter()
            runner.step(plan)
            if i > 0 or len(plans) == 1:
                times.append(time.perf_counter() - t0)
        if prof:
            prof.__exit__(None, None, None)
        times.sort()
        if not traced:
            res["wall_ms"] = times[len(times) // 2] * 1e3
            continue
        n = len(times)
        total = sum(times) * 1e3 / n
        ev = prof.key_averages()
        by = {e.key: e for e in ev}
        region = {r: (by[r].cpu_time_total / 1e3 / n if r in by else 0.0) for r in REGIONS}
        # matmuls outside attention: linear's total includes its addmm/mm children
        linear = by["aten::linear"].cpu_time_total / 1e3 / n if "aten::linear" in by else 0.0
        self_ops = sum(e.self_cpu_time_total for e in ev if not e.key.startswith("ps.")
                       and not e.key.startswith("ProfilerStep")) / 1e3 / n
        attn_sample_plan = sum(region.values())
        other_ops = max(0.0, self_ops - linear - attn_sample_plan + 0)  # rough: region self-times are ~0
        res.update(prof_ms=total, matmul=linear, **{k.removeprefix("ps."): v for k, v in region.items()},
                   other_ops=max(0.0, other_ops), python=max(0.0, total - self_ops))
    print(f"{name:<22} wall {res['wall_ms']:8.1f} ms | profiled {res['prof_ms']:8.1f}: matmul {res['matmul']:7.1f}"
          f"  attention {res['attention']:6.1f}  write_kv {res['write_kv']:5.1f}  other ops {res['other_ops']:6.1f}"
          f"  sample {res['sample']:5.1f}  plan {res['plan']:5.1f}  python/dispatch {res['python']:6.1f}", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--batches", default="1,16,64")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(resolve_model(args.model), "float32", "cpu")
    print(f"torch threads {torch.get_num_threads()}, model {args.model}, float32; ms per step", flush=True)
    tpl = prefill_template(loaded, args.ctx, seed=args.ctx)
    for batch in map(int, args.batches.split(",")):
        def plans_fn(batch=batch):
            plans, nb, tables = decode_plans(tpl, batch, args.steps + 1)

            def fill(runner):
                for t in tables:
                    runner.pool.kv[:, :, t[0]:t[0] + tpl.kv.shape[2]].copy_(tpl.kv)
            return plans, nb, fill
        run_case(loaded, f"decode b={batch} ctx={args.ctx}", plans_fn, args.steps + 1)

    def prefill_fn(n=2048):
        toks = list(range(100, 100 + n + 1))
        nb = -(-(n + 1) // BLOCK_SIZE)
        return [StepPlan(0, new_seqs=[NewSeq(0, toks, list(range(nb)), 0, n, GREEDY)])], nb, lambda r: None
    run_case(loaded, "prefill chunk 2048", prefill_fn, 1)


if __name__ == "__main__":
    main()
