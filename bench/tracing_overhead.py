"""What traces cost: scheduler throughput with --otlp-endpoint unset against the same scheduler without the tracing
hooks (the tree before they were added), and with it set, exporting to a local OTLP/gRPC collector.

    python bench/tracing_overhead.py [--cycles 5] [--round 6] [--clients 32] [--max-tokens 8] [--baseline REV]

Starts three `pagedserve scheduler`s on loopback, each with one CPU worker over the tests' tiny random Llama (or
--model DIR): `base` runs the code of --baseline (default: the parent of the commit that added scheduler_svc/tracing,
extracted with git archive), `off` and `on` this tree, `on` with --otlp-endpoint to a collector in this process that
counts the spans it receives. Then --cycles cycles of one round each, the order rotated every cycle (back to back, the
same machine, so drift hits all three alike): a round is --clients streaming gRPC clients sending short text prompts
for --round seconds; its figure is output tokens per second. Prints each round, then the medians and last

    tracing_off_ratio=X.XXX tracing_on_ratio=X.XXX spans_received=N

(off/base and on/off medians: 1.000 costs nothing; the target for off is >= 0.98).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from concurrent import futures
from io import BytesIO
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from anywhere without installing
from pagedserve.v1 import generate_pb2 as pb  # noqa: E402
from pagedserve.v1 import generate_pb2_grpc  # noqa: E402
from pagedserve_cli.up_cmd import wait_healthy  # noqa: E402
from pagedserve_common.ports import free_port  # noqa: E402

WORDS = ("the", "sea", "a", "ship", "sails", "north", "under", "grey", "skies", "and", "wind", "calls", "home")


def baseline_tree(rev: str | None, out: Path) -> tuple[str, Path]:
    """(the revision, a directory holding its files): --baseline, else the tree before scheduler_svc/tracing."""
    if rev is None:
        added = subprocess.run(["git", "-C", str(ROOT), "log", "--format=%H", "--diff-filter=A", "--",
                                "scheduler_svc/tracing/__init__.py"], capture_output=True, text=True, check=True)
        rev = added.stdout.split()[-1] + "^"
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev], capture_output=True, text=True,
                         check=True).stdout.strip()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True).stdout
    tarfile.open(fileobj=BytesIO(archive)).extractall(out, filter="data")
    return rev, out


class Collector:
    """An OTLP/gRPC trace collector that counts the spans it receives."""

    def __init__(self) -> None:
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        collector = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                collector.num_spans += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
                return trace_service_pb2.ExportTraceServiceResponse()

        self.num_spans = 0
        self.port = free_port()
        self.server = grpc.server(futures.ThreadPoolExecutor(2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        self.server.start()


class Server:
    """`pagedserve scheduler` from the tree `code` and one worker (from this tree), on loopback."""

    def __init__(self, name: str, code: Path, model: str, log_dir: Path, *scheduler_args: str) -> None:
        self.name, self.address = name, f"127.0.0.1:{free_port()}"
        worker_listen = f"127.0.0.1:{free_port()}"
        exe = [sys.executable, "-m", "pagedserve_cli.main"]
        with open(log_dir / f"{name}-scheduler.log", "wb") as slog, open(log_dir / f"{name}-worker.log", "wb") as wlog:
            self.procs = [
                subprocess.Popen([*exe, "scheduler", "--model", model, "--listen", self.address, "--worker-listen",
                                  worker_listen, "--metrics", "", "--http", "", "--max-num-seqs", "64",
                                  *scheduler_args], stderr=slog, cwd=code, env={**os.environ, "PYTHONPATH": str(code)}),
                subprocess.Popen([*exe, "worker", "--scheduler", worker_listen, "--model", model, "--threads", "1"],
                                 stderr=wlog, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})]

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()


async def one_round(address: str, clients: int, seconds: float, max_tokens: int, seed: int) -> float:
    """Output tokens per second of `clients` streaming clients for `seconds`."""
    deadline, tokens = time.monotonic() + seconds, [0]

    async def client(stub, i: int) -> None:
        n = 0
        while time.monotonic() < deadline:
            words = " ".join(WORDS[(seed + i + n + k) % len(WORDS)] for k in range(6))
            async for msg in stub.Generate(pb.GenerateRequest(prompt=words, sampling=pb.SamplingParams(
                    max_tokens=max_tokens, ignore_eos=True, temperature=0.8, seed=n)), timeout=300):
                tokens[0] += len(msg.token_ids)
            n += 1

    async with grpc.aio.insecure_channel(address) as channel:
        stub = generate_pb2_grpc.GenerationStub(channel)
        t0 = time.monotonic()
        await asyncio.gather(*(client(stub, i) for i in range(clients)))
        return tokens[0] / (time.monotonic() - t0)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cycles", type=int, default=5)
    p.add_argument("--round", type=float, default=6.0, help="seconds per round")
    p.add_argument("--clients", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--baseline", help="git revision without the tracing hooks")
    p.add_argument("--model", help="a model directory (default: the tests' tiny random Llama)")
    args = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="pagedserve-tracing-bench-"))
    rev, base = baseline_tree(args.baseline, work / "base")
    if args.model:
        model = args.model
    else:
        from tests.service.conftest import save_tiny_served_model

        model = save_tiny_served_model(work / "tiny-model")
    collector = Collector()
    servers = [Server("base", base, model, work), Server("off", ROOT, model, work),
               Server("on", ROOT, model, work, "--otlp-endpoint", f"http://127.0.0.1:{collector.port}")]
    print(f"baseline {rev}; logs in {work}", flush=True)
    rates: dict[str, list[float]] = {s.name: [] for s in servers}
    try:
        for s in servers:
            wait_healthy(s.address, 180, s.procs)
            asyncio.run(one_round(s.address, args.clients, 2.0, args.max_tokens, 0))  # warm-up, not counted
        for cycle in range(args.cycles):
            order = servers[cycle % 3:] + servers[:cycle % 3]
            for s in order:
                rate = asyncio.run(one_round(s.address, args.clients, args.round, args.max_tokens, cycle))
                rates[s.name].append(rate)
                print(f"cycle {cycle} {s.name:4} tok_s={rate:.1f}", flush=True)
    finally:
        for s in servers:
            s.stop()
        time.sleep(1.0)  # NOTE: `on` exports its last batch as it stops
        collector.server.stop(0)
    med = {name: statistics.median(r) for name, r in rates.items()}
    print(" ".join(f"{name}_median_tok_s={m:.1f}" for name, m in med.items()))
    print(f"tracing_off_ratio={med['off'] / med['base']:.3f} tracing_on_ratio={med['on'] / med['off']:.3f} "
          f"spans_received={collector.num_spans}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
