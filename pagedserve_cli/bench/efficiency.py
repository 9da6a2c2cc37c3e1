"""A run's achieved model FLOP/s, its share of the GEMM peak, and the CPU seconds per process: figures and lines."""

from __future__ import annotations

from pathlib import Path

from pagedserve_cli.bench.flops import ModelShape, run_flops
from pagedserve_cli.bench.peak import peak_of

PEAK_DTYPES = ("float32", "bfloat16")


def flops_model_dir(served_model: str | None, tokenizer_dir: str | None) -> str | None:
    """The served model's directory when the server names one (ours does), else the tokenizer's (the default
    model unless --tokenizer says otherwise: an OpenAI peer's served name is no path)."""
    if served_model and (Path(served_model).expanduser() / "config.json").is_file():
        return str(Path(served_model).expanduser())
    return tokenizer_dir


def served_dtype(flag: str | None, worker_dtypes: list[str], metrics_dtype: str | None,
                 spawn_dtype: str | None) -> tuple[str | None, str]:
    """The dtype whose peak the run is measured against, and where it came from: --peak-dtype, else our workers'
    registered dtype (the KV cache's: the model's under --kv-cache-dtype auto), else the cache_dtype of the
    server's vllm:cache_config_info (vLLM's says "auto": no answer), else --spawn's --dtype (not auto)."""
    if flag:
        return flag, "--peak-dtype"
    kinds = set(worker_dtypes)
    if len(kinds) == 1 and (d := kinds.pop()) in PEAK_DTYPES:
        return d, "the workers' registration"
    if metrics_dtype in PEAK_DTYPES:
        return metrics_dtype, "vllm:cache_config_info"
    if spawn_dtype in PEAK_DTYPES:
        return spawn_dtype, "--dtype"
    return None, "unknown (give --peak-dtype)"


def compute(records: list, server: dict | None, model_dir: str, wall_s: float, peak_doc: dict | None,
            peak_source: str | None, dtype: str | None, dtype_source: str, worker_cpu_s: float | None = None) -> dict:
    """The run's model FLOPs (pagedserve_cli.bench.flops: requests that produced a token; the prefix-cache hits
    from the server's counters, 0 when it gives none) over its wall time, and that as a share of the peak; and
    per CPU-second of the worker processes, as a share of the one-thread peak (NOTE: what a core the worker got
    did, whatever else the machine ran)."""
    shape = ModelShape.from_dir(model_dir)
    hits = (server or {}).get("prefix_hits_tokens")
    done = [(r.prompt_tokens, r.output_tokens) for r in records if r.output_tokens > 0]
    f = run_flops(shape, done, hits or 0.0)
    achieved = f.total / wall_s / 1e9 if wall_s > 0 else 0.0
    peak = peak_of(peak_doc, dtype) if peak_doc is not None and dtype else None
    one = peak_of(peak_doc, dtype, 1) if peak_doc is not None and dtype else None
    per_cpu_s = f.total / worker_cpu_s / 1e9 if worker_cpu_s else None
    return {"model_dir": model_dir, "prefill_tokens": f.prefill_tokens, "decode_tokens": f.decode_tokens,
            "sampled_rows": f.sampled_rows, "prefix_hits_tokens": hits,
            "gflop": {"linear": f.linear / 1e9, "attention": f.attention / 1e9, "lm_head": f.lm_head / 1e9,
                      "total": f.total / 1e9},
            "model_gflops_s": achieved, "dtype": dtype, "dtype_source": dtype_source, "peak_file": peak_source,
            "peak_gflops_s": None if peak is None else peak[0], "peak_threads": None if peak is None else peak[1],
            "peak_share": None if peak is None or peak[0] <= 0 else achieved / peak[0],
            "worker_cpu_s": worker_cpu_s, "gflop_per_worker_cpu_s": per_cpu_s,
            "peak_1t_gflops_s": None if one is None else one[0],
            "per_core_share": None if one is None or per_cpu_s is None or one[0] <= 0 else per_cpu_s / one[0],
            "preemptions": (server or {}).get("preemptions")}


def _f(v: float | None, spec: str) -> str:
    return "nan" if v is None else format(v, spec)


def machine_line(compute_doc: dict | None, cpu: dict | None) -> str:
    """`model_gflops_s=A peak_gflops_s=B peak_share=C per_core_share=P cpu_s_server=S cpu_s_<role>=...
    cpu_s_client=F` (nan where nothing was measured; roles with spaces get underscores: cpu_s_engine_core)."""
    c = compute_doc or {}
    parts = [f"model_gflops_s={_f(c.get('model_gflops_s'), '.2f')}",
             f"peak_gflops_s={_f(c.get('peak_gflops_s'), '.1f')}",
             f"peak_share={_f(c.get('peak_share'), '.4f')}", f"per_core_share={_f(c.get('per_core_share'), '.4f')}"]
    cpu = cpu or {}
    by_role = dict(cpu.get("by_role") or {})
    parts.append(f"cpu_s_server={_f(cpu.get('server_cpu_s'), '.2f')}")
    for name in ("scheduler", "worker", *sorted(k for k in by_role if k not in ("scheduler", "worker", "client"))):
        if name in by_role or name in ("scheduler", "worker"):
            parts.append(f"cpu_s_{name.replace(' ', '_')}={_f(by_role.get(name), '.2f')}")
    parts.append(f"cpu_s_client={_f(by_role.get('client'), '.2f')}")
    return " ".join(parts)


def render(compute_doc: dict | None, cpu: dict | None) -> list[str]:
    """The summary's section: the FLOP figures, then one row per process."""
    lines: list[str] = []
    if compute_doc is not None:
        c, g = compute_doc, compute_doc["gflop"]
        share = "n/a" if c["peak_share"] is None else f"{c['peak_share']:.1%}"
        peak = f"no peak for {c['dtype'] or 'an unknown dtype'}" if c["peak_gflops_s"] is None else \
            f"{c['peak_gflops_s']:.1f} GFLOP/s ({c['dtype']}, {c['peak_threads']} threads)"
        lines += ["", "## Model FLOP/s", "", "| metric | value |", "| --- | --- |",
                  f"| tokens forwarded | {c['prefill_tokens']} prefill + {c['decode_tokens']} decode, lm_head on "
                  f"{c['sampled_rows']} sampled rows |",
                  f"| model GFLOP | {g['total']:.1f} ({g['linear']:.1f} linear, {g['attention']:.1f} attention, "
                  f"{g['lm_head']:.1f} lm_head) |",
                  f"| achieved | {c['model_gflops_s']:.2f} GFLOP/s |",
                  f"| GEMM peak | {peak} |", f"| share of the peak | {share} |"]
        if c.get("gflop_per_worker_cpu_s") is not None:
            core = "" if c["per_core_share"] is None else \
                f", {c['per_core_share']:.1%} of the one-thread peak {c['peak_1t_gflops_s']:.1f}"
            lines.append(f"| per worker CPU-second | {c['gflop_per_worker_cpu_s']:.2f} GFLOP ({c['worker_cpu_s']:.2f} "
                         f"CPU s{core}) |")
        lines.append(f"| dtype from | {c['dtype_source']} |")
    if cpu is not None:
        lines += ["", "## CPU seconds per process (/proc, utime + stime, every thread)", ""]
        if not cpu["local"]:
            lines.append("server: not local (only the client is measured)")
        lines += [f"over {cpu['wall_s']:.2f} s", "", "| process | pid | CPU s | cores (mean) | cores (peak 1 s) |",
                  "| --- | ---: | ---: | ---: | ---: |"]
        for p in sorted(cpu["processes"], key=lambda p: (p["role"] == "client", -p["cpu_s"])):
            reaped = f" (+{p['reaped_children_cpu_s']:.2f} s of ended children)" if p["reaped_children_cpu_s"] else ""
            ended = " (ended during the run)" if p["ended"] else ""
            lines.append(f"| {p['role']}{ended} | {p['pid']} | {p['cpu_s']:.2f}{reaped} | {p['cores']:.2f} | "
                         f"{p['peak_cores']:.2f} |")
    return lines
