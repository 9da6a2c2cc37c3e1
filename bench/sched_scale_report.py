"""sched_scale.py's output: the table, the summary lines (the last one is the contract), JSON and a PNG plot."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, replace
from pathlib import Path

GPU_STEP_MS = 20.0  # one H200 decode step of a mid-sized model, the budget scheduling is measured against


def batch_at(points: list, limit_ms: float) -> float:
    """The largest batch size whose mean step time is <= limit_ms, linear in B between measured points."""
    pts = sorted((p.batch_size, p.mean_ms) for p in points)
    best = 0.0
    for (b0, t0), (b1, t1) in zip(pts, pts[1:]):
        if t0 <= limit_ms < t1:
            best = max(best, b0 + (b1 - b0) * (limit_ms - t0) / (t1 - t0))
    if pts[-1][1] <= limit_ms:
        best = pts[-1][0]
    return best


def report(points: list, a, out: Path, tries_mean_ms: list[list[float]]) -> list[str]:
    """Prints the table; writes JSON and the plot; returns the summary lines (the last is the contract)."""
    hdr = (f"{'axis':<12} {'B':>5} {'cached':>7} {'bs':>3} {'mean_ms':>7} {'med_ms':>6} {'p99_ms':>6} "
           f"{'dec_ms':>6} {'adm_ms':>6} {'adm%':>5} {'sched':>6} {'pb':>6} {'upd':>6} {'us/seq':>6} "
           f"{'plan_B':>7} {'evict':>6} {'fullgc':>6} {'gc_ms':>6} {'w/gc_ms':>7} {'workers':>7} {'step_med':>8} "
           f"{'step_max':>8}")
    print(hdr)
    for p in points:
        print(f"{p.axis:<12} {p.batch_size:>5} {p.num_cached_blocks:>7} {p.block_size:>3} {p.mean_ms:>7.3f} "
              f"{p.median_ms:>6.3f} {p.p99_ms:>6.3f} {p.decode_median_ms:>6.3f} {p.admit_median_ms:>6.3f} "
              f"{100 * p.admit_frac:>5.1f} {p.sched_ms:>6.3f} {p.pb_ms:>6.3f} {p.update_ms:>6.3f} "
              f"{1e3 * p.mean_ms / p.batch_size:>6.2f} {p.num_plan_bytes:>7.0f} {p.num_evictions:>6} "
              f"{p.num_full_gcs:>6} {p.full_gc_ms:>6.0f} {p.mean_incl_gc_ms:>7.3f} "
              f"{math.floor(GPU_STEP_MS / p.mean_ms):>7} {p.median_step_ms:>8.3f} {p.max_step_ms:>8.3f}")
    print(f"workers = floor({GPU_STEP_MS:g} ms / mean_ms): the engine runs one step loop per worker on one asyncio "
          "loop (one thread), so the workers' scheduling times add up; times are per step, less full GC pauses "
          "(fullgc, gc_ms: their count and mean pause; w/gc_ms: mean with them amortised; step_med, step_max: every "
          "step whole, collections included, the max over every run)")
    curve = [p for p in points if p.axis == "batch"]
    limit = GPU_STEP_MS / 10
    b10 = batch_at(curve, limit)
    b10_med = batch_at([replace(p, mean_ms=p.median_ms) for p in curve], limit)
    b10_gc = batch_at([replace(p, mean_ms=p.mean_incl_gc_ms) for p in curve], limit)
    full = [p for p in points if p.num_full_gcs]
    top = max(curve, key=lambda p: p.batch_size)
    at256 = next((p for p in curve if p.batch_size == 256), top)
    (b0, t0), (b1, t1) = [(p.batch_size, p.mean_ms) for p in sorted(curve, key=lambda p: p.batch_size)[-2:]]
    slope_us = 1e3 * (t1 - t0) / (b1 - b0) if b1 > b0 else math.nan
    lines = [
        f"sched_scale requests={a.requests} num_blocks={a.num_blocks} max_batched_tokens={a.max_batched_tokens} "
        f"warmup={a.warmup} steps={a.steps} gpu_step_ms={GPU_STEP_MS:g}",
        f"sched_scale marginal_us_per_seq={slope_us:.2f} (B {b0}->{b1}) batch_at_10pct_median={b10_med:.0f} "
        f"workers_fed_at_{at256.batch_size}_median={math.floor(GPU_STEP_MS / at256.median_ms)}",
        f"sched_scale full_gcs={sum(p.num_full_gcs for p in points)} in {sum(p.num_steps for p in points)} timed "
        f"steps, pause_ms={max((p.full_gc_ms for p in full), default=0):.0f} (max of means) "
        f"batch_at_10pct_incl_gc={b10_gc:.0f} workers_fed_at_{at256.batch_size}_incl_gc="
        f"{math.floor(GPU_STEP_MS / at256.mean_incl_gc_ms)}",
        f"sched_scale batch_at_10pct={b10:.0f} us_per_seq={1e3 * top.mean_ms / top.batch_size:.2f} "
        f"workers_fed_at_256={math.floor(GPU_STEP_MS / at256.mean_ms)} median_step_ms={top.median_step_ms:.3f} "
        f"max_step_ms={top.max_step_ms:.3f}",
    ]
    out.mkdir(parents=True, exist_ok=True)
    (out / "sched_scale.json").write_text(json.dumps(
        {"args": vars(a), "gpu_step_ms": GPU_STEP_MS, "points": [asdict(p) for p in points],
         "tries_mean_ms": tries_mean_ms, "summary": lines},
        indent=1, default=str))
    plot(curve, out / "sched_scale.png", limit)
    return lines


def plot(curve: list, path: Path, limit_ms: float) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    curve = sorted(curve, key=lambda p: p.batch_size)
    bs = [p.batch_size for p in curve]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(bs, [p.mean_ms for p in curve], "o-", label="mean step (schedule + plan_to_pb + update)")
    ax.plot(bs, [p.decode_median_ms for p in curve], "s--", label="median decode-only step")
    ax.plot(bs, [p.admit_median_ms for p in curve], "^:", label="median step admitting prefills")
    ax.plot(bs, [p.mean_incl_gc_ms for p in curve], "x-.", color="tab:purple",
            label="mean step with full GC pauses amortised")
    ax.axhline(limit_ms, color="red", lw=1, label=f"{limit_ms:g} ms = 10% of a {GPU_STEP_MS:g} ms GPU step")
    ax.set(xscale="log", yscale="log", xlabel="running batch size (max_num_seqs)", ylabel="scheduling ms / step",
           title=f"pagedserve Scheduler, block_size {curve[0].block_size}, no pre-cached blocks")
    ax.set_xticks(bs, [str(b) for b in bs])
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
