"""Where a worker step's time goes: decode at batch 1/16/64 and one 2,048-token prefill chunk, by category.

Each case builds real plans over the real ModelRunner (model loading and the KV fill are never timed), times
`--steps` steps without the profiler (wall ms/step), then profiles the same steps with torch.profiler and splits
the time into: matmuls (aten::linear or mm/addmm/oneDNN linear/the AMX, float32 panel and quantised kernels:
QKV/O/MLP/lm_head), attention (the backend's forward), KV writes,
sampling, plan (persistent batch), and the rest: other torch ops (norms, rotary, activations, embedding) plus
Python and dispatcher time between ops.

usage: python bench/profile_step.py [--model smollm2-135m-instruct] [--dtype float32] [--threads N] [--ctx 256] [--steps 5]
       [--batches 1,16,64] [--prefill 2048] [--top N] [--weight-dtype auto] [--activation-dtype auto]
       [--backend auto|cpu|torch] [--transformers]      (the last two: the path before the lean forward)
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

from worker_svc.cpu_ops import CpuOps  # noqa: E402
from worker_svc.heap import keep_heap_mapped  # noqa: E402
from worker_svc.kv_pool import KVPool  # noqa: E402
from worker_svc.model_store import DEFAULT_MODEL, resolve_model  # noqa: E402
from worker_svc.models import load_model  # noqa: E402
from worker_svc.quant.kernel import QuantKernel  # noqa: E402
from pagedserve_common.step import NewSequence, SequenceDelta, StepPlan  # noqa: E402
from worker_svc.runner import ModelRunner  # noqa: E402
from worker_svc.worker import make_backend  # noqa: E402

ARGS: argparse.Namespace

REGIONS = ("ps.attention", "ps.write_kv", "ps.sample", "ps.plan")
AMX_LINEAR, F32_LINEAR, Q_LINEAR = CpuOps.amx_linear, CpuOps.f32_linear, QuantKernel.linear


def traced(fn, label):
    def wrapper(*a, **k):
        with record_function(label):
            return fn(*a, **k)
    return wrapper


def make_runner(loaded, num_blocks, traced_run: bool):
    backend = make_backend(ARGS.backend, "cpu", loaded.kv_geometry(BLOCK_SIZE))
    runner = ModelRunner(loaded, KVPool(loaded.kv_geometry(BLOCK_SIZE), num_blocks), backend, lean=not ARGS.transformers)
    if traced_run:
        backend.write_kv = traced(backend.write_kv, "ps.write_kv")
        backend.forward = traced(backend.forward, "ps.attention")
    sample, apply = runner.sampler.sample, runner.batch.apply

    def traced_sample(*a, **k):
        with record_function("ps.sample"):
            return sample(*a, **k)

    def traced_apply(*a, **k):
        with record_function("ps.plan"):
            return apply(*a, **k)
    if traced_run:
        runner.sampler.sample, runner.batch.apply = traced_sample, traced_apply
    return runner


def decode_plans(tpl, batch: int, steps: int):
    """Plans for `batch` sequences decoding `steps` tokens after a cached context; and the blocks they need."""
    ctx = len(tpl.tokens)
    npb = -(-(ctx + steps) // BLOCK_SIZE)
    tables = [list(range(i * npb, (i + 1) * npb)) for i in range(batch)]
    plans = [StepPlan(0, new_seqs=[NewSequence(i, list(tpl.tokens), tables[i], ctx - 1, 1, GREEDY)
                                   for i in range(batch)])]
    plans += [StepPlan(s, running=[SequenceDelta(i, [], 1) for i in range(batch)]) for s in range(1, steps)]
    return plans, batch * npb, tables


def run_case(loaded, name: str, plans_fn, steps: int) -> dict:
    """Wall ms/step (median of `steps`, no profiler) and a per-category split from a profiled rerun."""
    res = {}
    for profiled in (False, True):
        plans, num_blocks, fill = plans_fn()
        runner = make_runner(loaded, num_blocks, profiled)
        fill(runner)
        times = []
        prof = profile(activities=[ProfilerActivity.CPU]) if profiled else None
        if prof:
            CpuOps.amx_linear = traced(AMX_LINEAR, "ps.amx_linear")  # our kernels are no torch ops: name them
            CpuOps.f32_linear = traced(F32_LINEAR, "ps.f32_linear")
            QuantKernel.linear = traced(Q_LINEAR, "ps.q_linear")
            prof.__enter__()
        for i, plan in enumerate(plans):
            t0 = time.perf_counter()
            runner.step(plan)
            if i > 0 or len(plans) == 1:
                times.append(time.perf_counter() - t0)
        if prof:
            prof.__exit__(None, None, None)
            CpuOps.amx_linear, CpuOps.f32_linear, QuantKernel.linear = AMX_LINEAR, F32_LINEAR, Q_LINEAR
        times.sort()
        if not profiled:
            res["wall_ms"] = times[len(times) // 2] * 1e3
            continue
        n = len(times)
        total = sum(times) * 1e3 / n
        ev = prof.key_averages()
        by = {e.key: e for e in ev}
        region = {r: (by[r].cpu_time_total / 1e3 / n if r in by else 0.0) for r in REGIONS}
        # matmuls outside attention: linear's total includes its addmm/mm children; the lean forward calls mm/addmm
        # (float32, transposed weights) and oneDNN's prepacked linear (bfloat16, the lm_head) directly
        # (worker_svc/linear.py). NOTE: attention calls no mm on the cpu backend's paths up to 512-token chunks.
        tops = ("aten::linear", "mkldnn::_linear_pointwise") if "aten::linear" in by else \
            ("aten::mm", "aten::addmm", "mkldnn::_linear_pointwise")
        linear = sum(by[k].cpu_time_total for k in (*tops, "ps.amx_linear", "ps.f32_linear", "ps.q_linear") if k in by) / 1e3 / n
        # NOTE: the regions' times are inclusive (the C++ kernel is no torch op, so only its region sees it);
        # the rest is every other op (norms, rotary, activations, embedding, residual adds) plus the Python and
        # dispatcher time between ops.
        rest = total - linear - sum(region.values())
        res.update(prof_ms=total, matmul=linear, **{k.removeprefix("ps."): v for k, v in region.items()},
                   rest=max(0.0, rest))
    if ARGS.top:
        for e in sorted(ev, key=lambda e: -e.self_cpu_time_total)[:ARGS.top]:
            print(f"    {e.key[:60]:<60} self {e.self_cpu_time_total / 1e3 / n:7.2f} ms  calls {e.count // n}")
    print(f"{name:<22} wall {res['wall_ms']:8.1f} ms | profiled {res['prof_ms']:8.1f}: matmul {res['matmul']:7.1f}"
          f"  attention {res['attention']:6.1f}  write_kv {res['write_kv']:5.1f}  sample {res['sample']:5.1f}"
          f"  plan {res['plan']:5.1f}  other ops + python {res['rest']:6.1f}", flush=True)
    return res


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--dtype", default="float32", help="the weights' and KV cache's dtype (float32, bfloat16, ...)")
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--prefill", type=int, default=2048, help="the prefill chunk's tokens (past 512: SDPA's)")
    ap.add_argument("--top", type=int, default=0, help="also list the N ops of most self time per step")
    ap.add_argument("--backend", default="auto", help="attention backend: auto (the worker's default), cpu, torch")
    ap.add_argument("--transformers", action="store_true", help="the transformers modules, not the lean forward")
    ap.add_argument("--weight-dtype", default="auto", help="the worker's --weight-dtype (auto: a GGUF's blocks as stored)")
    ap.add_argument("--activation-dtype", default="auto", help="the worker's --activation-dtype (auto or int8)")
    global ARGS
    args = ARGS = ap.parse_args()
    keep_heap_mapped()  # as the worker does at start
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(resolve_model(args.model), args.dtype, "cpu", weight_dtype=args.weight_dtype,
                        lean=not args.transformers, activation_dtype=args.activation_dtype)
    print(f"torch threads {torch.get_num_threads()}, model {args.model}, {args.dtype}, {loaded.weights_reason}, "
          f"attention {args.backend}, "
          f"{'transformers' if args.transformers else 'lean'} forward; ms per step", flush=True)
    tpl = prefill_template(loaded, args.ctx, seed=args.ctx)
    for batch in map(int, args.batches.split(",")):
        def plans_fn(batch=batch):
            plans, nb, tables = decode_plans(tpl, batch, args.steps + 1)

            def fill(runner):
                for t in tables:
                    runner.pool.kv[:, :, t[0]:t[0] + tpl.kv.shape[2]].copy_(tpl.kv)
            return plans, nb, fill
        run_case(loaded, f"decode b={batch} ctx={args.ctx}", plans_fn, args.steps + 1)

    def prefill_fn(n=args.prefill):
        toks = list(range(100, 100 + n + 1))
        nb = -(-(n + 1) // BLOCK_SIZE)
        return [StepPlan(0, new_seqs=[NewSequence(0, toks, list(range(nb)), 0, n, GREEDY)])], nb, lambda r: None
    run_case(loaded, f"prefill chunk {args.prefill}", prefill_fn, 1)


if __name__ == "__main__":
    main()
