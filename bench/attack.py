"""An honest stream under attack, case by case: the inter-token gaps of greedy gRPC streams idle, then right after
(back to back, same server) while an attacker runs, in one run; each case's figure is the honest stream's
inter-token p99 under the attack divided by its p99 idle just before (the machine is noisy: a ratio against the
same stream alone is the only valid figure). The cases (--cases, in this order by default):

    connections     --idle (1100) idle and --slowloris (200) slowloris connections (a header byte every 5 s) held
                    against the HTTP front; one the server closes (--header-timeout) is opened again a second later
    regex_nested    --flood (48) concurrent HTTP /v1/completions requests with the structured output regex
                    `a{1000}{1000}` (vLLM's structured_outputs.regex), each re-sent as soon as it is answered,
                    whatever the status (the server refuses such a grammar, its mask too costly: 400)
    regex_wide      the same with `x{65535}`
    regex_long      the same with `a{1000000}`
    grpc_idle       --grpc-idle (4150) idle HTTP/2 connections against the scheduler's gRPC client port: each sends
                    the HTTP/2 preface and an empty SETTINGS frame, then nothing; reopened 1 s after a close
    grpc_reconnect  --reconnectors (300) such connections reopened at once whenever closed
    http_reconnect  --reconnectors (300) HTTP connections with a partial head, reopened at once whenever closed

    python bench/attack.py [--cases connections,regex_nested,...] [--seconds 12] [--tokens 200] [--model DIR]
                           [--attacker-source 127.0.0.2] [--idle 1100] [--slowloris 200] [--flood 48]
                           [--grpc-idle 4150] [--reconnectors 300] [--nofile 1024] [--settle 3] [--out DIR]

Starts `pagedserve scheduler` (with --http) and one CPU worker on loopback over the tests' tiny model (or --model),
the scheduler under a soft open files limit of --nofile (the issue's 1024; it raises it to its hard limit at start).
Each attacker runs in a process of its own (spawned: its sockets do not share the measuring client's event loop),
its soft open files limit raised to its hard one, every socket bound to --attacker-source (all of 127/8 is
loopback), so that a per-peer connection cap tells it from the honest client on 127.0.0.1. The honest streams
(--tokens tokens each) run one after another for --seconds per phase, a case's idle phase once the scheduler is
quiet (under 15% of a core over a second: the work an earlier attack left queued has ended); one that fails (any
gRPC error) is counted (honest_failed: an honest client must stay served). The regex cases count the answers'
statuses and, of those served (200), the finish reasons, bad_text (a text that is no prefix of a match) and
bad_stop (finish reason "stop" with such a text). Each case prints one line as it ends:

    NAME: itl_idle_p99_ms=.. itl_attack_p99_ms=.. itl_p99_ratio=.. honest_failed=N [bad_stop=N] ... rss_mb_before=..
    rss_mb_during=.. rss_mb_after=.. fds_before=.. fds_during=.. fds_after=.. attacker={counts}

and the last line is, for the cases run in their order (two decimals; inf when no honest stream was served under
the attack; the issue's target is <= 2 each):

    attack connections.itl_p99_ratio=X regex_nested.itl_p99_ratio=X ... worst_itl_p99_ratio=X
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import math
import multiprocessing
import os
import resource
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import grpc

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))
from attack_cases import attacker_main  # noqa: E402
from pagedserve.v1 import generate_pb2 as pb  # noqa: E402
from pagedserve.v1 import generate_pb2_grpc  # noqa: E402
from pagedserve_cli.bench.local_server import LocalServer  # noqa: E402
from pagedserve_cli.bench.report import percentiles  # noqa: E402
from pagedserve_common.ports import free_port  # noqa: E402

REGEXES = {"regex_nested": ("a{1000}{1000}", "a*"), "regex_wide": ("x{65535}", "x*"),
           "regex_long": ("a{1000000}", "a*")}  # the regex, and what any prefix of its matches is
REGEX_MAX_TOKENS = 16
QUIET_CPU = 0.15  # a scheduler using less of a core than this (no stream running) is quiet: the next phase may begin
CASES = ("connections", *REGEXES, "grpc_idle", "grpc_reconnect", "http_reconnect")


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024


def num_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def cpu_seconds(pid: int) -> float:
    """The CPU time (user and system, all threads) the process has used."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def wait_quiet(pid: int, least: float, most: float = 60.0, busy: float = QUIET_CPU) -> float:
    """Waits `least` seconds, then until the process used under `busy` of a core over a second (e.g. the compiles
    an attack left queued have ended), `most` seconds at most; returns the seconds waited."""
    start = time.monotonic()
    time.sleep(least)
    while time.monotonic() - start < most:
        before = cpu_seconds(pid)
        time.sleep(1.0)
        if cpu_seconds(pid) - before < busy:
            break
    return time.monotonic() - start


def attack_of(case: str, args, grpc_address: str, http_address: str, model_name: str) -> tuple[str, dict]:
    """The attacker's kind and parameters for `case`."""
    ghost, gport = grpc_address.rsplit(":", 1)
    hhost, hport = http_address.rsplit(":", 1)
    http = dict(host=hhost, port=int(hport), src=args.attacker_source)
    grpc_ = dict(host=ghost, port=int(gport), src=args.attacker_source)
    if case == "connections":
        return "connections", dict(http, idle=args.idle, slowloris=args.slowloris)
    if case in REGEXES:
        regex, prefix = REGEXES[case]
        return "regex", dict(http, flood=args.flood, regex=regex, prefix=prefix, model=model_name,
                             max_tokens=REGEX_MAX_TOKENS)
    if case == "grpc_idle":
        return "grpc_idle", dict(grpc_, connections=args.grpc_idle)
    if case == "grpc_reconnect":
        return "grpc_reconnect", dict(grpc_, connections=args.reconnectors)
    if case == "http_reconnect":
        return "http_reconnect", dict(http, connections=args.reconnectors)
    raise ValueError(case)


# -- the honest client ------------------------------------------------------------------------------------------
async def stream_gaps(stub, tokens: int, timeout: float) -> list[float]:
    call = stub.Generate(pb.GenerateRequest(prompt="Tell me a long story about the sea.", sampling=pb.SamplingParams(
        max_tokens=tokens, temperature=0.0, ignore_eos=True)), timeout=timeout)
    gaps, last = [], None
    async for _ in call:
        now = time.perf_counter()
        if last is not None:
            gaps.append(now - last)
        last = now
    return gaps


async def phase(address: str, tokens: int, seconds: float) -> tuple[list[float], collections.Counter]:
    """The gaps of streams run one after another until `seconds` are over (one stream tried at least), and the
    failed streams' counts by status code."""
    failed = collections.Counter()
    async with grpc.aio.insecure_channel(address) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        gaps, end = [], time.monotonic() + seconds
        while not (gaps or failed) or time.monotonic() < end:
            try:
                gaps += await stream_gaps(stub, tokens, max(60.0, 5 * seconds))
            except grpc.aio.AioRpcError as e:
                failed[e.code().name] += 1
                await asyncio.sleep(0.2)
        return gaps, failed


def p99_ms(gaps: list[float]) -> float:
    return (percentiles(gaps)["p99"] or float("nan")) * 1e3 if gaps else float("nan")


def p50_ms(gaps: list[float]) -> float:
    return (percentiles(gaps)["p50"] or float("nan")) * 1e3 if gaps else float("nan")


def ratio_of(idle: list[float], attacked: list[float]) -> float:
    if not attacked:
        return math.inf  # no honest stream served under the attack
    return p99_ms(attacked) / p99_ms(idle)


def run_case(case: str, args, server, http_address: str, model_name: str) -> float:
    """One case: an idle phase, then the attack's; prints its line; returns its itl_p99_ratio."""
    pid = server.scheduler_pid
    quiet_s = wait_quiet(pid, 0.0)  # NOTE: an idle phase begins on a quiet server, not amid the last case's work
    rss_before, fds_before = rss_mb(pid), num_fds(pid)
    idle, idle_failed = asyncio.run(phase(server.address, args.tokens, args.seconds))
    kind, params = attack_of(case, args, server.address, http_address, model_name)
    ctx = multiprocessing.get_context("spawn")
    stop_flag, ready_flag, results = ctx.Event(), ctx.Event(), ctx.Queue()
    attacker = ctx.Process(target=attacker_main, args=(kind, params, stop_flag, ready_flag, results))
    attacker.start()
    ready_flag.wait(timeout=60)
    time.sleep(args.settle)
    attacked, failed = asyncio.run(phase(server.address, args.tokens, args.seconds))
    rss_during, fds_during = rss_mb(pid), num_fds(pid)
    stop_flag.set()
    try:
        counts = results.get(timeout=120)
    except Exception:  # noqa: BLE001 - queue.Empty: the attacker died; its counts are lost
        counts = {"lost": 1}
    attacker.join(timeout=60)
    time.sleep(args.settle)  # the server sees the attacker's connections close
    rss_after, fds_after = rss_mb(pid), num_fds(pid)
    ratio = ratio_of(idle, attacked)
    extra = f" honest_errors={dict(failed)}" if failed else ""
    extra += f" idle_failed={sum(idle_failed.values())}" if idle_failed else ""
    extra += f" bad_stop={counts.get('bad_stop', 0)}" if case in REGEXES else ""
    print(f"{case}: itl_idle_p99_ms={p99_ms(idle):.1f} itl_attack_p99_ms={p99_ms(attacked):.1f} "
          f"itl_p99_ratio={ratio:.2f} honest_failed={sum(failed.values())}{extra} "
          f"itl_idle_p50_ms={p50_ms(idle):.1f} itl_attack_p50_ms={p50_ms(attacked):.1f} "
          f"samples={len(idle)}/{len(attacked)} rss_mb_before={rss_before:.1f} rss_mb_during={rss_during:.1f} "
          f"rss_mb_after={rss_after:.1f} fds_before={fds_before} fds_during={fds_during} fds_after={fds_after} "
          f"quiet_wait_s={quiet_s:.0f} attacker={dict(sorted(counts.items()))}", flush=True)
    return ratio


def served_model_name(http_address: str) -> str:
    with urllib.request.urlopen(f"http://{http_address}/v1/models", timeout=30) as r:
        return json.load(r)["data"][0]["id"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--cases", default=",".join(CASES), help=f"comma-separated, run in this order (default: all: "
                                                              f"{','.join(CASES)})")
    ap.add_argument("--model", help="model directory (default: the tests' tiny random Llama)")
    ap.add_argument("--tokens", type=int, default=200, help="tokens of each measured stream")
    ap.add_argument("--seconds", type=float, default=12.0, help="each phase (idle, attack) streams this long")
    ap.add_argument("--settle", type=float, default=3.0, help="seconds between an attack's start and measuring, "
                                                              "and after its end before the next case")
    ap.add_argument("--attacker-source", default="127.0.0.2", help="the address every attacker socket binds")
    ap.add_argument("--idle", type=int, default=1100, help="connections: idle HTTP connections held")
    ap.add_argument("--slowloris", type=int, default=200, help="connections: slowloris HTTP connections held")
    ap.add_argument("--flood", type=int, default=48, help="regex_*: concurrent requests")
    ap.add_argument("--grpc-idle", type=int, default=4150, help="grpc_idle: idle HTTP/2 connections held")
    ap.add_argument("--reconnectors", type=int, default=300, help="grpc_reconnect, http_reconnect: connections")
    ap.add_argument("--nofile", type=int, default=1024, help="the scheduler's soft open files limit at start")
    ap.add_argument("--scheduler-args", default="", help="more `pagedserve scheduler` arguments")
    ap.add_argument("--out", default=None, help="folder for the servers' logs (default: a temporary one)")
    args = ap.parse_args(argv)
    cases = [c.strip() for c in args.cases.split(",") if c.strip()]
    if unknown := [c for c in cases if c not in CASES]:
        ap.error(f"--cases: unknown {', '.join(unknown)} (known: {', '.join(CASES)})")
    out = Path(args.out or tempfile.mkdtemp(prefix="pagedserve-attack-"))
    if args.model:
        model = args.model
    else:
        from pagedserve_cli.bench.tiny_model import save_tiny_served_model
        model = save_tiny_served_model(out / "tiny-model")
    http = f"127.0.0.1:{free_port()}"

    def lowered_soft_limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (args.nofile, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))

    started = time.monotonic()
    server = LocalServer.start(model, out, scheduler_args=("--http", http, *args.scheduler_args.split()),
                               scheduler_preexec=lowered_soft_limit)
    ratios = {}
    try:
        model_name = served_model_name(http)
        asyncio.run(phase(server.address, 16, 0))  # warm-up
        for case in cases:
            ratios[case] = run_case(case, args, server, http, model_name)
        errors = server.error_lines()
        print(f"scheduler errors logged: {len(errors)}; log lines: "
              f"{len(server.scheduler_log.read_text(errors='replace').splitlines())}; logs in {out}; "
              f"{time.monotonic() - started:.0f} s", flush=True)
    finally:
        server.stop()
    worst = max(ratios.values(), key=lambda r: (math.isnan(r), r))
    print("attack " + " ".join(f"{c}.itl_p99_ratio={r:.2f}" for c, r in ratios.items())
          + f" worst_itl_p99_ratio={worst:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
