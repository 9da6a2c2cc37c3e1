"""`pagedserve bench`: streams a seeded workload at a server (ours over gRPC, or OpenAI-compatible) and reports."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import sys
import time
from pathlib import Path

from pagedserve_cli.bench.workloads import WORKLOADS, build_requests, parse_range
from pagedserve_common.config import DTYPES, SPECULATIVE
from pagedserve_common.defaults import (DEFAULT_LISTEN, DEFAULT_MODEL, MAX_TENANT_CHARS, METRICS_PORT, TENANT_HEADER,
                                         metrics_url)
COMPARISON_NAMES = ("static-prealloc", "no-prefix-cache", "kv-int8", "batch-invariant")
# NOTE: a comparison needs a pool that memory, not --max-num-seqs, fills: 512 MiB holds 11,650 tokens of the
# default model in float32 (46,080 bytes each), 5 sequences of 2,048 slots, or about 45 of the mixed workload's.
COMPARE_KV_MEMORY = "512MiB"
COMPARE_MAX_MODEL_LEN = 2048
COMPARE_DTYPE = "float32"  # NOTE: `auto` depends on the CPU (bfloat16 with AVX512-BF16 or AMX): block counts too


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="load-test a server (ours over gRPC, or any OpenAI-compatible one)")
    _add_load_args(p)
    _add_report_args(p)
    _add_private_server_args(p)
    p.set_defaults(func=run)


def _add_load_args(p: argparse.ArgumentParser) -> None:
    """The server to bench and the load sent to it."""
    p.add_argument("--server", help=f"our gRPC client API, HOST:PORT (default {DEFAULT_LISTEN})")
    p.add_argument("--openai-url", help="an OpenAI-compatible server instead, e.g. http://127.0.0.1:8100/v1")
    p.add_argument("--model", help="with --openai-url: the served model name (default: the first it lists); with "
                                   "--spawn or --compare: the model to serve (default: the default model)")
    p.add_argument("--workload", help=f"{' | '.join(WORKLOADS)} | FILE.jsonl (default mixed; with --compare: the "
                                      "comparison's own, mixed or shared-prefix)")
    p.add_argument("--num-requests", type=int, help="default 64 (a .jsonl workload: all its lines)")
    p.add_argument("--rate", type=float, help="Poisson arrivals, requests/s (default: all at once)")
    p.add_argument("--max-concurrency", type=int, help="at most N requests in flight")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--prompt-len", type=parse_range, metavar="MIN:MAX",
                   help="uniform prompt lengths (shared-prefix, multi-tenant: the user turn; default 32:96)")
    p.add_argument("--output-len", type=parse_range, metavar="MIN:MAX", help="uniform output lengths")
    p.add_argument("--num-tenants", type=int, default=4, help="multi-tenant: distinct system prompts")
    p.add_argument("--ignore-eos", action="store_true", help="generate exactly max_tokens every time")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--tenant", default="", metavar="NAME",
                   help=f"send every request as this tenant's ({TENANT_HEADER}: its service under the server's "
                        "--scheduling-policy fair); two benches at once with two tenants measure fair share")
    p.add_argument("--priority", type=int, default=0,
                   help="every request's priority (a server with --scheduling-policy priority; lower runs first)")
    p.add_argument("--tokenizer", help="model dir whose tokenizer cuts the prompts (default: the default model)")


def _add_report_args(p: argparse.ArgumentParser) -> None:
    """What is measured beside the requests, and where the report goes."""
    p.add_argument("--metrics-url", help=f"Prometheus text to poll every 0.5 s (default with --server: "
                                         f"http://SERVER_HOST:{METRICS_PORT}/metrics; '' = off)")
    p.add_argument("--gemm-peak", metavar="FILE",
                   help="bench/gemm_peak.py's JSON: the run's model FLOP/s is reported as a share of its peak for "
                        "the server's dtype (default: the cached $PAGEDSERVE_CACHE/gemm_peak-<cpu key>.json if "
                        "present; '' = no share)")
    p.add_argument("--peak-dtype", choices=("float32", "bfloat16"),
                   help="the dtype the server computes in, for the peak (default: what our workers register, or "
                        "the server's vllm:cache_config_info, or --spawn's --dtype; give it for a vLLM peer)")
    p.add_argument("--out", help="output dir (default bench/out/YYYYmmdd-HHMMSS)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.add_argument("--kv-sample-period", type=float, default=0.25, metavar="SECONDS",
                   help="with our server: how often the worker's KV pool is sampled (GetKVState) for the block "
                        "maps and the waste figures (default 0.25)")


def _add_private_server_args(p: argparse.ArgumentParser) -> None:
    s = p.add_argument_group("private servers", "--spawn starts its own `pagedserve up` (scheduler + one worker on "
                                                "free loopback ports) and stops it after the run; --compare starts "
                                                "one per side, one after another")
    s.add_argument("--compare", choices=COMPARISON_NAMES,
                   help="static-prealloc: paging vs contiguous preallocation of max_model_len (and of prompt + "
                        "max_tokens) slots per sequence, same KV budget; no-prefix-cache: prefix caching on vs off; "
                        "kv-int8: a float32 KV cache vs an int8 one in the same --kv-memory (defaults: 128MiB, 96 "
                        "requests at once, prompts 32:64, outputs 192:256 with EOS ignored, --max-num-seqs 256, "
                        "--max-model-len 512, so that the float32 pool, not max-num-seqs, bounds the batch: ~10 "
                        "sequences fit in float32, ~38 in int8), then both caches' perplexity (--ppl-tokens); "
                        "batch-invariant: --batch-invariant on vs off (defaults: bench/vs_vllm.sh's 64 requests at "
                        "once, prompts 32:256, outputs 16:128, EOS ignored)")
    s.add_argument("--ppl-tokens", type=int, metavar="N",
                   help="with --compare kv-int8: the tokens of the corpus (Newton's Opticks) whose teacher-forced "
                        "perplexity is measured with each cache, after the servers stop (default 4096)")
    s.add_argument("--spawn", action="store_true", help="bench a private server instead of --server")
    s.add_argument("--dtype", choices=DTYPES,
                   help="the worker's dtype (default: with --spawn auto, what `pagedserve up` picks; with --compare "
                        f"{COMPARE_DTYPE}, so that a comparison's figures are the same on every CPU)")
    s.add_argument("--kv-memory", help=f"the worker's KV pool, e.g. 512MiB (default: auto; with --compare "
                                       f"{COMPARE_KV_MEMORY}, kv-int8 128MiB, so that memory, not max-num-seqs, bounds the batch)")
    s.add_argument("--max-model-len", type=int,
                   help=f"the scheduler's max_model_len (default: the model's; with --compare {COMPARE_MAX_MODEL_LEN}, "
                        "kv-int8: 512)")
    s.add_argument("--max-num-seqs", type=int, help="the scheduler's --max-num-seqs (default: its own; with --compare kv-int8 256)")
    s.add_argument("--max-num-batched-tokens", type=int, help="the scheduler's token budget per step")
    s.add_argument("--threads", type=int, help="the worker's compute threads")
    s.add_argument("--speculative", choices=SPECULATIVE, help="the scheduler's --speculative (default: its own)")
    s.add_argument("--num-speculative-tokens", type=int, metavar="K", help="the scheduler's --num-speculative-tokens")


def _client(args: argparse.Namespace):
    from pagedserve_cli.bench.clients import GrpcClient, OpenAIClient

    if args.openai_url:
        return OpenAIClient(args.openai_url, args.model, args.temperature, args.ignore_eos, args.tenant,
                            args.priority)
    return GrpcClient(args.server, args.temperature, args.ignore_eos, args.tenant, args.priority)


async def _bench(args: argparse.Namespace):
    """Connects, builds the workload, runs it; None when the server can't be reached."""
    from pagedserve_cli.bench.kv_sampler import sampling
    from pagedserve_cli.bench.runner import run_workload

    client = _client(args)
    try:
        info = await client.start()
    except ConnectionError as e:
        print(f"pagedserve bench: cannot reach the server: {e}", file=sys.stderr)
        return None
    try:
        requests, resolved = build_requests(args, info.get("max_model_len"))
        metrics_dtype = await _metrics_cache_dtype(args.metrics_url)
        watch = _cpu_watch(args)
        async with sampling(None if args.openai_url else args.server, args.kv_sample_period) as sampler, \
                _sampling_cpu(watch):
            result = await run_workload(client, requests, args.rate, args.max_concurrency, args.seed,
                                        args.metrics_url, progress=not args.no_progress)
    finally:
        await client.close()
    states = sampler.states if sampler is not None else []
    worker_dtypes = [w["dtype"] for w in info.get("workers", [])]
    resolved = {**resolved, "served_model": info.get("model"), "worker_dtypes": worker_dtypes,
                "metrics_cache_dtype": metrics_dtype, "tenant": args.tenant, "priority": args.priority}
    return requests, result, resolved, states, watch.stop()


def _cpu_watch(args: argparse.Namespace):
    """A CpuWatch of the server's processes when it listens on this machine (else of the client alone)."""
    from urllib.parse import urlsplit

    from pagedserve_cli.bench.proc_cpu import CpuWatch, is_local

    if args.openai_url:
        u = urlsplit(args.openai_url)
        host, port = u.hostname or "127.0.0.1", u.port or (443 if u.scheme == "https" else 80)
    else:
        host, _, port_text = args.server.rpartition(":")
        host, port = host.strip("[]") or "127.0.0.1", int(port_text)
    return CpuWatch(port if is_local(host, port) else None)


@contextlib.asynccontextmanager
async def _sampling_cpu(watch, period_s: float = 1.0):
    """watch started now, sampled every period_s (its peak cores) until the block ends; stop() is the caller's."""
    watch.start()
    stop = asyncio.Event()

    async def loop() -> None:
        while not stop.is_set():
            try:
                await asyncio.wait_for(stop.wait(), period_s)
            except asyncio.TimeoutError:
                watch.sample()

    task = asyncio.create_task(loop())
    try:
        yield watch
    finally:
        stop.set()
        await task


async def _metrics_cache_dtype(url: str | None) -> str | None:
    """The cache_dtype label of the server's vllm:cache_config_info (one series), or None."""
    if not url:
        return None
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        async with httpx.AsyncClient(timeout=30.0) as http:
            resp = await http.get(url)
            resp.raise_for_status()
        kinds = {s.labels.get("cache_dtype") for f in text_string_to_metric_families(resp.text)
                 if f.name == "vllm:cache_config_info" for s in f.samples}
    except (httpx.HTTPError, ValueError):
        return None
    return kinds.pop() if len(kinds) == 1 else None


def run(args: argparse.Namespace) -> int:
    if len(args.tenant) > MAX_TENANT_CHARS or not all(" " <= c <= "~" for c in args.tenant):
        raise ValueError(f"--tenant: at most {MAX_TENANT_CHARS} visible ASCII characters (spaces included), as the "
                         f"server reads {TENANT_HEADER}")
    if args.compare:
        from pagedserve_cli.bench.compare import apply_defaults, run as run_compare

        args.dtype = args.dtype or COMPARE_DTYPE
        apply_defaults(args, COMPARE_KV_MEMORY, COMPARE_MAX_MODEL_LEN)
        return run_compare(args)
    if args.ppl_tokens is not None:
        raise ValueError("--ppl-tokens: only --compare kv-int8 measures perplexity")
    args.workload = args.workload or "mixed"
    if not args.spawn:
        return bench(args)
    if args.server or args.openai_url:
        raise ValueError("--spawn starts its own server: leave out --server and --openai-url")
    from pagedserve_cli.bench.compare import spawn_config
    from pagedserve_cli.bench.spawn import spawn
    from pagedserve_cli.serve_cmd import model_dir

    model = model_dir(args.model or DEFAULT_MODEL)
    args.tokenizer = args.tokenizer or model
    args.dtype = args.dtype or "auto"
    server = spawn(spawn_config(args, model), [], "server")
    try:
        args.server = server.address
        args.metrics_url = f"http://{server.metrics}/metrics" if args.metrics_url is None else args.metrics_url
        return bench(args)
    finally:
        server.stop()


def bench(args: argparse.Namespace) -> int:
    """One run against --server or --openai-url."""
    from pagedserve_cli.bench import efficiency, kv_frames, report
    from pagedserve_cli.bench.workloads import dump_jsonl

    if args.server and args.openai_url:
        raise ValueError("give --server or --openai-url, not both")
    if not args.openai_url:
        args.server = args.server or DEFAULT_LISTEN
        if args.metrics_url is None:
            args.metrics_url = metrics_url(args.server)
    started = time.strftime("%Y%m%d-%H%M%S")
    done = asyncio.run(_bench(args))
    if done is None:
        return 1
    requests, result, resolved, states, cpu = done
    config = {k: v for k, v in vars(args).items() if k != "func"} | resolved | {"started": started}
    out = Path(args.out or Path("bench") / "out" / started)
    summary = report.summarize(result.records, result.metrics)
    summary["compute"], summary["cpu"] = _compute(args, resolved, result.records, summary, cpu), cpu
    report.write_results(out, config, summary, result.records, result.metrics)
    dump_jsonl(requests, out / "workload.jsonl")
    report.write_plots(out, result.records, args.openai_url or args.server)
    # NOTE: the block maps only when the server answered GetKVState (ours; not an OpenAI-compatible peer)
    pictures = kv_frames.write_pictures(out, args.server or "", [("pagedserve", states)])
    print(report.render_summary(summary, config))
    print(f"wrote {out}/: results.json, summary.md, workload.jsonl, throughput.png, ttft.png, itl.png"
          + "".join(f", {name}" for name in pictures))
    print(efficiency.machine_line(summary["compute"], summary["cpu"]))
    print(report.last_line(summary), flush=True)
    if summary["completed"] == 0:
        print("pagedserve bench: every request failed", file=sys.stderr)
        return 1
    return 0


def _compute(args: argparse.Namespace, resolved: dict, records: list, summary: dict, cpu: dict) -> dict | None:
    """The run's model FLOP/s and its share of the GEMM peak (pagedserve_cli.bench.efficiency); None when the
    model's config.json can't be read."""
    from pagedserve_cli.bench import efficiency, peak

    peak_file = args.gemm_peak
    if peak_file is None:
        cached = peak.default_path()
        peak_file = str(cached) if cached.is_file() else ""
    # NOTE: a peak file asked for by name must be readable: only the default one may be missing
    peak_doc = peak.load(peak_file) if peak_file else None
    dtype, source = efficiency.served_dtype(args.peak_dtype, resolved.get("worker_dtypes") or [],
                                            resolved.get("metrics_cache_dtype"),
                                            args.dtype if args.spawn else None)
    # NOTE: a .jsonl workload resolves no tokenizer: then only the served model's dir or --tokenizer says
    model_dir = efficiency.flops_model_dir(resolved.get("served_model"), resolved.get("tokenizer") or args.tokenizer)
    if model_dir is None:
        print("pagedserve bench: no model FLOP/s: the server names no model directory (give --tokenizer DIR)",
              file=sys.stderr)
        return None
    try:
        return efficiency.compute(records, summary["server"], model_dir, summary["wall_s"], peak_doc,
                                  peak_file or None, dtype, source, (cpu or {}).get("by_role", {}).get("worker"))
    except (OSError, KeyError, ValueError) as e:
        print(f"pagedserve bench: no model FLOP/s ({model_dir}/config.json: {type(e).__name__}: {e})",
              file=sys.stderr)
        return None
