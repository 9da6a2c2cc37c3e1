"""This machine's GEMM peak at the model's shapes: torch F.linear GFLOP/s, float32 (and bfloat16 where native).

    python bench/gemm_peak.py [--model DIR] [--out bench/out/gemm_peak.json] [--ms 1,16,64,256,512,2048]
                              [--threads 1,ALL] [--dtypes float32,bfloat16] [--budget-s 0.2]

The shapes are the worker's per-token matmuls (worker_svc/lean_model.py), read from the model's config.json
(default: the default model): the fused QKV [hidden -> (heads + 2 x kv heads) x head_dim], o_proj, the fused
gate_up [hidden -> 2 x intermediate], down, and the lm_head [hidden -> vocab], each x [M, K] @ w[N, K]^T for M
tokens in a step (the lm_head only up to M = 64: the runner computes it for the sampled rows alone, one per
running sequence), in each layout the worker may hold a weight in: F.linear on [N, K], torch.mm on [K, N]
contiguous (float32), oneDNN's prepacked weight (mkldnn._linear_pointwise) where it runs; a point's figure is the
best of its layouts. Each point runs at 1 thread and at all the cores this process may use, in --rounds passes
over all the points: a warm-up call, then repeats (each a loop of calls lasting >= 2 ms) for --budget-s /
--rounds seconds; GFLOP/s = 2 M N K / time of one call, the best repeat (best-of-N: the machine is shared, a
busy neighbour only slows some repeats) and the median (the spread). bfloat16 runs only where /proc/cpuinfo
has avx512_bf16 or amx_bf16 (elsewhere torch emulates it), unless --dtypes names it.

Peak (per dtype and thread count) = the highest best-of-N GFLOP/s over the five shapes and the layouts at
M >= 256: what torch's GEMMs reach on the model's own shapes with a large batch, not the CPU's datasheet FLOP/s.
`pagedserve bench` divides the model FLOP/s it achieved by the peak at the most threads (see --gemm-peak there).

Writes --out and $PAGEDSERVE_CACHE (else ~/.cache/pagedserve)/gemm_peak-<cpu key>.json, where `pagedserve bench`
finds it; --merge keeps each point's best of this run and the cached file's (run it a few times on a shared
machine: a neighbour's busy spell costs the all-core figures most). A run takes about 35-45 s on a 2-core
machine. Last line:

    gemm_peak float32_1t=... float32_2t=... bfloat16_1t=... bfloat16_2t=...  (GFLOP/s)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedserve_cli.bench.flops import ModelShape  # noqa: E402
from pagedserve_cli.bench.peak import cpu_info, cpu_key, default_path  # noqa: E402

LARGE_M = 256  # NOTE: the peak is taken over M >= this
LM_HEAD_MAX_M = 64  # NOTE: the lm_head runs on the sampled rows only: one per running sequence
MIN_LOOP_S = 0.002
MIN_REPEATS = 2
MAX_REPEATS = 100


def layouts(w: torch.Tensor) -> dict[str, Callable[[torch.Tensor], torch.Tensor]]:
    """The ways the worker may run x @ w.T (worker_svc/linear.py on main): F.linear on w [n, k]; torch.mm on w
    stored [k, n] contiguous (float32); oneDNN's prepacked weight (mkldnn._reorder_linear_weight) where it runs."""
    out: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"linear": lambda x: F.linear(x, w)}
    if w.dtype == torch.float32:
        wt = w.t().contiguous()
        out["mm"] = lambda x: torch.mm(x, wt)
    if torch.backends.mkldnn.is_available():
        try:
            packed = torch.ops.mkldnn._reorder_linear_weight(w, 64)
            torch.ops.mkldnn._linear_pointwise(torch.zeros(1, w.shape[1], dtype=w.dtype), packed, None, "none", [], "")
            out["onednn"] = lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")
        except (RuntimeError, AttributeError):
            pass
    return out


def time_point(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, budget_s: float) -> list[float]:
    """Seconds per call of fn(x), one figure per repeat (a loop of >= MIN_LOOP_S)."""
    with torch.inference_mode():
        t0 = time.perf_counter()
        fn(x)  # warm-up: oneDNN picks and caches its kernel
        one = max(time.perf_counter() - t0, 1e-7)
        calls = max(1, int(MIN_LOOP_S / one))
        times: list[float] = []
        end = time.perf_counter() + budget_s
        while len(times) < MIN_REPEATS or (time.perf_counter() < end and len(times) < MAX_REPEATS):
            t0 = time.perf_counter()
            for _ in range(calls):
                fn(x)
            times.append((time.perf_counter() - t0) / calls)
    return times


def measure(shape: ModelShape, ms: list[int], thread_counts: list[int], dtypes: list[str],
            budget_s: float, rounds: int) -> list[dict]:
    """Every point (and every layout of it), `rounds` times over (NOTE: a busy spell of a neighbour then slows one
    round of a point, not all its repeats), budget_s / rounds seconds a round, shared by its layouts."""
    points = [(dtype, threads, name, k, n, m) for dtype in dtypes for threads in thread_counts
              for name, (k, n) in shape.gemms().items() for m in ms if name != "lm_head" or m <= LM_HEAD_MAX_M]
    times: dict[tuple, list[float]] = {}
    xs: dict[tuple, torch.Tensor] = {}
    ws: dict[tuple, dict] = {}
    for _ in range(rounds):
        for dtype, threads, name, k, n, m in points:
            dt = getattr(torch, dtype)
            if (dtype, m, k) not in xs:
                xs[dtype, m, k] = torch.randn(m, k).to(dt)
            if (dtype, k, n) not in ws:
                ws[dtype, k, n] = layouts((torch.randn(n, k) / k ** 0.5).to(dt))
            torch.set_num_threads(threads)
            fns = ws[dtype, k, n]
            for layout, fn in fns.items():
                times.setdefault((dtype, threads, name, k, n, m, layout), []).extend(
                    time_point(fn, xs[dtype, m, k], budget_s / rounds / len(fns)))
    rows = []
    for (dtype, threads, name, k, n, m, layout), ts in times.items():
        flop = 2 * m * n * k
        rows.append({"dtype": dtype, "threads": threads, "gemm": name, "m": m, "k": k, "n": n, "layout": layout,
                     "repeats": len(ts), "best_gflops_s": flop / min(ts) / 1e9,
                     "median_gflops_s": flop / statistics.median(ts) / 1e9})
    return rows


def merge(rows: list[dict], old: dict, key: dict) -> tuple[list[dict], int]:
    """Each point's best over this run and an earlier one of the same CPU, torch and shapes (`old`, the JSON it
    wrote; ignored when any of those differ), and how many runs that covers. NOTE: best-of-N across runs: a
    neighbour that held a core through one run does not lower the peak."""
    if {k: old.get(k) for k in key} != key:
        return rows, 1
    before = {(r["dtype"], r["threads"], r["gemm"], r["m"], r.get("layout")): r for r in old.get("results", [])}
    merged = []
    for r in rows:
        o = before.get((r["dtype"], r["threads"], r["gemm"], r["m"], r.get("layout")))
        merged.append(o if o is not None and o["best_gflops_s"] > r["best_gflops_s"] else r)
    return merged, int(old.get("runs", 1)) + 1


def peaks(rows: list[dict]) -> dict:
    """dtype -> threads -> the best point at M >= LARGE_M, with its median (the spread)."""
    out: dict = {}
    for r in rows:
        if r["m"] < LARGE_M:
            continue
        slot = out.setdefault(r["dtype"], {})
        best = slot.get(str(r["threads"]))
        if best is None or r["best_gflops_s"] > best["gflops_s"]:
            slot[str(r["threads"])] = {"gflops_s": r["best_gflops_s"], "median_gflops_s": r["median_gflops_s"],
                                       "gemm": r["gemm"], "m": r["m"], "layout": r.get("layout", "linear")}
    return out


def render(rows: list[dict], ms: list[int], peak: dict) -> str:
    lines = []
    for dtype in dict.fromkeys(r["dtype"] for r in rows):
        for threads in dict.fromkeys(r["threads"] for r in rows if r["dtype"] == dtype):
            mine = [r for r in rows if r["dtype"] == dtype and r["threads"] == threads]
            lines += [f"{dtype}, {threads} thread{'s' if threads > 1 else ''}: best-of-N GFLOP/s (median) and the "
                      "layout that gave it", "",
                      "| gemm | K -> N | " + " | ".join(f"M={m}" for m in ms) + " |",
                      "| --- | --- |" + " ---: |" * len(ms)]
            for name in dict.fromkeys(r["gemm"] for r in mine):
                cells: dict[int, dict] = {}
                for r in mine:
                    if r["gemm"] == name and (r["m"] not in cells or r["best_gflops_s"] > cells[r["m"]]["best_gflops_s"]):
                        cells[r["m"]] = r
                first = next(iter(cells.values()))
                lines.append(f"| {name} | {first['k']} -> {first['n']} | " + " | ".join(
                    f"{cells[m]['best_gflops_s']:.1f} ({cells[m]['median_gflops_s']:.1f}) {cells[m]['layout']}"
                    if m in cells else "-"
                    for m in ms) + " |")
            p = peak[dtype][str(threads)]
            lines += ["", f"peak {p['gflops_s']:.1f} GFLOP/s ({p['gemm']}, M={p['m']}, {p['layout']}; its median "
                          f"{p['median_gflops_s']:.1f})", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model dir (default: the default model, pulled if missing)")
    ap.add_argument("--out", default="bench/out/gemm_peak.json")
    ap.add_argument("--ms", default="1,16,64,256,512,2048", help="tokens per step, comma-separated")
    ap.add_argument("--threads", default="1,ALL", help="thread counts, comma-separated; ALL = the usable cores")
    ap.add_argument("--dtypes", help="default float32, and bfloat16 where the CPU computes it natively")
    ap.add_argument("--budget-s", type=float, default=0.2, help="timed seconds per point (default 0.2)")
    ap.add_argument("--rounds", type=int, default=3, help="passes over every point, the budget split (default 3)")
    ap.add_argument("--merge", action="store_true",
                    help="keep each point's best of this run and the cached one (same CPU, torch, shapes)")
    ap.add_argument("--no-cache", action="store_true", help="do not write the cached copy pagedserve bench reads")
    args = ap.parse_args(argv)
    if args.model is None:
        from pagedserve_cli.serve_cmd import model_dir
        from pagedserve_common.defaults import DEFAULT_MODEL

        args.model = model_dir(DEFAULT_MODEL)
    info = cpu_info()
    cores = info["num_cores"]
    thread_counts = list(dict.fromkeys(cores if t.strip().upper() == "ALL" else int(t)
                                       for t in args.threads.split(",")))
    dtypes = args.dtypes.split(",") if args.dtypes else ["float32"] + (["bfloat16"] if info["native_bf16"] else [])
    ms = [int(m) for m in args.ms.split(",")]
    shape = ModelShape.from_dir(args.model)
    t0 = time.perf_counter()
    rows = measure(shape, ms, thread_counts, dtypes, args.budget_s, args.rounds)
    wall_s, runs = time.perf_counter() - t0, 1
    cache = default_path(info)
    same = {"cpu_key": cpu_key(info), "torch": torch.__version__, "model": str(args.model), "ms": ms,
            "threads": thread_counts, "dtypes": dtypes}
    if args.merge and cache.is_file():
        rows, runs = merge(rows, json.loads(cache.read_text(encoding="utf-8")), same)
    peak = peaks(rows)
    doc = {"cpu": {"model_name": info["model_name"], "num_cores": cores, "native_bf16": info["native_bf16"],
                   "key": cpu_key(info)},
           **same, "budget_s": args.budget_s, "rounds": args.rounds, "wall_s": wall_s, "runs": runs,
           "peak_definition": f"the highest best-of-N GFLOP/s (2 M N K / seconds per call) over the model's five "
                              f"GEMMs and the weight layouts (linear, mm, onednn) at M >= {LARGE_M}, per dtype and "
                              f"thread count",
           "peak": peak, "results": rows}
    print(render(rows, ms, peak))
    paths = [Path(args.out)] + ([] if args.no_cache else [cache])
    for path in paths:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {', '.join(map(str, paths))} in {wall_s:.0f} s ({runs} run{'s' if runs > 1 else ''}) "
          f"({info['model_name']}, {cores} cores, native bfloat16: {' '.join(info['native_bf16']) or 'no'})")
    print("gemm_peak " + " ".join(f"{d}_{t}t={peak[d][str(t)]['gflops_s']:.1f}" for d in dtypes
                                  for t in thread_counts), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
