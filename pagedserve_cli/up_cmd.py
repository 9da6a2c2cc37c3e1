"""`pagedserve up`: one scheduler and N workers as child processes, on the default addresses."""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from pagedserve_cli.serve_cmd import DEFAULT_MODEL, model_dir


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("up", help="start a scheduler and N workers; Ctrl-C stops them all")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-memory", default=None, help="KV pool bytes per worker, e.g. 1GiB")
    p.add_argument("--device", default=None, help="cpu or cuda (default: cuda when a GPU is visible)")
    p.add_argument("--listen", default="127.0.0.1:50051")
    p.add_argument("--worker-listen", default="127.0.0.1:50052")
    p.add_argument("--metrics", default="127.0.0.1:9464")
    p.add_argument("--threads", type=int, default=None,
                   help="compute threads per CPU worker (default: its share of the cores, adapting to load)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step (default: the scheduler's)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="sequences per step (default: the scheduler's)")
    p.add_argument("--swap-space", default=None, help="host memory per worker for swapped-out KV blocks")
    p.add_argument("--startup-timeout", type=float, default=600.0)
    p.set_defaults(func=run)


def wait_healthy(address: str, timeout: float, procs: list[subprocess.Popen], stopping=lambda: False,
                 num_workers: int = 1) -> bool:
    """True once `address` is SERVING with `num_workers` attached; False if `stopping()` turns true first."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from pagedserve.v1 import generate_pb2, generate_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        health = health_pb2_grpc.HealthStub(channel)
        generation = generate_pb2_grpc.GenerationStub(channel)
        while time.monotonic() < deadline:
            if stopping():
                return False
            if any(p.poll() is not None for p in procs):
                raise RuntimeError("a service exited during start-up (see its log above)")
            try:
                # NOTE: SERVING means one worker is in; the others may still be loading their model.
                if health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1).status == \
                        health_pb2.HealthCheckResponse.SERVING and \
                        len(generation.GetModelInfo(generate_pb2.GetModelInfoRequest(), timeout=1).workers) \
                        >= num_workers:
                    return True
            except grpc.RpcError:
                pass
            time.sleep(0.2)
    raise TimeoutError(f"{address} not healthy with {num_workers} worker(s) after {timeout:.0f} s")


def _device(requested: str | None) -> str:
    if requested:
        return requested
    try:
        import torch
        return "cuda" if torch.cuda.is_available() else "cpu"
    except ImportError:
        return "cpu"


def core_shares(cores: list[int], num_workers: int) -> list[list[int]]:
    """Splits the cores `up` may use among its workers, disjoint while there are enough (no oversubscription);
    with more workers than cores, each worker gets one core, round robin."""
    if num_workers <= len(cores):
        return [cores[i * len(cores) // num_workers:(i + 1) * len(cores) // num_workers] for i in range(num_workers)]
    return [[cores[i % len(cores)]] for i in range(num_workers)]


def run(args: argparse.Namespace) -> int:
    model = model_dir(args.model) if args.model == DEFAULT_MODEL else args.model  # pull once, up front
    del model
    stopping = False

    def stop(*_):
        nonlocal stopping
        stopping = True

    # NOTE: handlers go in before the first child starts, so a signal never leaves orphans behind.
    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    exe = [sys.executable, "-m", "pagedserve_cli.main"]
    sched_cmd = [*exe, "scheduler", "--model", args.model, "--listen", args.listen,
                 "--worker-listen", args.worker_listen, "--metrics", args.metrics]
    if args.max_num_batched_tokens:
        sched_cmd += ["--max-num-batched-tokens", str(args.max_num_batched_tokens)]
    if args.max_num_seqs:
        sched_cmd += ["--max-num-seqs", str(args.max_num_seqs)]
    procs = [subprocess.Popen(sched_cmd)]
    device = _device(args.device)
    shares = core_shares(sorted(os.sched_getaffinity(0)), args.workers) if hasattr(os, "sched_getaffinity") \
        else [None] * args.workers
    for share in shares:
        cmd = [*exe, "worker", "--scheduler", args.worker_listen, "--model", args.model, "--device", device,
               "--dtype", args.dtype]
        if args.kv_memory:
            cmd += ["--kv-memory", args.kv_memory]
        if args.threads:
            cmd += ["--threads", str(args.threads)]
        if args.swap_space:
            cmd += ["--swap-space", args.swap_space]
        # NOTE: a CPU worker is pinned to its share, so its default thread count is that share's size.
        pin = share is not None and device == "cpu"
        procs.append(subprocess.Popen(cmd, preexec_fn=(lambda s=share: os.sched_setaffinity(0, s)) if pin else None))
    try:
        if not wait_healthy(args.listen, args.startup_timeout, procs, lambda: stopping, args.workers):
            return 0
        print(f"pagedserve is up: {args.listen} ({args.workers} worker(s) on {device}, metrics "
              f"http://{args.metrics}/metrics)", flush=True)
        while not stopping and all(p.poll() is None for p in procs):
            time.sleep(0.2)
    finally:
        for p in reversed(procs):  # workers first, then the scheduler drains
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in procs:
            try:
                p.wait(timeout=40)
            except subprocess.TimeoutExpired:
                p.kill()
    return 0 if stopping else 1
