"""A lone stream's decode step against its kernels' own time: batch 1, one sequence decoding after a cached context.

Times `--steps` runner steps (time.perf_counter_ns, median), then the same steps with the layers on lean_model.py's
Python loop (lean_stack.py runs them in one C++ call: the same kernels in the same order), and in a third run of the
Python loop the sum of the C++ kernel calls inside each step (every ctypes entry point the step calls: quantised /
panel / AMX matmuls, the fused norms, SiLU and rotary, write_kv, attention, argmax), each timed around its ctypes
call alone. The rest of the step is Python and torch around the kernels (plan, metadata, embedding, lm_head,
sampling, and on the Python loop the per-layer calls). On a loaded machine only the ratios mean much.

usage: python bench/lone_step.py [--model smollm2-135m-instruct] [--dtype float32] [--weight-dtype auto]
       [--activation-dtype auto|int8] [--ctx 256] [--steps 200] [--threads N] [--clock wall|cpu]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from worker_step import BLOCK_SIZE, GREEDY, prefill_template  # noqa: E402

from pagedserve_common.step import NewSequence, SequenceDelta, StepPlan  # noqa: E402
from worker_svc.cpu_ops import shared_ops  # noqa: E402
from worker_svc.heap import keep_heap_mapped  # noqa: E402
from worker_svc.kv_pool import KVPool  # noqa: E402
from worker_svc.model_store import DEFAULT_MODEL, resolve_model  # noqa: E402
from worker_svc.models import load_model  # noqa: E402
from worker_svc.quant.kernel import shared_kernel  # noqa: E402
from worker_svc.runner import ModelRunner  # noqa: E402
from worker_svc.worker import make_backend  # noqa: E402

KERNEL_NS = [0]
HAS_STACK = [False]  # whether lean_stack.py covers the model (its layer loop in one C++ call)
CLOCK = [time.perf_counter_ns]  # --clock cpu: time.thread_time_ns (with --threads 1: preemption by other load not counted)


def timed(fn):
    """fn (a ctypes function) with its wall time added to KERNEL_NS."""
    clock = CLOCK[0]

    def call(*args):
        t0 = clock()
        rc = fn(*args)
        KERNEL_NS[0] += clock() - t0
        return rc
    return call


def time_kernels(runner: ModelRunner) -> None:
    """Wraps every ctypes entry point a CPU decode step reaches (on the shared objects the runner uses)."""
    objs = [o for o in (shared_ops(), shared_kernel(False), shared_kernel(True)) if o is not None]
    for obj in objs:
        for name, value in list(vars(obj).items()) if not hasattr(obj, "__slots__") else []:
            if isinstance(value, dict):
                vars(obj)[name] = {k: timed(v) if callable(v) else v for k, v in value.items()}
            elif callable(value) and hasattr(value, "argtypes"):
                setattr(obj, name, timed(value))
    backend = runner.backend
    if hasattr(backend, "_fn"):
        backend._fn = timed(backend._fn)
        backend.lib.ps_write_kv = timed(backend.lib.ps_write_kv)


def run(loaded, tpl, args, with_kernels: bool, python_loop: bool = False) -> tuple[list[int], list[int]]:
    """The steps' times, and with_kernels the kernel calls' time in each. python_loop (and with_kernels, whose
    ctypes calls are timed one by one from Python): the layers run by lean_model.py's Python loop, not in one C++
    call (lean_stack.py), the same kernels in the same order."""
    ctx, steps = len(tpl.tokens), args.steps + args.warm + 1
    npb = -(-(ctx + steps) // BLOCK_SIZE)
    backend = make_backend("auto", "cpu", loaded.kv_geometry(BLOCK_SIZE))
    runner = ModelRunner(loaded, KVPool(loaded.kv_geometry(BLOCK_SIZE), npb), backend)
    runner.pool.kv[:, :, 0:tpl.kv.shape[2]].copy_(tpl.kv)
    stack = runner.lean.stack
    HAS_STACK[0] = stack is not None
    if with_kernels or python_loop:
        runner.lean.stack = None
    if with_kernels:
        time_kernels(runner)
    runner.step(StepPlan(0, new_seqs=[NewSequence(0, list(tpl.tokens), list(range(npb)), ctx - 1, 1, GREEDY)]))
    walls, kernels = [], []
    for s in range(1, steps):
        plan = StepPlan(s, running=[SequenceDelta(0, [], 1)])
        KERNEL_NS[0] = 0
        t0 = CLOCK[0]()
        runner.step(plan)
        if s > args.warm:
            walls.append(CLOCK[0]() - t0)
            kernels.append(KERNEL_NS[0])
    runner.lean.stack = stack
    return walls, kernels


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--weight-dtype", default="auto")
    ap.add_argument("--activation-dtype", default="auto")
    ap.add_argument("--ctx", type=int, default=256)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--warm", type=int, default=10)
    ap.add_argument("--threads", type=int)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: the main thread's CPU time (time.thread_time_ns), needs --threads 1; steadier on a "
                         "loaded machine")
    args = ap.parse_args()
    if args.clock == "cpu":
        if args.threads != 1:
            ap.error("--clock cpu times the main thread only: it needs --threads 1")
        CLOCK[0] = time.thread_time_ns
    keep_heap_mapped()
    if args.threads:
        torch.set_num_threads(args.threads)
    loaded = load_model(resolve_model(args.model), args.dtype, "cpu", weight_dtype=args.weight_dtype,
                        activation_dtype=args.activation_dtype)
    tpl = prefill_template(loaded, args.ctx, seed=args.ctx)
    walls, _ = run(loaded, tpl, args, with_kernels=False)
    walls_py, _ = run(loaded, tpl, args, with_kernels=False, python_loop=True)
    walls_k, kernels = run(loaded, tpl, args, with_kernels=True)
    wall, kern = statistics.median(walls) / 1e6, statistics.median(kernels) / 1e6
    wall_py = statistics.median(walls_py) / 1e6
    wall_k = statistics.median(walls_k) / 1e6
    print(f"{args.model} {args.dtype} weights {args.weight_dtype} activations {args.activation_dtype} "
          f"ctx {args.ctx}, threads {torch.get_num_threads()}, {args.steps} steps (median):")
    rest = statistics.median(w - k for w, k in zip(walls_k, kernels)) / 1e6
    print(f"  ({args.clock} clock) step {wall:.3f} ms | kernels {kern:.3f} ms, the rest {rest:.3f} ms (a step of "
          f"{wall_k:.3f} ms with the kernels timed) | step / kernels {wall / kern:.2f}")
    loop = "C++ (lean_stack)" if HAS_STACK[0] else "Python (lean_stack does not cover this model)"
    print(f"  layer loop {loop}; the Python loop's step {wall_py:.3f} ms: step / Python loop's {wall / wall_py:.2f}")


if __name__ == "__main__":
    main()
