"""An honest stream under a connection attack: its inter-token gaps idle, then while 1,100 idle connections and 200
slowloris connections (a header byte every 5 s) are held against the HTTP front, in one run; the scheduler's RSS
and open descriptors before, during and after.

    python bench/attack.py [--model DIR] [--idle 1100] [--slowloris 200] [--tokens 300] [--seconds 25] [--nofile 1024]

Starts `pagedserve scheduler` (with --http) and one CPU worker on loopback over the tests' tiny model (or --model),
the scheduler under a soft open files limit of --nofile (the issue's 1024; it raises it to its hard limit at start).
The attacker runs in a process of its own (so that its sockets do not share the measuring client's event loop)
and holds its connections: one the server closes (--header-timeout, the cap) is opened again a second later. The
honest streams are greedy gRPC streams of --tokens tokens each, one after another for --seconds per phase. Prints
the phases and last one line:

    attack itl_p99_ratio=X itl_idle_p99_ms=.. itl_attack_p99_ms=.. rss_mb_before=.. rss_mb_during=.. rss_mb_after=..
    fds_before=.. fds_during=.. fds_after=..

(itl_p99_ratio: under attack / idle; the issue's target is <= 2).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import multiprocessing
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere without installing
from pagedserve.v1 import generate_pb2 as pb  # noqa: E402
from pagedserve.v1 import generate_pb2_grpc  # noqa: E402
from pagedserve_cli.bench.local_server import LocalServer  # noqa: E402
from pagedserve_cli.bench.report import percentiles  # noqa: E402
from pagedserve_common.ports import free_port  # noqa: E402

SLOWLORIS_PERIOD_S = 5.0
REOPEN_AFTER_S = 1.0


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def num_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


# -- the attacker (its own process) -----------------------------------------------------------------------------
async def hold(host: str, port: int, slow: bool, stop: asyncio.Event, counts: collections.Counter) -> None:
    """One connection held open, opened again after the server closes it."""
    while not stop.is_set():
        try:
            reader, writer = await asyncio.open_connection(host, port)
        except OSError:
            counts["connect_failed"] += 1
            await asyncio.sleep(REOPEN_AFTER_S)
            continue
        counts["opened"] += 1
        if slow:
            writer.write(b"GET /v1/models HTTP/1.1\r\nhost: x\r\n")
        try:
            while not stop.is_set():
                try:
                    first = await asyncio.wait_for(reader.read(64), SLOWLORIS_PERIOD_S if slow else 1.0)
                except TimeoutError:
                    if slow:
                        writer.write(b"x")  # one more header byte
                    continue
                counts["closed_by_server" if not first else f"answered_{first[9:12].decode(errors='replace')}"] += 1
                break
        except OSError:
            counts["reset_by_server"] += 1
        finally:
            writer.close()
        await asyncio.sleep(REOPEN_AFTER_S)


async def attack(host: str, port: int, num_idle: int, num_slow: int, stop_flag, results) -> None:
    stop, counts = asyncio.Event(), collections.Counter()
    tasks = [asyncio.create_task(hold(host, port, i >= num_idle, stop, counts)) for i in range(num_idle + num_slow)]
    while not stop_flag.is_set():
        await asyncio.sleep(0.2)
    stop.set()
    await asyncio.wait(tasks, timeout=10)
    for t in tasks:
        t.cancel()
    results.put(dict(counts))


def attacker_main(host: str, port: int, num_idle: int, num_slow: int, stop_flag, results) -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    asyncio.run(attack(host, port, num_idle, num_slow, stop_flag, results))


# -- the honest client ------------------------------------------------------------------------------------------
async def stream_gaps(stub, tokens: int) -> list[float]:
    call = stub.Generate(pb.GenerateRequest(prompt="Tell me a long story about the sea.", sampling=pb.SamplingParams(
        max_tokens=tokens, temperature=0.0, ignore_eos=True)), timeout=600)
    gaps, last = [], None
    async for _ in call:
        now = time.perf_counter()
        if last is not None:
            gaps.append(now - last)
        last = now
    return gaps


async def phase(address: str, tokens: int, seconds: float) -> list[float]:
    """The gaps of streams run one after another until `seconds` are over (one at least)."""
    async with grpc.aio.insecure_channel(address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        gaps, end = [], time.monotonic() + seconds
        while not gaps or time.monotonic() < end:
            gaps += await stream_gaps(stub, tokens)
        return gaps


def p99_ms(gaps: list[float]) -> float:
    return (percentiles(gaps)["p99"] or float("nan")) * 1e3


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", help="model directory (default: the tests' tiny random Llama)")
    ap.add_argument("--idle", type=int, default=1100, help="idle connections held")
    ap.add_argument("--slowloris", type=int, default=200, help="slowloris connections held")
    ap.add_argument("--tokens", type=int, default=300, help="tokens of each measured stream")
    ap.add_argument("--seconds", type=float, default=25.0, help="each phase streams this long: over the 10 s "
                                                                  "--header-timeout, so closes and reopens happen")
    ap.add_argument("--nofile", type=int, default=1024, help="the scheduler's soft open files limit at start")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds between the attack's start and measuring")
    ap.add_argument("--scheduler-args", default="", help="more `pagedserve scheduler` arguments")
    ap.add_argument("--out", default=None, help="folder for the servers' logs (default: a temporary one)")
    args = ap.parse_args(argv)
    out = Path(args.out or tempfile.mkdtemp(prefix="pagedserve-attack-"))
    if args.model:
        model = args.model
    else:
        from tests.service.conftest import save_tiny_served_model
        model = save_tiny_served_model(out / "tiny-model")
    http = f"127.0.0.1:{free_port()}"

    def lowered_soft_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (args.nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    server = LocalServer.start(model, out, scheduler_args=("--http", http, *args.scheduler_args.split()),
                               scheduler_preexec=lowered_soft_limit)
    pid = server.scheduler_pid
    try:
        asyncio.run(phase(server.address, 16, 0))  # warm-up
        rss_before, fds_before = rss_mb(pid), num_fds(pid)
        idle = asyncio.run(phase(server.address, args.tokens, args.seconds))
        print(f"idle: itl_p50_ms={percentiles(idle)['p50'] * 1e3:.1f} itl_p99_ms={p99_ms(idle):.1f} "
              f"samples={len(idle)}", flush=True)
        ctx = multiprocessing.get_context("spawn")
        stop_flag, results = ctx.Event(), ctx.Queue()
        host, port = http.rsplit(":", 1)
        attacker = ctx.Process(target=attacker_main, args=(host, int(port), args.idle, args.slowloris, stop_flag,
                                                            results))
        attacker.start()
        time.sleep(args.settle)
        attacked = asyncio.run(phase(server.address, args.tokens, args.seconds))
        rss_during, fds_during = rss_mb(pid), num_fds(pid)
        stop_flag.set()
        counts = results.get(timeout=120)
        attacker.join(timeout=60)
        print(f"attack: itl_p50_ms={percentiles(attacked)['p50'] * 1e3:.1f} itl_p99_ms={p99_ms(attacked):.1f} "
              f"samples={len(attacked)} attacker={dict(sorted(counts.items()))}", flush=True)
        time.sleep(3)  # the server sees the attacker's connections close
        rss_after, fds_after = rss_mb(pid), num_fds(pid)
        errors = server.error_lines()
        print(f"scheduler errors logged: {len(errors)}; log lines: "
              f"{len(server.scheduler_log.read_text(errors='replace').splitlines())}; logs in {out}")
    finally:
        server.stop()
    print(f"attack itl_p99_ratio={p99_ms(attacked) / p99_ms(idle):.2f} itl_idle_p99_ms={p99_ms(idle):.1f} "
          f"itl_attack_p99_ms={p99_ms(attacked):.1f} rss_mb_before={rss_before:.1f} rss_mb_during={rss_during:.1f} "
          f"rss_mb_after={rss_after:.1f} fds_before={fds_before} fds_during={fds_during} fds_after={fds_after}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
