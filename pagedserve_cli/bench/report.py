"""Benchmark statistics and outputs: the summary (stdout, summary.md), results.json and PNG plots."""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import numpy as np

from pagedserve_cli.bench.clients import RequestRecord

PERCENTILES = (50, 90, 99)


def percentiles(values: list[float]) -> dict[str, float | None]:
    """p50/p90/p99 (numpy's linear interpolation, as vLLM's benchmark) and the mean; None when empty."""
    if not values:
        return {**{f"p{p}": None for p in PERCENTILES}, "mean": None}
    arr = np.asarray(values, dtype=np.float64)
    return {**{f"p{p}": float(np.percentile(arr, p)) for p in PERCENTILES}, "mean": float(arr.mean())}


def itl_gaps(rec: RequestRecord) -> list[float]:
    """Gaps between a request's consecutive chunks; a chunk of k tokens counts as k even gaps (as vLLM's
    benchmark does). Tokens that came with the first chunk belong to the TTFT, not to any gap."""
    gaps: list[float] = []
    for prev, t, k in zip(rec.chunk_times, rec.chunk_times[1:], rec.chunk_tokens[1:]):
        if k > 0:
            gaps.extend([(t - prev) / k] * k)
    return gaps


def ttft(rec: RequestRecord) -> float | None:
    return None if rec.first_token_time is None else rec.first_token_time - rec.send_time


def server_metrics(samples: list[tuple[float, dict[str, float]]]) -> dict | None:
    """Peak KV blocks used, and counter deltas over the run (prefix hit rate, preemptions, worker idle time)."""
    if not samples:
        return None
    first, last = samples[0][1], samples[-1][1]

    def delta(name: str) -> float | None:
        return last[name] - first.get(name, 0.0) if name in last else None

    # NOTE: a peer (vLLM) has only the vllm: counters; ours has both, and its pagedserve_* ones come first
    queries = delta("pagedserve_prefix_cache_queries_tokens_total")
    queries = delta("vllm:prefix_cache_queries_total") if queries is None else queries
    hits = delta("pagedserve_prefix_cache_hits_tokens_total")
    hits = delta("vllm:prefix_cache_hits_total") if hits is None else hits
    preemptions = delta("pagedserve_preemptions_total")
    preemptions = delta("vllm:num_preemptions_total") if preemptions is None else preemptions
    used = [s.get("pagedserve_kv_blocks_used") for _, s in samples if "pagedserve_kv_blocks_used" in s]
    out = {"kv_blocks_used_peak": max(used) if used else None,
           "kv_blocks_total": last.get("pagedserve_kv_blocks_total"),
           "prefix_queries_tokens": queries, "prefix_hits_tokens": hits,
           "prefix_hit_rate": hits / queries if queries and hits is not None else None,
           "preemptions": preemptions, "samples": len(samples)}
    if "pagedserve_worker_idle_seconds_count" in last:
        out["worker_idle_seconds_sum"] = delta("pagedserve_worker_idle_seconds_sum")
        out["worker_idle_seconds_count"] = delta("pagedserve_worker_idle_seconds_count")
    return out


def summarize(records: list[RequestRecord], samples: list | None = None) -> dict:
    """The run's figures. Wall = first send to last finish; output tok/s = completed requests' tokens / wall."""
    ok = [r for r in records if r.error is None]
    ends = [r.end_time for r in records if r.end_time is not None]
    wall = max(ends) - min(r.send_time for r in records) if ends else 0.0
    out_tokens = sum(r.output_tokens for r in ok)
    return {
        "requests": len(records), "completed": len(ok), "failed": len(records) - len(ok),
        "wall_s": wall,
        "requests_per_s": len(ok) / wall if wall > 0 else 0.0,
        "output_tok_s": out_tokens / wall if wall > 0 else 0.0,
        "prompt_tokens": sum(r.prompt_tokens for r in ok), "output_tokens": out_tokens,
        "ttft_s": percentiles([t for r in ok if (t := ttft(r)) is not None]),
        "itl_s": percentiles([g for r in ok for g in itl_gaps(r)]),
        "e2e_s": percentiles([r.end_time - r.send_time for r in ok]),
        "errors": dict(Counter(r.error for r in records if r.error is not None).most_common(5)),
        "server": server_metrics(samples or []),
    }


def _ppp(p: dict) -> str:
    if p["p50"] is None:
        return "n/a"
    return " / ".join(f"{p[f'p{q}']:.4f}" for q in PERCENTILES) + " s"


def render_summary(summary: dict, config: dict) -> str:
    """summary.md: what ran, then one table of figures (also printed to stdout)."""
    s = summary
    model = config.get("model") or config.get("served_model")
    target = config.get("server") or f"{config.get('openai_url')} (model {model})"
    lines = [f"# pagedserve bench: {target}", "",
             f"workload `{config['workload']}`, {s['requests']} requests, seed {config['seed']}, rate "
             f"{config['rate'] or 'all at once'}, max concurrency {config['max_concurrency'] or 'none'}, "
             f"temperature {config['temperature']}, ignore_eos {config['ignore_eos']}", "",
             "| metric | value |", "| --- | --- |",
             f"| requests | {s['completed']} completed, {s['failed']} failed |",
             f"| tokens | {s['prompt_tokens']} prompt, {s['output_tokens']} output |",
             f"| total wall | {s['wall_s']:.2f} s |",
             f"| requests/s | {s['requests_per_s']:.2f} |",
             f"| output tokens/s | {s['output_tok_s']:.1f} |",
             f"| TTFT p50 / p90 / p99 | {_ppp(s['ttft_s'])} |",
             f"| ITL p50 / p90 / p99 | {_ppp(s['itl_s'])} |",
             f"| end-to-end p50 / p90 / p99 | {_ppp(s['e2e_s'])} |"]
    if (m := s.get("server")) is not None:
        total = f" of {m['kv_blocks_total']:.0f}" if m.get("kv_blocks_total") else ""
        peak = "n/a" if m["kv_blocks_used_peak"] is None else f"{m['kv_blocks_used_peak']:.0f}{total}"
        rate = "n/a" if m["prefix_hit_rate"] is None else \
            f"{m['prefix_hit_rate']:.1%} ({m['prefix_hits_tokens']:.0f} of {m['prefix_queries_tokens']:.0f} tokens)"
        preempted = "n/a" if m["preemptions"] is None else f"{m['preemptions']:.0f}"
        lines += [f"| KV blocks used (peak) | {peak} |", f"| prefix cache hit rate | {rate} |",
                  f"| preemptions | {preempted} |"]
        if m.get("worker_idle_seconds_count") is not None:
            lines.append(f"| worker idle | {m['worker_idle_seconds_sum']:.3f} s over "
                         f"{m['worker_idle_seconds_count']:.0f} waits |")
    if s.get("compute") is not None or s.get("cpu") is not None:
        from pagedserve_cli.bench import efficiency

        lines += efficiency.render(s.get("compute"), s.get("cpu"))
        lines += ["", f"`{efficiency.machine_line(s.get('compute'), s.get('cpu'))}`"]
    if s["errors"]:
        lines += ["", "Errors (most common):", *(f"- {n} x {e}" for e, n in s["errors"].items())]
    return "\n".join(lines) + "\n"


def last_line(summary: dict) -> str:
    """The machine-readable last line of stdout (nan where nothing was measured)."""
    ttft_p50, itl_p50 = (float("nan") if v is None else v for v in (summary["ttft_s"]["p50"], summary["itl_s"]["p50"]))
    return f"output_tok_s={summary['output_tok_s']:.1f} ttft_p50_s={ttft_p50:.4f} itl_p50_s={itl_p50:.4f}"


def write_results(out: Path, config: dict, summary: dict, records: list[RequestRecord], samples: list) -> None:
    out.mkdir(parents=True, exist_ok=True)
    doc = {"config": config, "summary": summary, "requests": [asdict(r) for r in records],
           "metrics_samples": [{"t": t, **values} for t, values in samples]}
    (out / "results.json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    (out / "summary.md").write_text(render_summary(summary, config), encoding="utf-8")


def _hist_and_cdf(ax_hist, ax_cdf, values: list[float], label: str) -> None:
    if not values:
        ax_hist.text(0.5, 0.5, "no data", ha="center", transform=ax_hist.transAxes)
        return
    v = np.sort(np.asarray(values) * 1000.0)
    ax_hist.hist(v, bins=min(50, max(5, len(v) // 4)))
    ax_hist.set_xlabel(f"{label} (ms)")
    ax_hist.set_ylabel("count")
    ax_cdf.plot(v, np.arange(1, len(v) + 1) / len(v))
    ax_cdf.set_xlabel(f"{label} (ms)")
    ax_cdf.set_ylabel("fraction ≤ x")
    ax_cdf.grid(alpha=0.3)


def write_plots(out: Path, records: list[RequestRecord], title: str) -> list[Path]:
    """throughput.png (output tokens/s over time), ttft.png and itl.png (histogram and CDF)."""
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    ok = [r for r in records if r.error is None]
    times = np.asarray([t for r in records for t in r.chunk_times])
    weights = np.asarray([k for r in records for k in r.chunk_tokens])
    fig, ax = plt.subplots(figsize=(8, 4))
    if times.size:
        start = min(r.send_time for r in records)
        width = max(0.25, float(times.max() - start) / 60)  # about 60 bins whatever the run's length
        edges = np.append(np.arange(start, times.max(), width), times.max())
        counts, _ = np.histogram(times, bins=edges, weights=weights)
        ax.stairs(counts / np.maximum(np.diff(edges), 1e-9), edges - start)  # the last bin may be shorter
    ax.set_xlabel("time since the first request (s)")
    ax.set_ylabel("output tokens/s")
    ax.set_title(f"{title}: output throughput")
    ax.grid(alpha=0.3)
    paths = [_save(fig, out / "throughput.png")]
    for name, values, label in (("ttft.png", [t for r in ok if (t := ttft(r)) is not None], "TTFT"),
                                ("itl.png", [g for r in ok for g in itl_gaps(r)], "inter-token latency")):
        fig, (a, b) = plt.subplots(1, 2, figsize=(10, 4))
        _hist_and_cdf(a, b, values, label)
        fig.suptitle(f"{title}: {label}")
        paths.append(_save(fig, out / name))
    return paths


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path
