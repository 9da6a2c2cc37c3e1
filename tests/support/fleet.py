"""A scheduler and workers as real processes on loopback, and greedy gRPC streams against them (the failover tests)."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc
from pagedserve_common.ports import free_port
from tests.support.service import EXACT, metric_value, scrape

EXE = [sys.executable, "-m", "pagedserve_cli.main"]
NEW = 160  # long enough that every stream is mid-generation when a worker goes
PROMPTS = [[random.Random(300 + i).randrange(3, 49152) for _ in range(random.Random(i).randint(5, 40))]
           for i in range(9)]
STEP_TIMEOUT = 10  # seconds; the stopped worker's requests move after this (and far above a frozen moment)


class Fleet:
    def __init__(self, model: str, worker_args: tuple[str, ...] = (), scheduling_policy: str = "fcfs") -> None:
        self.model = model
        self.worker_args = worker_args  # every worker's extra flags
        self.scheduling_policy = scheduling_policy  # the scheduler's --scheduling-policy
        self.listen, self.worker_listen, self.metrics = (f"127.0.0.1:{free_port()}" for _ in range(3))
        self.scheduler = self.start_scheduler()
        self.workers: list[subprocess.Popen] = []

    def start_scheduler(self) -> subprocess.Popen:
        return subprocess.Popen([*EXE, "scheduler", "--model", self.model, "--listen", self.listen,
                                 "--worker-listen", self.worker_listen, "--metrics", self.metrics,
                                 "--max-num-batched-tokens", "64", "--step-timeout", str(STEP_TIMEOUT),
                                 "--scheduling-policy", self.scheduling_policy])

    def add_worker(self) -> subprocess.Popen:
        p = subprocess.Popen([*EXE, "worker", "--scheduler", self.worker_listen, "--model", self.model,
                              "--kv-memory", "2MiB", "--threads", "1", *EXACT, *self.worker_args])
        self.workers.append(p)
        return p

    def info(self):
        with grpc.insecure_channel(self.listen) as ch:
            return generate_pb2_grpc.GenerationStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=60)

    def pid_of(self, worker_id: str) -> int:
        return next(int(w.name.rsplit(":", 1)[1]) for w in self.info().workers if w.worker_id == worker_id)

    def name_of(self, worker_id: str) -> str:
        """The name the worker registered with (HOST:PID): its per-worker series' `worker` label."""
        return next(w.name for w in self.info().workers if w.worker_id == worker_id)

    def metric(self, name: str, **labels: str) -> float:
        return metric_value(scrape(self.metrics), name, **labels)

    def wait_workers(self, n: int, timeout: float = 120) -> list[str]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                ids = [w.worker_id for w in self.info().workers]
                if len(ids) == n:
                    return ids
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline, f"not {n} workers attached"
            time.sleep(0.1)

    def stop(self) -> None:
        for p in (*self.workers, self.scheduler):
            if p.poll() is None:
                try:
                    os.kill(p.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
                p.kill()
            p.wait()


class Streams:
    """Greedy streams in threads: tokens per stream, and the error of any that fails. NOTE: stream i is tenant
    t{i % 3}'s, and under the priority policy has priority i % 3: the policies' own paths run as workers go."""

    def __init__(self, fleet: Fleet, prompts, **sampling) -> None:
        self.sampling = pb.SamplingParams(**{"max_tokens": NEW, "temperature": 0, "ignore_eos": True, **sampling})
        self.priority = fleet.scheduling_policy == "priority"
        self.tokens = [[] for _ in prompts]
        self.logprobs = [[] for _ in prompts]  # each token's PositionLogprobs, when `sampling` asks for them
        self.errors: list = []
        self.threads = [threading.Thread(target=self._run, args=(fleet.listen, i, p)) for i, p in enumerate(prompts)]
        for t in self.threads:
            t.start()

    def _run(self, address: str, i: int, prompt) -> None:
        try:
            with grpc.insecure_channel(address) as ch:
                for msg in generate_pb2_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
                        prompt_token_ids=prompt, sampling=self.sampling, priority=i % 3 if self.priority else 0),
                        metadata=(("x-pagedserve-tenant", f"t{i % 3}"),), timeout=300):
                    self.tokens[i].extend(msg.token_ids)
                    self.logprobs[i].extend(msg.logprobs)
        except grpc.RpcError as e:
            self.errors.append((i, e.code(), e.details()))

    def wait_started(self, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while not all(self.tokens) and not self.errors:
            assert time.monotonic() < deadline, "streams did not start"
            time.sleep(0.01)

    def join(self) -> None:
        for t in self.threads:
            t.join(300)


@contextmanager
def fleet_of(model: str, num_workers: int, *worker_args: str, scheduling_policy: str = "fcfs") -> Iterator[Fleet]:
    """A scheduler and `num_workers` workers (with `worker_args`), all attached; stopped on exit."""
    f = Fleet(model, worker_args, scheduling_policy)
    try:
        for _ in range(num_workers):
            f.add_worker()
        f.wait_workers(num_workers)
        yield f
    finally:
        f.stop()


def busiest_worker(fleet: Fleet, worker_ids: list[str]) -> str:
    names = {w.worker_id: w.name for w in fleet.info().workers}
    return max(worker_ids, key=lambda w: fleet.metric("pagedserve_kv_blocks_used", worker=names[w]))


def kill_busiest(fleet: Fleet, worker_ids: list[str]) -> str:
    """kill -9 of the worker holding the most KV blocks, which holds requests mid-generation; returns its id.
    NOTE: the fleet is frozen while the victim is chosen, so a loaded machine cannot let the streams end first:
    the gauges stay those of each worker's last step."""
    frozen = [p for p in fleet.workers if p.poll() is None]
    for p in frozen:
        os.kill(p.pid, signal.SIGSTOP)
    try:
        victim = busiest_worker(fleet, worker_ids)
        held = fleet.metric("pagedserve_kv_blocks_used", worker=fleet.name_of(victim))
        assert held > 0  # it holds requests mid-generation
        os.kill(fleet.pid_of(victim), signal.SIGKILL)
    finally:
        for p in frozen:
            os.kill(p.pid, signal.SIGCONT)
    return victim


def streams_migrated_mid_way(fleet: Fleet, prompts: list[list[int]], worker_ids: list[str], **sampling) -> Streams:
    """Streams of `prompts` whose busiest worker is killed -9 once they have all started: asserts that they end
    without an error and that at least one migrated."""
    migrations = fleet.metric("pagedserve_migrations_total")
    moved = Streams(fleet, prompts, **sampling)
    moved.wait_started()
    kill_busiest(fleet, worker_ids)
    moved.join()
    assert moved.errors == []
    assert fleet.metric("pagedserve_migrations_total") > migrations
    return moved
