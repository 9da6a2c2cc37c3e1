"""Real processes on loopback: a scheduler and 3 workers; kill -9, SIGSTOP, late workers, a restarted scheduler."""

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
import pytest

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc
from tests.service.conftest import free_port, metric_value, scrape
from tests.support.worker import assert_same_greedy, reference_greedy, reference_model

EXE = [sys.executable, "-m", "pagedserve_cli.main"]
NEW = 160  # long enough that every stream is mid-generation when a worker goes
PROMPTS = [[random.Random(300 + i).randrange(3, 49152) for _ in range(random.Random(i).randint(5, 40))]
           for i in range(9)]
STEP_TIMEOUT = 10  # seconds; the stopped worker's requests move after this (and far above a frozen moment)


class Fleet:
    def __init__(self, model: str) -> None:
        self.model = model
        self.listen, self.worker_listen, self.metrics = (f"127.0.0.1:{free_port()}" for _ in range(3))
        self.scheduler = self.start_scheduler()
        self.workers: list[subprocess.Popen] = []

    def start_scheduler(self) -> subprocess.Popen:
        return subprocess.Popen([*EXE, "scheduler", "--model", self.model, "--listen", self.listen,
                                 "--worker-listen", self.worker_listen, "--metrics", self.metrics,
                                 "--max-num-batched-tokens", "64", "--step-timeout", str(STEP_TIMEOUT)])

    def add_worker(self) -> subprocess.Popen:
        p = subprocess.Popen([*EXE, "worker", "--scheduler", self.worker_listen, "--model", self.model,
                              "--kv-memory", "2MiB", "--threads", "1"])
        self.workers.append(p)
        return p

    def info(self):
        with grpc.insecure_channel(self.listen) as ch:
            return generate_pb2_grpc.GenerationStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=60)

    def pid_of(self, worker_id: str) -> int:
        return next(int(w.name.rsplit(":", 1)[1]) for w in self.info().workers if w.worker_id == worker_id)

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
    """Greedy streams in threads: tokens per stream, and the error of any that fails."""

    def __init__(self, fleet: Fleet, prompts, **sampling) -> None:
        self.sampling = pb.SamplingParams(**{"max_tokens": NEW, "temperature": 0, "ignore_eos": True, **sampling})
        self.tokens = [[] for _ in prompts]
        self.errors: list = []
        self.threads = [threading.Thread(target=self._run, args=(fleet.listen, i, p)) for i, p in enumerate(prompts)]
        for t in self.threads:
            t.start()

    def _run(self, address: str, i: int, prompt) -> None:
        try:
            with grpc.insecure_channel(address) as ch:
                for msg in generate_pb2_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
                        prompt_token_ids=prompt, sampling=self.sampling), timeout=300):
                    self.tokens[i].extend(msg.token_ids)
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
def fleet_of(model: str, num_workers: int) -> Iterator[Fleet]:
    """A scheduler and `num_workers` workers, all attached; stopped on exit."""
    f = Fleet(model)
    try:
        for _ in range(num_workers):
            f.add_worker()
        f.wait_workers(num_workers)
        yield f
    finally:
        f.stop()


@pytest.fixture(scope="module")
def fleet(tiny_served_model):
    with fleet_of(tiny_served_model, 3) as f:
        yield f


@pytest.fixture(scope="module")
def reference(tiny_served_model):
    model = reference_model(tiny_served_model)
    return [reference_greedy(model, p, NEW) for p in PROMPTS]


def busiest_worker(fleet: Fleet, worker_ids: list[str]) -> str:
    return max(worker_ids, key=lambda w: fleet.metric("pagedserve_kv_blocks_used", worker=w))


def kill_busiest(fleet: Fleet, worker_ids: list[str]) -> str:
    """kill -9 of the worker holding the most KV blocks, which holds requests mid-generation; returns its id.
    NOTE: the fleet is frozen while the victim is chosen, so a loaded machine cannot let the streams end first:
    the gauges stay those of each worker's last step."""
    frozen = [p for p in fleet.workers if p.poll() is None]
    for p in frozen:
        os.kill(p.pid, signal.SIGSTOP)
    try:
        victim = busiest_worker(fleet, worker_ids)
        assert fleet.metric("pagedserve_kv_blocks_used", worker=victim) > 0  # it holds requests mid-generation
        os.kill(fleet.pid_of(victim), signal.SIGKILL)
    finally:
        for p in frozen:
            os.kill(p.pid, signal.SIGCONT)
    return victim


def test_kill_9_of_a_worker_mid_generation_loses_no_stream(fleet, reference):
    ids = fleet.wait_workers(3)
    streams = Streams(fleet, PROMPTS)
    streams.wait_started()
    victim = kill_busiest(fleet, ids)
    streams.join()
    assert streams.errors == []
    for got, ref in zip(streams.tokens, reference):
        assert_same_greedy(got, *ref)
    assert fleet.metric("pagedserve_migrations_total") > 0
    assert len(fleet.wait_workers(2)) == 2
    # Per-worker series carry the worker's id.
    assert all(fleet.metric("pagedserve_step_seconds_count", worker=w) > 0 for w in ids if w != victim)


def test_a_stopped_worker_loses_its_requests_after_the_step_timeout_then_comes_back(fleet, reference):
    ids = fleet.wait_workers(2)
    streams = Streams(fleet, PROMPTS)
    streams.wait_started()
    victim = busiest_worker(fleet, ids)
    pid = fleet.pid_of(victim)
    os.kill(pid, signal.SIGSTOP)  # hung: its TCP connection stays up, it just never answers
    try:
        streams.join()
    finally:
        os.kill(pid, signal.SIGCONT)
    assert streams.errors == []
    for got, ref in zip(streams.tokens, reference):
        assert_same_greedy(got, *ref)
    # Resumed, it finds its stream ended and registers again, with an empty pool and a new id.
    again = fleet.wait_workers(2)
    assert victim not in again
    assert sorted(int(w.name.rsplit(":", 1)[1]) for w in fleet.info().workers) == \
        sorted(p.pid for p in fleet.workers if p.poll() is None)


def test_a_worker_attached_later_takes_traffic(fleet, reference):
    before = set(fleet.wait_workers(2))
    fleet.add_worker()
    late = sorted(set(fleet.wait_workers(3)) - before)
    assert len(late) == 1 and fleet.metric("pagedserve_step_seconds_count", worker=late[0]) == 0
    streams = Streams(fleet, PROMPTS)
    streams.join()
    assert streams.errors == []
    for got, ref in zip(streams.tokens, reference):
        assert_same_greedy(got, *ref)
    assert fleet.metric("pagedserve_step_seconds_count", worker=late[0]) > 0


def test_workers_dial_in_again_to_a_restarted_scheduler(fleet, reference):
    fleet.wait_workers(3)
    fleet.scheduler.kill()
    fleet.scheduler.wait()
    fleet.scheduler = fleet.start_scheduler()
    assert len(fleet.wait_workers(3)) == 3  # every living worker registered with the new scheduler
    assert sorted(int(w.name.rsplit(":", 1)[1]) for w in fleet.info().workers) == \
        sorted(p.pid for p in fleet.workers if p.poll() is None)
    streams = Streams(fleet, PROMPTS[:3])
    streams.join()
    assert streams.errors == []
    for got, ref in zip(streams.tokens, reference[:3]):
        assert_same_greedy(got, *ref)


def test_sigterm_to_a_worker_hands_its_work_over_and_it_exits_0(fleet, reference):
    ids = fleet.wait_workers(3)
    streams = Streams(fleet, PROMPTS)
    streams.wait_started()
    victim = busiest_worker(fleet, ids)
    proc = next(p for p in fleet.workers if p.pid == fleet.pid_of(victim))
    proc.send_signal(signal.SIGTERM)  # it announces it leaves; its queue moves, its running requests finish
    assert proc.wait(timeout=120) == 0
    streams.join()
    assert streams.errors == []
    for got, ref in zip(streams.tokens, reference):
        assert_same_greedy(got, *ref)
    assert victim not in fleet.wait_workers(2)
