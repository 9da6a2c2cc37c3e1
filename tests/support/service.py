"""A real scheduler and worker as processes on loopback, over a tiny Llama with SmolLM2's tokenizer (the fixtures
`service` and `http` in tests/conftest.py), and helpers for tests against them: its metrics, waiting for a condition,
whether it is idle, and that it ends idle and still serves."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import grpc

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc
from pagedserve_cli.bench.local_server import wait_idle
from pagedserve_common.ports import free_port

KV_MEMORY = 40 * 16 * 512  # 40 blocks of 16 tokens: 2 (K, V) x 2 layers x 2 kv heads x 16 head_dim x 4 bytes
# NOTE: the test workers' weights and cache: float32 whatever the CPU (`auto` is bfloat16 where the CPU has
# AVX512-BF16 or AMX), so that KV_MEMORY is 40 blocks and greedy outputs are transformers' float32 ones everywhere.
EXACT = ("--dtype", "float32")
MAX_BATCHED = 64
RPC_TIMEOUT = 300  # NOTE: generous; a request that hangs ends DEADLINE_EXCEEDED and fails the test


@dataclass
class Service:
    model_dir: str
    address: str
    metrics: str
    procs: list
    http: str = ""  # the OpenAI-compatible front, HOST:PORT
    worker_listen: str = ""  # where workers dial in, HOST:PORT
    # NOTE: keyword-only, so that subclasses (test_access.Secure) keep their positional fields
    log: Path | None = field(default=None, kw_only=True)  # the scheduler's stderr, when the fixture keeps it

    def log_since(self, offset: int) -> str:
        """The scheduler's log from byte `offset` (a size read earlier: len of log_since(0))."""
        with open(self.log, "rb") as f:
            f.seek(offset)
            return f.read().decode(errors="replace")

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address)

    def openai_client(self, timeout: float = 300):
        """The official `openai` client on the HTTP front (no retries: a refusal must show as it is)."""
        import openai

        return openai.OpenAI(base_url=f"http://{self.http}/v1", api_key="unused", max_retries=0, timeout=timeout)

    def scrape(self) -> str:
        return scrape(self.metrics)

    def metric(self, name: str, **labels: str) -> float:
        return metric_value(self.scrape(), name, **labels)

    def kv_state(self):
        """GetKVState of the (first) worker: the scheduler's own state, between two steps."""
        with self.channel() as ch:
            return generate_pb2_grpc.GenerationStub(ch).GetKVState(pb.GetKVStateRequest(), timeout=60)

    def worker_name(self, worker_id: str) -> str:
        """The name the worker registered with (HOST:PID): its per-worker metrics' `worker` label."""
        with self.channel() as ch:
            info = generate_pb2_grpc.GenerationStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=60)
        return next(w.name for w in info.workers if w.worker_id == worker_id)

    def live_request_ids(self) -> list[str]:
        """The requests holding blocks on the (first) worker."""
        return [s.request_id for s in self.kv_state().sequences]

    def worker_idle(self) -> bool:
        """No request runs or waits and no step is in flight: every plan sent has been answered (a plan still
        goes out after the last request ends, to tell the worker so)."""
        before = self.scrape()
        state = self.kv_state()  # NOTE: read after the scrape: answered then <= answered now <= planned now
        answered = metric_value(before, "pagedserve_step_seconds_count", worker=self.worker_name(state.worker_id))
        return not state.sequences and not state.num_waiting and answered == state.num_steps

    @contextmanager
    def worker_paused(self) -> Iterator[None]:
        """The worker stopped (SIGSTOP) inside the block, from a moment it is idle: the next request's first step
        stays in flight, so a test can act on a request mid-generation without racing the tiny model, whose few
        hundred tokens take about a second. NOTE: far shorter than --step-timeout (60 s), so the scheduler keeps
        the worker."""
        worker = self.procs[0]  # NOTE: procs are [worker, scheduler]
        wait_until(self.worker_idle)  # else a plan in flight would hold back the next request's admission
        os.kill(worker.pid, signal.SIGSTOP)
        try:
            yield
        finally:
            os.kill(worker.pid, signal.SIGCONT)


class GreedyStream:
    """One greedy gRPC request of exactly `max_tokens` tokens (ignore_eos) in a thread: its tokens, and its error
    if it fails."""

    def __init__(self, svc: Service, prompt: list[int], max_tokens: int, **sampling) -> None:
        self.tokens: list[int] = []
        self.error: tuple | None = None
        self.thread = threading.Thread(target=self._run, args=(svc.address, prompt, max_tokens, sampling))
        self.thread.start()

    def _run(self, address: str, prompt: list[int], max_tokens: int, sampling: dict) -> None:
        try:
            with grpc.insecure_channel(address) as ch:
                for msg in generate_pb2_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
                        prompt_token_ids=prompt, sampling=pb.SamplingParams(
                            max_tokens=max_tokens, temperature=0, ignore_eos=True, **sampling)), timeout=RPC_TIMEOUT):
                    self.tokens.extend(msg.token_ids)
        except grpc.RpcError as e:
            self.error = (e.code(), e.details())

    def result(self) -> list[int]:
        self.thread.join(RPC_TIMEOUT)
        assert self.error is None, self.error
        return self.tokens


def recv_until(sock, marker: bytes) -> bytes:
    """What the socket `sock` receives until `marker` has come (a response's head, a stream's first event); fails
    if the peer closes first."""
    head = b""
    while marker not in head:
        chunk = sock.recv(4096)
        assert chunk, head
        head += chunk
    return head


def scrape(metrics: str) -> str:
    """The Prometheus text of the scheduler whose metrics listen on HOST:PORT `metrics`."""
    import urllib.request

    return urllib.request.urlopen(f"http://{metrics}/metrics", timeout=60).read().decode()


def metric_value(text: str, name: str, **labels: str) -> float:
    """The sum of a metric's samples in `text` whose labels include `labels` (every series without any)."""
    want = ",".join(f'{k}="{v}"' for k, v in labels.items())
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and line[len(name)] in " {" and want in line)


def wait_until(cond, timeout: float = 120.0, interval: float = 0.05) -> None:
    """Polls cond() until it holds (a gRPC error counts as not yet: a server still starting, a scheduler
    restarting); fails after `timeout` seconds, a hang guard, never a measure of speed."""
    deadline, error = time.monotonic() + timeout, None
    while True:
        try:
            if cond():
                return
        except grpc.RpcError as e:
            error = e
        assert time.monotonic() < deadline, f"timed out after {timeout:g} s waiting for {cond} (last error: {error})"
        time.sleep(interval)


@contextmanager
def started_service(model_dir: str, *scheduler_args: str, kv_memory: str = str(KV_MEMORY),
                    log: Path | None = None) -> Iterator[Service]:
    """A scheduler (with `scheduler_args`; its stderr in `log` when given) and one worker of `kv_memory` bytes,
    healthy; stopped on exit."""
    listen, worker_listen, metrics, http = (f"127.0.0.1:{free_port()}" for _ in range(4))
    exe = [sys.executable, "-m", "pagedserve_cli.main"]
    with open(log if log is not None else os.devnull, "wb") as err:
        sched = subprocess.Popen([*exe, "scheduler", "--model", model_dir, "--listen", listen,
                                  "--worker-listen", worker_listen, "--metrics", metrics, "--http", http,
                                  "--max-num-batched-tokens", str(MAX_BATCHED), *scheduler_args],
                                 stderr=err if log is not None else None)
    worker = subprocess.Popen([*exe, "worker", "--scheduler", worker_listen, "--model", model_dir,
                               "--kv-memory", kv_memory, "--threads", "1", *EXACT])
    procs = [worker, sched]
    try:
        from pagedserve_cli.up_cmd import wait_healthy
        wait_healthy(listen, 120, procs)
        yield Service(model_dir, listen, metrics, procs, http, worker_listen, log=log)
    finally:
        stop_processes(procs)


def start_worker(log, worker_listen: str, model_dir: str, *extra: str) -> subprocess.Popen:
    """A `pagedserve worker` process with the tests' small pool and one thread, its stderr in the file `log`."""
    with open(log, "wb") as err:
        return subprocess.Popen([sys.executable, "-m", "pagedserve_cli.main", "worker", "--scheduler", worker_listen,
                                 "--model", model_dir, "--kv-memory", str(KV_MEMORY), "--threads", "1", *EXACT,
                                 *extra],
                                stderr=err)


def stop_processes(procs: list[subprocess.Popen]) -> None:
    """SIGTERM to each, then SIGKILL to any that has not exited 30 s later."""
    for p in procs:
        p.terminate()
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()




def idle(service) -> bool:
    return (service.metric("pagedserve_requests_running") == 0 and service.metric("pagedserve_requests_waiting") == 0
            and service.metric("pagedserve_kv_blocks_used") == 0)


def assert_idle_and_serving(service: Service) -> None:
    """Nothing runs or waits and every KV block is free or cached-free (polled), then a normal request works."""
    reading = wait_idle(service.metric, timeout=120)
    assert not any(reading.values()), f"still busy or holding blocks: {reading}"
    with service.channel() as ch:
        out = list(generate_pb2_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
            prompt="The capital of France is", sampling=pb.SamplingParams(max_tokens=4, temperature=0)),
            timeout=RPC_TIMEOUT))
    assert sum(len(m.token_ids) for m in out) == 4 and out[-1].finish_reason == pb.FINISH_REASON_LENGTH


@contextmanager
def no_error_logged(service: Service) -> Iterator[None]:
    """Asserts that the scheduler logs no traceback and no error while the block runs (run a request that completes
    inside it, after the bad ones: a line logged after an answer went out is then in the log too)."""
    start = os.path.getsize(service.log)
    yield
    text = service.log_since(start)
    assert "Traceback" not in text and '"level": "error"' not in text, text[-3000:]
