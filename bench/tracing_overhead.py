"""What traces cost: the scheduler's CPU per request with --otlp-endpoint unset against the same code without the
tracing hooks (the tree before they were added), and with it set, exporting to a local OTLP/gRPC collector.

    python bench/tracing_overhead.py [--rounds 100] [--requests 960] [--concurrency 32] [--max-tokens 8]
                                     [--baseline REV]

Three child processes, one per variant, each running one tree's scheduler code in process: its Engine and FrontEnd
(the front end both APIs call) with an in-process worker that answers every step at once (a fixed token for each
sample due). A round sends --requests requests (8 prompt tokens, --max-tokens output tokens) from --concurrency
clients through FrontEnd.generate and reads each stream to its end: all of a request's scheduler path (admission,
scheduling, the step hooks, detokenizing, stop strings, the request log's end) but the gRPC/HTTP framing, where the
hooks are one attribute read each. Its figure is requests per second of the child's CPU time (user + system, all
threads: the span exporter's too), i.e. the throughput of a CPU-bound scheduler. `base` runs --baseline (default:
main just before scheduler_svc/tracing came in: the first parent of the commit, or merge, that added it, along
first parents, extracted with git archive), `off` and `on` this tree,
`on` with scheduler_svc.tracing.start() on a collector in this process that counts the spans it receives (each
request sends a traceparent). The children take rounds in turn, --rounds times, the order rotated each round, so that
the machine's load weighs on all three alike; the figures are the medians.

NOTE: not server processes under load: on a shared 2-core machine their wall-clock throughput moved 10-20% between
rounds, a closed loop's batches grow with throughput (the faster server also gets cheaper per token), and a fresh
process per measurement moved CPU per request by 3-6% between identical trees. Prints every tenth round, the
medians, and last

    tracing_off_ratio=X.XXX tracing_on_ratio=X.XXX on_cost_us_per_request=N spans_received=N

(off/base and on/off of the medians of requests per CPU second: 1.000 costs nothing; the target for off is >= 0.98).
"""

from __future__ import annotations

import argparse
import asyncio
import json
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

ROOT = Path(__file__).resolve().parent.parent
TRACEPARENT = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"


def baseline_tree(rev: str | None, out: Path) -> tuple[str, Path]:
    """(the revision, a directory holding its files): --baseline, else the tree before scheduler_svc/tracing."""
    if rev is None:
        # NOTE: along first parents, so that where the hooks came in by a merge the base is main just before it
        # (with everything else main had then), not the branch's own start
        added = subprocess.run(["git", "-C", str(ROOT), "log", "--first-parent", "--format=%H", "--diff-filter=A",
                                "--", "scheduler_svc/tracing/__init__.py"], capture_output=True, text=True, check=True)
        rev = added.stdout.split()[-1] + "^1"
    rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev], capture_output=True, text=True,
                         check=True).stdout.strip()
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev], capture_output=True, check=True).stdout
    tarfile.open(fileobj=BytesIO(archive)).extractall(out, filter="data")
    return rev, out


class Collector:
    """An OTLP/gRPC trace collector that counts the spans it receives."""

    def __init__(self) -> None:
        import grpc
        from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

        collector = self

        class Service(trace_service_pb2_grpc.TraceServiceServicer):
            def Export(self, request, context):
                collector.num_spans += sum(len(ss.spans) for rs in request.resource_spans for ss in rs.scope_spans)
                return trace_service_pb2.ExportTraceServiceResponse()

        from pagedserve_common.ports import free_port

        self.num_spans = 0
        self.port = free_port()
        self.server = grpc.server(futures.ThreadPoolExecutor(2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Service(), self.server)
        self.server.add_insecure_port(f"127.0.0.1:{self.port}")
        self.server.start()


# -- the child: one tree's scheduler code, in process ---------------------------------------------------------------
async def serve_rounds(model_dir: str, endpoint: str, concurrency: int, max_tokens: int) -> None:
    """Runs Engine + FrontEnd with an instant in-process worker; for each line `N` on stdin, N requests through
    FrontEnd.generate by `concurrency` clients, answered on stdout with the CPU seconds they took."""
    import structlog

    from pagedserve_common.kv_geometry import KVGeometry
    from pagedserve_common.registration import WorkerRegistration
    from pagedserve_common.sampling import SamplingParams
    from pagedserve_common.step import StepResult
    from scheduler_svc.engine import Engine, EngineConfig
    from scheduler_svc.frontend import FrontEnd, GenerateInput, Tokenizer

    # NOTE: the request log's lines are dropped at the level filter (the server writes them: the same for all three)
    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    extra = {}  # NOTE: none without an endpoint: the baseline tree's Engine takes no tracing
    if endpoint:
        from scheduler_svc import tracing

        extra["tracing"] = tracing.start(endpoint, "m")
    engine = Engine(EngineConfig(model_id="m", max_model_len=512, vocab_size=49152, max_num_seqs=64), **extra)
    frontend = FrontEnd(engine, Tokenizer.from_model_dir(model_dir))
    w = engine.attach_worker(WorkerRegistration("m", 512, "cpu", KVGeometry(1, 1, 8, "float32", 16), 8192))

    async def answer() -> None:
        # NOTE: what samples is read off the plans, as a worker does (the step in flight is the engine's, and the
        # baseline tree's API differs): each sequence once its known tokens are all computed, its token then known
        known: dict[int, list[int]] = {}  # seq_id -> [tokens known, tokens computed]
        while (plan := await w.outbox.get()) is not None:
            for seq_id in (*plan.finished_seq_ids, *plan.preempted_seq_ids):
                known.pop(seq_id, None)
            for n in plan.new_seqs:
                known[n.seq_id] = [len(n.token_ids), n.num_computed_tokens]
            due = []
            for n in (*plan.new_seqs, *plan.running):
                seq = known[n.seq_id]
                seq[1] += n.num_scheduled_tokens
                if seq[1] >= seq[0]:
                    seq[0] += 1
                    due.append(n.seq_id)
            w.inbox.put_nowait(StepResult(plan.step_id, dict.fromkeys(due, 7)))

    async def client(i: int, n: int) -> None:
        for k in range(n):
            inp = GenerateInput(prompt_token_ids=[(i * 31 + k + j) % 4000 + 100 for j in range(8)],
                                sampling=SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.8,
                                                        seed=k))
            stream = await (frontend.generate(inp, {"traceparent": TRACEPARENT}) if endpoint else
                            frontend.generate(inp))
            async for _ in stream:
                pass

    worker = asyncio.get_running_loop().create_task(answer())
    loop = asyncio.get_running_loop()
    while line := (await loop.run_in_executor(None, sys.stdin.readline)).strip():
        per_client = int(line) // concurrency
        t0 = time.process_time()
        await asyncio.gather(*(client(i, per_client) for i in range(concurrency)))
        if endpoint:
            frontend.tracing.provider.force_flush()  # NOTE: the export of the round's spans counts too
        print(json.dumps({"requests": per_client * concurrency, "cpu_s": time.process_time() - t0}), flush=True)
    engine.detach(w)
    await worker
    frontend.pool.shutdown()


# -- the parent -----------------------------------------------------------------------------------------------------
class Child:
    """One tree's scheduler code in a process of its own, running rounds when asked."""

    def __init__(self, name: str, tree: Path, model: str, endpoint: str, args) -> None:
        self.name = name
        self.proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--child", model, endpoint,
                                      str(args.concurrency), str(args.max_tokens)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, cwd=tree,
                                     # NOTE: a round makes spans faster than one exporter thread sends them:
                                     # a queue that holds them all, so that none is dropped (uncounted)
                                     env={**os.environ, "PYTHONPATH": str(tree), "PYTHONHASHSEED": "0",
                                          "OTEL_BSP_MAX_QUEUE_SIZE": str(8 * args.requests)})

    def round(self, num_requests: int) -> float:
        """Requests per CPU second of a round of `num_requests`."""
        self.proc.stdin.write(f"{num_requests}\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name}: the child exited ({self.proc.wait()})")
        out = json.loads(line)
        return out["requests"] / out["cpu_s"]

    def stop(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main() -> int:
    if sys.argv[1:2] == ["--child"]:
        model_dir, endpoint, concurrency, max_tokens = sys.argv[2:]
        asyncio.run(serve_rounds(model_dir, endpoint, int(concurrency), int(max_tokens)))
        return 0
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=100)
    p.add_argument("--requests", type=int, default=960, help="requests per round")
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--baseline", help="git revision without the tracing hooks")
    args = p.parse_args()
    sys.path.insert(0, str(ROOT))
    from pagedserve_common.defaults import DEFAULT_MODEL
    from worker_svc.model_store import resolve_model

    work = Path(tempfile.mkdtemp(prefix="pagedserve-tracing-bench-"))
    rev, base = baseline_tree(args.baseline, work / "base")
    model = str(resolve_model(DEFAULT_MODEL))  # NOTE: only its tokenizer is read
    collector = Collector()
    children = [Child("base", base, model, "", args), Child("off", ROOT, model, "", args),
                Child("on", ROOT, model, f"http://127.0.0.1:{collector.port}", args)]
    print(f"baseline {rev}", flush=True)
    rates: dict[str, list[float]] = {c.name: [] for c in children}
    try:
        for c in children:
            c.round(args.requests)  # warm-up: caches, lazy imports; not counted
        for r in range(args.rounds):
            for c in children[r % 3:] + children[:r % 3]:
                rates[c.name].append(c.round(args.requests))
            if r % 10 == 9:
                print(f"round {r + 1}: " + " ".join(f"{name}={v[-1]:.0f}" for name, v in rates.items()), flush=True)
    finally:
        for c in children:
            c.stop()
        collector.server.stop(0)
    med = {name: statistics.median(r) for name, r in rates.items()}
    print(" ".join(f"{name}_median_requests_per_cpu_s={m:.0f}" for name, m in med.items()))
    print(f"tracing_off_ratio={med['off'] / med['base']:.3f} tracing_on_ratio={med['on'] / med['off']:.3f} "
          f"on_cost_us_per_request={1e6 / med['on'] - 1e6 / med['off']:.0f} spans_received={collector.num_spans}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
