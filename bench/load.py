"""Load: N concurrent streaming gRPC clients for a bounded time against a scheduler and a tiny-model worker.

    python bench/load.py [--clients 1000] [--duration 60] [--cancel-fraction 0.05] [--max-tokens 16]
    python bench/load.py --server HOST:PORT [--scheduler-pid PID] [--metrics HOST:PORT] ...

Without --server it starts `pagedserve scheduler` and one CPU worker on loopback over a tiny random Llama with
SmolLM2's tokenizer (or --model DIR), their logs in --out. Each client loops until --duration is over: send one
streamed request, read it to its end, repeat; a --cancel-fraction of the requests (seeded) cancel themselves after
a random number of messages. Prints the count of each status, the RPCs that failed other than by a deliberate
cancel, the scheduler's peak RSS (VmHWM, and VmRSS sampled every 0.5 s) and CPU time per token, whether it ends
idle (no request running or waiting, no KV block held) with no error logged, tokens/s and the p50/p99 inter-token
latency that the clients see (gaps between messages of one stream: client-side, so on a small box it includes
the clients' own event loop and the one-thread worker's step time), and last one line:

    load clients=1000 ok=... failed=0 cancelled_deliberately=... rss_mb=... itl_p50_ms=... itl_p99_ms=... tok_s=...
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import sys
import tempfile
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere without installing
from pagedserve.v1 import generate_pb2 as pb  # noqa: E402
from pagedserve.v1 import generate_pb2_grpc  # noqa: E402
from pagedserve_cli.bench.local_server import LocalServer, wait_idle  # noqa: E402
from pagedserve_cli.bench.report import percentiles  # noqa: E402

WORDS = ("the", "sea", "a", "ship", "sails", "north", "under", "grey", "skies", "and", "wind", "calls", "home")
DELIBERATE = "CANCELLED_DELIBERATELY"  # the status key of a request its client cancelled on purpose


def read_status_kb(pid: int, key: str) -> int | None:
    """A field of /proc/PID/status in kB (VmRSS, VmHWM), or None once the process is gone."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1])
    except (FileNotFoundError, ProcessLookupError):
        pass
    return None


def cpu_seconds(pid: int) -> float | None:
    """User + system CPU time of a live process (/proc/PID/stat), or None once it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def metric(metrics: str, name: str) -> float:
    """The sum of a Prometheus series over its labels, from http://METRICS/metrics."""
    text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=30).read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and line[len(name)] in " {")


@dataclass
class Stats:
    statuses: collections.Counter = field(default_factory=collections.Counter)
    failures: collections.Counter = field(default_factory=collections.Counter)  # "CODE: details" of failed RPCs
    gaps: list[float] = field(default_factory=list)  # seconds between consecutive messages of one stream
    tokens: int = 0
    scheduler_cpu_s: float = float("nan")  # CPU time the scheduler used during the run

    @property
    def failed(self) -> int:
        return sum(n for code, n in self.statuses.items() if code not in ("OK", DELIBERATE))


async def one_request(stub, rng: random.Random, args, stats: Stats) -> None:
    prompt = " ".join(rng.choice(WORDS) for _ in range(rng.randint(4, args.prompt_words)))
    cancel_after = rng.randint(1, max(1, args.max_tokens - 1)) if rng.random() < args.cancel_fraction else 0
    call = stub.Generate(pb.GenerateRequest(prompt=prompt, sampling=pb.SamplingParams(
        max_tokens=args.max_tokens, ignore_eos=True, seed=rng.getrandbits(32))), timeout=args.rpc_timeout)
    messages, last = 0, None
    try:
        async for msg in call:
            now = time.perf_counter()
            if last is not None:
                stats.gaps.append(now - last)
            last = now
            messages += 1
            stats.tokens += len(msg.token_ids)
            if messages == cancel_after:
                call.cancel()
                stats.statuses[DELIBERATE] += 1
                return
        stats.statuses["OK"] += 1
    except grpc.aio.AioRpcError as e:
        stats.statuses[e.code().name] += 1
        stats.failures[f"{e.code().name}: {e.details()}"] += 1


async def client(stub, seed: int, deadline: float, args, stats: Stats) -> None:
    rng = random.Random(seed)
    while time.monotonic() < deadline:
        await one_request(stub, rng, args, stats)


async def sample_rss(pid: int | None, peak: list[int], stop: asyncio.Event) -> None:
    while pid is not None and not stop.is_set():
        rss = read_status_kb(pid, "VmRSS")
        if rss is not None:
            peak[0] = max(peak[0], rss)
        try:
            await asyncio.wait_for(stop.wait(), 0.5)
        except TimeoutError:
            pass


async def drive(address: str, pid: int | None, args) -> tuple[Stats, float, int, int]:
    """Runs the clients; returns the stats, the wall time, the scheduler's RSS at the start and its sampled peak."""
    stats, peak, stop = Stats(), [0], asyncio.Event()
    # NOTE: a local subchannel pool per channel: separate connections, as separate clients would open
    channels = [grpc.aio.insecure_channel(address, options=(("grpc.use_local_subchannel_pool", 1),))
                for _ in range(args.channels)]
    stubs = [generate_pb2_grpc.GenerationStub(c) for c in channels]
    rss_start = (read_status_kb(pid, "VmRSS") or 0) if pid else 0
    cpu_start = (cpu_seconds(pid) or 0.0) if pid else 0.0
    sampler = asyncio.create_task(sample_rss(pid, peak, stop))
    start = time.monotonic()
    deadline = start + args.duration
    await asyncio.gather(*(client(stubs[i % len(stubs)], args.seed * 1_000_003 + i, deadline, args, stats)
                           for i in range(args.clients)))
    wall = time.monotonic() - start
    stats.scheduler_cpu_s = (cpu_seconds(pid) or cpu_start) - cpu_start if pid else float("nan")
    stop.set()
    await sampler
    for c in channels:
        await c.close()
    return stats, wall, rss_start, peak[0]


def report(args, stats: Stats, wall: float, rss_start_kb: int, rss_peak_kb: int, hwm_kb: int | None) -> str:
    print(f"statuses {json.dumps(dict(sorted(stats.statuses.items())))}")
    for failure, n in stats.failures.most_common(10):
        print(f"failed x{n}: {failure}")
    rss_mb = (hwm_kb or rss_peak_kb) / 1024
    tok_s = stats.tokens / wall if wall else 0.0
    print(f"scheduler rss_start_mb={rss_start_kb / 1024:.1f} rss_peak_sampled_mb={rss_peak_kb / 1024:.1f} "
          f"vm_hwm_mb={(hwm_kb or 0) / 1024:.1f} cpu_s={stats.scheduler_cpu_s:.1f} "
          f"cpu_ms_per_token={1e3 * stats.scheduler_cpu_s / max(1, stats.tokens):.2f}")
    print(f"wall_s={wall:.1f} tokens={stats.tokens} itl_samples={len(stats.gaps)}")
    ok = stats.statuses["OK"]
    itl = {k: float("nan") if v is None else v for k, v in percentiles(stats.gaps).items()}
    return (f"load clients={args.clients} ok={ok} failed={stats.failed} "
            f"cancelled_deliberately={stats.statuses[DELIBERATE]} rss_mb={rss_mb:.1f} "
            f"itl_p50_ms={itl['p50'] * 1e3:.1f} itl_p99_ms={itl['p99'] * 1e3:.1f} "
            f"tok_s={tok_s:.1f}")


def parse_args(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--server", help="HOST:PORT of a running scheduler (default: start one here)")
    ap.add_argument("--scheduler-pid", type=int, help="with --server: the scheduler's pid, for its RSS")
    ap.add_argument("--metrics", help="with --server: its metrics HOST:PORT, to check it ends idle")
    ap.add_argument("--model", help="model directory for the local server (default: a tiny random Llama)")
    ap.add_argument("--clients", type=int, default=1000)
    ap.add_argument("--duration", type=float, default=60.0, help="seconds during which clients send requests")
    ap.add_argument("--cancel-fraction", type=float, default=0.05, help="requests cancelled mid-stream on purpose")
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--prompt-words", type=int, default=24, help="prompts have 4 to this many words")
    ap.add_argument("--channels", type=int, default=8, help="client connections the clients share")
    ap.add_argument("--rpc-timeout", type=float, default=300.0, help="deadline of each request, seconds")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kv-memory", default="8MiB", help="the local worker's KV pool (8 MiB: 1024 tiny blocks)")
    ap.add_argument("--max-num-seqs", type=int, default=256)
    ap.add_argument("--max-num-batched-tokens", type=int, default=1024)
    ap.add_argument("--scheduler-args", default="", help="more `pagedserve scheduler` arguments for the local server "
                                                         "(e.g. '--max-connections-per-peer 0')")
    ap.add_argument("--out", default=None, help="folder for the local server's logs (default: a temporary one)")
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    server = None
    if args.server:
        address, pid, metrics = args.server, args.scheduler_pid, args.metrics
    else:
        out = Path(args.out or tempfile.mkdtemp(prefix="pagedserve-load-"))
        if args.model:
            model = args.model
        else:
            from pagedserve_cli.bench.tiny_model import save_tiny_served_model  # the tests' tiny model

            model = save_tiny_served_model(out / "tiny-model")
        # NOTE: the queue holds every client's request, so that only deliberate cancels end a request early
        server = LocalServer.start(model, out, scheduler_args=(
            "--max-num-seqs", str(args.max_num_seqs), "--max-num-batched-tokens", str(args.max_num_batched_tokens),
            "--max-queued-requests", str(max(1024, args.clients)), *args.scheduler_args.split()),
            worker_args=("--kv-memory", args.kv_memory))
        address, pid, metrics = server.address, server.scheduler_pid, server.metrics
        print(f"server {address} logs {out}", flush=True)
    try:
        stats, wall, rss_start, rss_peak = asyncio.run(drive(address, pid, args))
        hwm = read_status_kb(pid, "VmHWM") if pid else None
        if metrics:
            print(f"after {json.dumps(wait_idle(lambda name: metric(metrics, name)))}")
        if server is not None:
            errors = server.error_lines()
            print(f"scheduler_errors_logged={len(errors)}", *errors[:5], sep="\n")
        print(report(args, stats, wall, rss_start, rss_peak, hwm), flush=True)
    finally:
        if server is not None:
            server.stop()
    return 0 if stats.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
