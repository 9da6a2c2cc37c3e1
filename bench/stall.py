"""Can clients with huge prompts stall other streams? One stream's inter-token gaps, idle and while 8 clients send
~4 MB prompts, in one run; also how long the huge prompts take to be refused and GetModelInfo's latency meanwhile.

    python bench/stall.py [--model DIR] [--tokens 200] [--senders 8] [--prompt-mb 4] [--pause 0.5]

Runs `pagedserve up` twice: with the default bounds (a 4 MB prompt is refused before tokenizing), then with
--max-prompt-chars raised above the prompt (it is tokenized, on the tokenizer pool, then refused by its token
count). Prints one `stall ...` line per run and last `itl_p99_ratio=R` (default bounds: loaded p99 / idle p99;
the target is <= 2).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import time

import grpc

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from pagedserve.v1 import generate_pb2 as pb  # noqa: E402
from pagedserve.v1 import generate_pb2_grpc  # noqa: E402
from pagedserve_cli.bench.report import percentiles  # noqa: E402
from pagedserve_common.defaults import DEFAULT_MODEL  # noqa: E402
from pagedserve_common.ports import free_port  # noqa: E402


def p99(values: list[float]) -> float:
    return percentiles(values)["p99"] or float("nan")


async def stream_gaps(stub, tokens: int, status: dict | None = None) -> list[float]:
    """Seconds between consecutive messages of one greedy stream (after its first); its end in status["stream"]."""
    call = stub.Generate(pb.GenerateRequest(prompt="Tell me a long story about the sea.", sampling=pb.SamplingParams(
        max_tokens=tokens, temperature=0.0, ignore_eos=True)), timeout=600)
    gaps, last, code = [], None, "OK"
    try:
        async for _ in call:
            now = time.perf_counter()
            if last is not None:
                gaps.append(now - last)
            last = now
    except grpc.aio.AioRpcError as e:
        code = e.code().name
    if status is not None:
        status["stream"] = code
    return gaps or [float("nan")]


async def poll_model_info(stub, stop: asyncio.Event, out: list[float]) -> None:
    while not stop.is_set():
        t = time.perf_counter()
        await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=60)
        out.append(time.perf_counter() - t)
        await asyncio.sleep(0.05)


async def send_huge(stub, text: str, pause: float, stop: asyncio.Event, out: list[float], codes: dict) -> None:
    """Sends the huge prompt again and again, `pause` seconds after each answer (a client that retries)."""
    request = pb.GenerateRequest(prompt=text, sampling=pb.SamplingParams(max_tokens=1))
    while not stop.is_set():
        t = time.perf_counter()
        try:
            async for _ in stub.Generate(request, timeout=600):
                pass
            code = "OK"
        except grpc.aio.AioRpcError as e:
            code = e.code().name
        out.append(time.perf_counter() - t)
        codes[code] = codes.get(code, 0) + 1
        try:
            await asyncio.wait_for(stop.wait(), pause)
        except asyncio.TimeoutError:
            pass


async def measure(address: str, tokens: int, senders: int, text: str, pause: float) -> dict:
    opts = [("grpc.max_send_message_length", 64 << 20)]
    async with grpc.aio.insecure_channel(address, options=opts) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        await stream_gaps(stub, 8)  # warm-up
        idle_info: list[float] = []
        stop = asyncio.Event()
        poller = asyncio.create_task(poll_model_info(stub, stop, idle_info))
        idle = await stream_gaps(stub, tokens)
        stop.set()
        await poller
        stop = asyncio.Event()
        loaded_info: list[float] = []
        rejects: list[float] = []
        codes: dict[str, int] = {}
        # NOTE: each sender on its own channel, as separate clients would be
        channels = [grpc.aio.insecure_channel(address, options=opts) for _ in range(senders)]
        tasks = [asyncio.create_task(send_huge(generate_pb2_grpc.GenerationStub(c), text, pause, stop, rejects, codes))
                 for c in channels]
        tasks.append(asyncio.create_task(poll_model_info(stub, stop, loaded_info)))
        await asyncio.sleep(1.0)  # the senders are under way
        status: dict = {}
        loaded = await stream_gaps(stub, tokens, status)
        stop.set()
        await asyncio.gather(*tasks)
        for c in channels:
            await c.close()
    return {"idle_p50": statistics.median(idle), "idle_p99": p99(idle), "loaded_p50": statistics.median(loaded),
            "loaded_p99": p99(loaded), "loaded_max": max(loaded), "reject_p50": percentiles(rejects)["p50"] or float("nan"),
            "reject_max": max(rejects, default=float("nan")), "num_huge": len(rejects), "codes": codes,
            "info_idle_p99": p99(idle_info), "info_loaded_p99": p99(loaded_info),
            "stream": status["stream"]}


def run_up(model: str, extra: list[str], log_path: str) -> tuple[subprocess.Popen, str]:
    listen = f"127.0.0.1:{free_port()}"
    cmd = [sys.executable, "-m", "pagedserve_cli.main", "up", "--model", model, "--listen", listen,
           "--worker-listen", f"127.0.0.1:{free_port()}", "--metrics", f"127.0.0.1:{free_port()}", "--http", "",
           *extra]
    log = open(log_path, "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 600
    while "pagedserve is up" not in open(log_path).read():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise SystemExit(f"pagedserve up did not start; see {log_path}")
        time.sleep(0.5)
    return proc, listen


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--tokens", type=int, default=200, help="tokens of the measured stream, per phase")
    ap.add_argument("--senders", type=int, default=8)
    ap.add_argument("--prompt-mb", type=float, default=4.0, help="size of each huge prompt (under 4 MiB by default)")
    ap.add_argument("--pause", type=float, default=0.5, help="seconds a sender waits after each answer")
    ap.add_argument("--out", default="/tmp/pagedserve-stall")
    ap.add_argument("--up-args", default="", help="more `pagedserve up` arguments")
    ap.add_argument("--runs", default="default-bounds,tokenized", help="which runs, comma-separated")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    text = ("All work and no play makes Jack a dull boy. " * (int(args.prompt_mb * 1e6) // 44 + 1))
    text = text[:int(args.prompt_mb * 1e6)]
    runs = [("default-bounds", []), ("tokenized", ["--max-prompt-chars", str(len(text) + 1)])]
    ratio = None
    for name, extra in [r for r in runs if r[0] in args.runs.split(",")]:
        proc, address = run_up(args.model, extra + args.up_args.split(), f"{args.out}/up-{name}.log")
        try:
            r = asyncio.run(measure(address, args.tokens, args.senders, text, args.pause))
        finally:
            proc.terminate()
            proc.wait(timeout=120)
        codes = ",".join(f"{k}:{v}" for k, v in sorted(r["codes"].items()))
        print(f"stall run={name} senders={args.senders} prompt_mb={args.prompt_mb:g} pause_s={args.pause:g} "
              f"itl_idle_p50_ms={r['idle_p50'] * 1e3:.1f} itl_idle_p99_ms={r['idle_p99'] * 1e3:.1f} "
              f"itl_loaded_p50_ms={r['loaded_p50'] * 1e3:.1f} itl_loaded_p99_ms={r['loaded_p99'] * 1e3:.1f} "
              f"itl_loaded_max_ms={r['loaded_max'] * 1e3:.1f} huge_requests={r['num_huge']} codes={codes} "
              f"refusal_p50_ms={r['reject_p50'] * 1e3:.1f} refusal_max_ms={r['reject_max'] * 1e3:.1f} "
              f"model_info_idle_p99_ms={r['info_idle_p99'] * 1e3:.1f} "
              f"model_info_loaded_p99_ms={r['info_loaded_p99'] * 1e3:.1f} "
              f"measured_stream={r['stream']} ratio={r['loaded_p99'] / r['idle_p99']:.2f}", flush=True)
        if ratio is None:
            ratio = r["loaded_p99"] / r["idle_p99"]
    print(f"itl_p99_ratio={ratio:.2f}")


if __name__ == "__main__":
    main()
