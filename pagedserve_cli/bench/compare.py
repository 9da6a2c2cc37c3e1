"""`pagedserve bench --compare`: one workload on several private servers that differ in one setting, side by side."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pagedserve_cli.bench.kv_sampler import sampling, summarize_usage
from pagedserve_cli.bench.spawn import SpawnConfig, Spawned, spawn


@dataclass(slots=True)
class Side:
    name: str
    extra: list[str]  # the `pagedserve up` flags that make this side what it is


@dataclass(slots=True)
class Comparison:
    workload: str  # the default workload: the one that shows the effect
    sides: list[Side]
    defaults: dict = field(default_factory=dict)  # bench flags (argparse dests) the comparison sets unless given


COMPARISONS = {
    # The paged side first: the ratios are paged / static (concurrency, throughput).
    "static-prealloc": Comparison("mixed", [
        Side("paged", []),
        Side("static-max-model-len", ["--kv-allocation", "static-max-model-len"]),
        Side("static-request", ["--kv-allocation", "static-request"])]),
    "no-prefix-cache": Comparison("shared-prefix", [
        Side("prefix-cache", []),
        Side("no-prefix-cache", ["--no-prefix-caching"])]),
    # The float32 side first: the ratios are int8 / float32. NOTE: a workload whose float32 pool is the
    # bottleneck, small enough for a 2-core CPU: 96 requests at once of 32-64 prompt + 192-256 output tokens (~18
    # blocks each at the end) in 128 MiB: 182 float32 blocks hold ~10 of them, 685 int8 blocks ~38, both under
    # --max-num-seqs 256, so both sides run memory-bound and the int8 one runs ~3.7x the sequences. Decode-heavy on
    # purpose: what a larger pool buys is a larger decode batch; the prefill work is the same on both sides (a
    # prefill-heavy 160-224 + 64-96 mix measured concurrency 3.48x but throughput 0.96x). EOS ignored: both sides
    # generate exactly the same tokens' count.
    "kv-int8": Comparison("mixed", [
        Side("float32", ["--kv-cache-dtype", "float32"]),
        Side("int8", ["--kv-cache-dtype", "int8"])],
        {"num_requests": 96, "prompt_len": (32, 64), "output_len": (192, 256), "ignore_eos": True,
         "kv_memory": "128MiB", "max_num_seqs": 256, "max_model_len": 512, "ppl_tokens": 4096}),
    # The invariant side first: the ratios are on / off, the cost of --batch-invariant on (its M-invariant matmuls
    # at prefill sizes, attention rows kept off AMX tiles). The workload is bench/vs_vllm.sh's headline: 64 requests
    # at once, prompts 32-256, outputs 16-128, EOS ignored (the same tokens' count on both sides).
    "batch-invariant": Comparison("mixed", [
        Side("on", ["--batch-invariant", "on"]),
        Side("off", ["--batch-invariant", "off"])],
        {"num_requests": 64, "prompt_len": (32, 256), "output_len": (16, 128), "ignore_eos": True}),
}


def apply_defaults(args: argparse.Namespace, kv_memory: str, max_model_len: int) -> None:
    """The comparison's own defaults for the flags not given, then every comparison's KV budget and max_model_len."""
    comparison = COMPARISONS[args.compare]
    if args.ppl_tokens is not None and "ppl_tokens" not in comparison.defaults:
        raise ValueError(f"--ppl-tokens: only --compare kv-int8 measures perplexity, not {args.compare}")
    for name, value in comparison.defaults.items():
        if getattr(args, name) in (None, False):
            setattr(args, name, value)
    if args.ppl_tokens is not None and args.ppl_tokens < 2:
        raise ValueError(f"--ppl-tokens must be at least 2, got {args.ppl_tokens}")
    args.kv_memory = args.kv_memory or kv_memory
    args.max_model_len = args.max_model_len or max_model_len


@dataclass(slots=True)
class SideResult:
    side: Side
    summary: dict
    usage: dict
    records: list = field(default_factory=list)
    metrics: list = field(default_factory=list)
    states: list = field(default_factory=list)  # (t, pagedserve.v1.KVState) every 0.25 s
    workers: list = field(default_factory=list)  # GetModelInfo's workers: {worker_id, num_blocks, block_size, dtype}

    @property
    def num_blocks(self) -> int | None:
        """The KV blocks the side's workers registered (their pools at --kv-memory)."""
        return sum(w["num_blocks"] for w in self.workers) if self.workers else None

    @property
    def num_prefill_tokens(self) -> int | None:
        return self.states[-1][1].num_prefill_tokens if self.states else None


async def run_side(side: Side, server: Spawned, requests: list, args: argparse.Namespace) -> SideResult:
    """Runs the workload against one private server while sampling its KV pool."""
    from pagedserve_cli.bench import report
    from pagedserve_cli.bench.clients import GrpcClient
    from pagedserve_cli.bench.runner import run_workload

    client = GrpcClient(server.address, args.temperature, args.ignore_eos)
    info = await client.start(timeout=60.0)
    try:
        async with sampling(server.address, args.kv_sample_period) as sampler:
            result = await run_workload(client, requests, args.rate, args.max_concurrency, args.seed,
                                        f"http://{server.metrics}/metrics", progress=not args.no_progress)
    finally:
        await client.close()
    summary = report.summarize(result.records, result.metrics)
    return SideResult(side, summary, summarize_usage(sampler.usages()), result.records, result.metrics,
                      sampler.states, info.get("workers", []))


def spawn_config(args: argparse.Namespace, model: str) -> SpawnConfig:
    return SpawnConfig(model=model, dtype=args.dtype, kv_memory=args.kv_memory, max_model_len=args.max_model_len,
                       max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       threads=args.threads, speculative=getattr(args, "speculative", None),
                       num_speculative_tokens=getattr(args, "num_speculative_tokens", None))


def run_comparison(args: argparse.Namespace, requests: list, cfg: SpawnConfig) -> list[SideResult]:
    comparison = COMPARISONS[args.compare]
    results = []
    for side in comparison.sides:
        print(f"pagedserve bench: side {side.name}: starting `pagedserve up {' '.join(side.extra)}`",
              file=sys.stderr, flush=True)
        server = spawn(cfg, side.extra, side.name)
        try:
            results.append(asyncio.run(run_side(side, server, requests, args)))
        finally:
            server.stop()
    return results


def _f(value: float | None, fmt: str) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)


def _ratio(a: float | None, b: float | None) -> float:
    return a / b if a is not None and b else float("nan")


def static_prealloc_lines(results: list[SideResult]) -> tuple[list[str], str]:
    """The table and the last line: waste under each side, and paged's concurrency and throughput over static's."""
    by = {r.side.name: r for r in results}
    rows = ["| side | waste | reserved, no token | free, unusable | mean running | peak running | output tok/s | "
            "TTFT p50 | wall |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        u, s = r.usage, r.summary
        rows.append(f"| {r.side.name} | {_f(u['waste'], '.2%')} | {_f(u['internal'], '.2%')} | "
                    f"{_f(u['external'], '.2%')} | {_f(u['mean_running'], '.1f')} | {u['peak_running']} | "
                    f"{s['output_tok_s']:.1f} | {_f(s['ttft_s']['p50'], '.3f')} s | {s['wall_s']:.1f} s |")
    paged = by["paged"]
    lines = []
    for name, suffix in (("static-request", "_request"), ("static-max-model-len", "")):
        st = by[name]
        lines.append(f"waste_paged={_f(paged.usage['waste'], '.4f')} waste_static{suffix}={_f(st.usage['waste'], '.4f')} "
                     f"concurrency_ratio{suffix}={_ratio(paged.usage['mean_running'], st.usage['mean_running']):.2f} "
                     f"throughput_ratio{suffix}="
                     f"{_ratio(paged.summary['output_tok_s'], st.summary['output_tok_s']):.2f}")
    return rows + [""] + lines[:-1], lines[-1]


def no_prefix_cache_lines(results: list[SideResult]) -> tuple[list[str], str]:
    """The table and the last line: prefill tokens computed with the cache over without; TTFT p50 without over with."""
    rows = ["| side | prefill tokens computed | prompt tokens | prefix hit rate | TTFT p50 | TTFT p90 | output tok/s | "
            "wall |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        s, m = r.summary, r.summary.get("server") or {}
        rows.append(f"| {r.side.name} | {_f(r.num_prefill_tokens, ',')} | {s['prompt_tokens']:,} | "
                    f"{_f(m.get('prefix_hit_rate'), '.1%')} | {_f(s['ttft_s']['p50'], '.3f')} s | "
                    f"{_f(s['ttft_s']['p90'], '.3f')} s | {s['output_tok_s']:.1f} | {s['wall_s']:.1f} s |")
    on, off = results
    last = (f"prefill_tokens_ratio={_ratio(on.num_prefill_tokens, off.num_prefill_tokens):.4f} "
            f"ttft_ratio={_ratio(off.summary['ttft_s']['p50'], on.summary['ttft_s']['p50']):.2f}")
    return rows, last


def batch_invariant_lines(results: list[SideResult]) -> tuple[list[str], str]:
    """The table and the last line: output tokens/s and TTFT with batch invariance on over off."""
    rows = ["| side | output tok/s | TTFT p50 | ITL p50 | wall |", "| --- | --- | --- | --- | --- |"]
    for r in results:
        s = r.summary
        rows.append(f"| {r.side.name} | {s['output_tok_s']:.1f} | {_f(s['ttft_s']['p50'], '.3f')} s | "
                    f"{_f(s['itl_s']['p50'], '.4f')} s | {s['wall_s']:.1f} s |")
    on, off = results
    last = (f"throughput_ratio_invariant={_ratio(on.summary['output_tok_s'], off.summary['output_tok_s']):.3f} "
            f"ttft_ratio_invariant={_ratio(on.summary['ttft_s']['p50'], off.summary['ttft_s']['p50']):.3f}")
    return rows, last


def write_outputs(out: Path, args: argparse.Namespace, config: dict, results: list[SideResult],
                  table: list[str], last: str, extra: dict | None = None) -> list[str]:
    """Each side's usual bench files in out/SIDE/, then compare.md, compare.json and the pictures; returns the
    names written at the top level."""
    from pagedserve_cli.bench import kv_frames, report

    for r in results:
        side_out = out / r.side.name
        report.write_results(side_out, {**config, "side": r.side.name, "side_flags": r.side.extra}, r.summary,
                             r.records, r.metrics)
        report.write_plots(side_out, r.records, f"{args.compare}: {r.side.name}")
    doc = {"config": config, "sides": [{"name": r.side.name, "flags": r.side.extra, "usage": r.usage,
                                        "prefill_tokens": r.num_prefill_tokens, "workers": r.workers,
                                        "num_blocks": r.num_blocks, "summary": r.summary}
                                       for r in results], **(extra or {}), "last_line": last}
    (out / "compare.json").write_text(json.dumps(doc, indent=1) + "\n", encoding="utf-8")
    head = [f"# pagedserve bench --compare {args.compare}", "",
            f"workload `{config['workload']}`, {config['num_requests']} requests, seed {args.seed}, model "
            f"{config['spawn']['model']} ({args.dtype}), KV memory {args.kv_memory or 'auto'}, max_model_len "
            f"{args.max_model_len or 'model'}", ""]
    (out / "compare.md").write_text("\n".join(head + table + ["", last]) + "\n", encoding="utf-8")
    names = ["compare.md", "compare.json"]
    names += kv_frames.write_pictures(out, args.compare, [(r.side.name, r.states) for r in results])
    return names


def run(args: argparse.Namespace) -> int:
    from pagedserve_cli.bench.workloads import build_requests, dump_jsonl
    from pagedserve_cli.serve_cmd import model_dir
    from pagedserve_common.defaults import DEFAULT_MODEL

    if args.server or args.openai_url:
        raise ValueError("--compare starts its own servers: leave out --server and --openai-url")
    comparison = COMPARISONS[args.compare]
    args.workload = args.workload or comparison.workload
    model = model_dir(args.model or DEFAULT_MODEL)
    args.tokenizer = args.tokenizer or model
    started = time.strftime("%Y%m%d-%H%M%S")
    cfg = spawn_config(args, model)
    requests, resolved = build_requests(args, cfg.max_model_len)
    results = run_comparison(args, requests, cfg)
    out = Path(args.out or Path("bench") / "out" / f"compare-{args.compare}-{started}")
    out.mkdir(parents=True, exist_ok=True)
    dump_jsonl(requests, out / "workload.jsonl")
    config = {k: v for k, v in vars(args).items() if k != "func"} | resolved | \
        {"started": started, "num_requests": len(requests), "spawn": {"model": model, "dtype": cfg.dtype,
                                                                      "kv_memory": cfg.kv_memory}}
    extra = None
    if args.compare == "kv-int8":
        from pagedserve_cli.bench import kv_int8

        table, last, extra = kv_int8.report(args, model, results)
    else:
        lines = {"static-prealloc": static_prealloc_lines, "no-prefix-cache": no_prefix_cache_lines,
                 "batch-invariant": batch_invariant_lines}[args.compare]
        table, last = lines(results)
    names = write_outputs(out, args, config, results, table, last, extra)
    print("\n".join(table))
    print(f"wrote {out}/: {', '.join(names)}, workload.jsonl, and each side's bench files in "
          f"{', '.join(r.side.name + '/' for r in results)}")
    print(last, flush=True)
    failed = [r.side.name for r in results if r.summary["completed"] == 0]
    if failed:
        print(f"pagedserve bench: every request failed on {', '.join(failed)}", file=sys.stderr)
        return 1
    return 0
