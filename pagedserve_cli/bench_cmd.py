"""`pagedserve bench`: streams a seeded workload at a server (ours over gRPC, or OpenAI-compatible) and reports."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from pathlib import Path

from pagedserve_cli.bench.workloads import WORKLOADS, parse_range

DEFAULT_SERVER = "127.0.0.1:50051"
FALLBACK_MAX_MODEL_LEN = 2048


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("bench", help="load-test a server (ours over gRPC, or any OpenAI-compatible one)")
    p.add_argument("--server", help=f"our gRPC client API, HOST:PORT (default {DEFAULT_SERVER})")
    p.add_argument("--openai-url", help="an OpenAI-compatible server instead, e.g. http://127.0.0.1:8100/v1")
    p.add_argument("--model", help="with --openai-url: the served model name (default: the first it lists)")
    p.add_argument("--workload", default="mixed", help=f"{' | '.join(WORKLOADS)} | FILE.jsonl (default mixed)")
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
    p.add_argument("--tokenizer", help="model dir whose tokenizer cuts the prompts (default: the default model)")
    p.add_argument("--metrics-url", help="Prometheus text to poll every 0.5 s (default with --server: "
                                         "http://SERVER_HOST:9464/metrics; '' = off)")
    p.add_argument("--out", help="output dir (default bench/out/YYYYmmdd-HHMMSS)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    p.set_defaults(func=run)


def _tokenizer_dir(args: argparse.Namespace) -> str:
    if args.tokenizer:
        return args.tokenizer
    from pagedserve_cli.serve_cmd import DEFAULT_MODEL, model_dir

    return model_dir(DEFAULT_MODEL)


def _config_max_len(model_dir: str) -> int | None:
    try:
        cfg = json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return cfg.get("max_position_embeddings")


def build_requests(args: argparse.Namespace, server_max_len: int | None) -> tuple[list, dict]:
    """The workload's requests, and what was resolved to build them (tokenizer dir, max_model_len)."""
    from pagedserve_cli.bench.workloads import build_workload, load_jsonl

    if args.workload not in WORKLOADS:
        if not Path(args.workload).is_file():
            raise ValueError(f"--workload {args.workload!r}: not one of {', '.join(WORKLOADS)} nor a file")
        return load_jsonl(args.workload, args.num_requests), {}
    from scheduler_svc.frontend.tokenizer import Tokenizer

    tok_dir = _tokenizer_dir(args)
    # The shorter of the model's and the server's limits, so that both peers of a comparison get the same bytes.
    lens = [n for n in (_config_max_len(tok_dir), server_max_len) if n]
    max_len = min(lens) if lens else FALLBACK_MAX_MODEL_LEN
    reqs = build_workload(args.workload, Tokenizer.from_model_dir(tok_dir), args.num_requests or 64, args.seed,
                          args.prompt_len, args.output_len, args.num_tenants, max_len)
    return reqs, {"tokenizer": tok_dir, "max_model_len": max_len}


def _client(args: argparse.Namespace):
    from pagedserve_cli.bench.clients import GrpcClient, OpenAIClient

    if args.openai_url:
        return OpenAIClient(args.openai_url, args.model, args.temperature, args.ignore_eos)
    return GrpcClient(args.server, args.temperature, args.ignore_eos)


async def _bench(args: argparse.Namespace):
    """Connects, builds the workload, runs it; None when the server can't be reached."""
    from pagedserve_cli.bench.runner import run_workload

    client = _client(args)
    try:
        info = await client.start()
    except ConnectionError as e:
        print(f"pagedserve bench: cannot reach the server: {e}", file=sys.stderr)
        return None
    try:
        requests, resolved = build_requests(args, info.get("max_model_len"))
        result = await run_workload(client, requests, args.rate, args.max_concurrency, args.seed,
                                    args.metrics_url, progress=not args.no_progress)
    finally:
        await client.close()
    return requests, result, {**resolved, "served_model": info.get("model")}


def run(args: argparse.Namespace) -> int:
    from pagedserve_cli.bench import report
    from pagedserve_cli.bench.workloads import dump_jsonl

    if args.server and args.openai_url:
        raise ValueError("give --server or --openai-url, not both")
    if not args.openai_url:
        args.server = args.server or DEFAULT_SERVER
        if args.metrics_url is None:
            args.metrics_url = f"http://{args.server.rsplit(':', 1)[0]}:9464/metrics"
    started = time.strftime("%Y%m%d-%H%M%S")
    done = asyncio.run(_bench(args))
    if done is None:
        return 1
    requests, result, resolved = done
    config = {k: v for k, v in vars(args).items() if k != "func"} | resolved | {"started": started}
    out = Path(args.out or Path("bench") / "out" / started)
    summary = report.summarize(result.records, result.metrics)
    report.write_results(out, config, summary, result.records, result.metrics)
    dump_jsonl(requests, out / "workload.jsonl")
    report.write_plots(out, result.records, args.openai_url or args.server)
    print(report.render_summary(summary, config))
    print(f"wrote {out}/: results.json, summary.md, workload.jsonl, throughput.png, ttft.png, itl.png")
    print(report.last_line(summary), flush=True)
    if summary["completed"] == 0:
        print("pagedserve bench: every request failed", file=sys.stderr)
        return 1
    return 0
