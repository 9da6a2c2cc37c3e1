"""Structured output's grammar state survives what a sample lives through: constrained greedy streams that are
preempted (recomputed), and one whose worker is killed mid-way (recomputed on the other), equal the undisturbed
streams token for token and match their schema. A scheduler and two workers of the default model, tiny KV pools."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time

import grpc
import jsonschema
import pytest

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc
from pagedserve_common.ports import free_port
from tests.support.service import EXACT, metric_value, scrape
from tests.support.network import default_model_dir

EXE = [sys.executable, "-m", "pagedserve_cli.main"]
# Exactly 24 numbers: ~50-75 tokens, long enough to be mid-way when disturbed, short enough to always complete.
SCHEMA = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 24, "maxItems": 24}
MAX_TOKENS = 120
# NOTE: random ids and a salt each: no prefix is shared, so two streams on one worker need 2 x ~6 blocks of its 10
PROMPTS = [[random.Random(900 + i).randrange(3, 49152) for _ in range(40)] for i in range(4)]
KV_MEMORY = str(10 * 16 * 46080)  # 10 blocks of 16 tokens (30 layers x K,V x 3 kv heads x 64 x 4 bytes a token)
STEP_TIMEOUT = 10


class Fleet:
    def __init__(self) -> None:
        self.model = str(default_model_dir())
        self.listen, self.worker_listen, self.metrics = (f"127.0.0.1:{free_port()}" for _ in range(3))
        self.procs = [subprocess.Popen([*EXE, "scheduler", "--model", self.model, "--listen", self.listen,
                                        "--worker-listen", self.worker_listen, "--metrics", self.metrics,
                                        "--max-num-batched-tokens", "64", "--step-timeout", str(STEP_TIMEOUT)])]
        self.workers = [subprocess.Popen([*EXE, "worker", "--scheduler", self.worker_listen, "--model", self.model,
                                          "--kv-memory", KV_MEMORY, "--threads", "1", *EXACT]) for _ in range(2)]

    def info(self):
        with grpc.insecure_channel(self.listen) as ch:
            return generate_pb2_grpc.GenerationStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=60)

    def wait_workers(self, n: int, timeout: float = 180) -> list[str]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                if len(ids := [w.worker_id for w in self.info().workers]) == n:
                    return ids
            except grpc.RpcError:
                pass
            assert time.monotonic() < deadline, f"not {n} workers attached"
            time.sleep(0.1)

    def pid_of(self, worker_id: str) -> int:
        return next(int(w.name.rsplit(":", 1)[1]) for w in self.info().workers if w.worker_id == worker_id)

    def metric(self, name: str, **labels: str) -> float:
        return metric_value(scrape(self.metrics), name, **labels)

    def stop(self) -> None:
        for p in (*self.workers, *self.procs):
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
            p.wait()


class Stream(threading.Thread):
    """One constrained greedy stream over gRPC: its tokens and text as they arrive, and its end."""

    def __init__(self, small_pool_fleet: Fleet, i: int) -> None:
        super().__init__()
        self.fleet, self.i = small_pool_fleet, i
        self.tokens: list[int] = []
        self.text = ""
        self.finish_reason = None
        self.error = None
        self.start()

    def run(self) -> None:
        try:
            with grpc.insecure_channel(self.fleet.listen) as ch:
                for msg in generate_pb2_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
                        prompt_token_ids=PROMPTS[self.i], cache_salt=f"s{self.i}-{time.monotonic_ns()}",
                        sampling=pb.SamplingParams(max_tokens=MAX_TOKENS, temperature=0, structured_output=(
                            pb.StructuredOutput(json_schema=json.dumps(SCHEMA))))), timeout=600):
                    self.tokens.extend(msg.token_ids)
                    self.text += msg.text
                    self.finish_reason = msg.finish_reason or self.finish_reason
        except grpc.RpcError as e:
            self.error = (e.code(), e.details())

    def result(self) -> tuple[list[int], str]:
        self.join(600)
        assert self.error is None and self.finish_reason == pb.FINISH_REASON_STOP, (self.error, self.text)
        jsonschema.validate(json.loads(self.text), SCHEMA)
        return self.tokens, self.text


@pytest.fixture(scope="module")
def small_pool_fleet():
    f = Fleet()
    try:
        f.wait_workers(2)
        yield f
    finally:
        f.stop()


@pytest.fixture(scope="module")
def undisturbed(small_pool_fleet) -> list[tuple[list[int], str]]:
    """Each stream alone on the fleet: nothing preempts or moves it."""
    before = small_pool_fleet.metric("pagedserve_preemptions_total")
    out = [Stream(small_pool_fleet, i).result() for i in range(len(PROMPTS))]
    assert small_pool_fleet.metric("pagedserve_preemptions_total") == before
    return out


def test_preempted_constrained_streams_equal_the_undisturbed_ones(small_pool_fleet, undisturbed):
    before = small_pool_fleet.metric("pagedserve_preemptions_total")
    # at least two share a worker: ~12 blocks of its 10
    streams = [Stream(small_pool_fleet, i) for i in range(len(PROMPTS))]
    assert [s.result() for s in streams] == undisturbed
    assert small_pool_fleet.metric("pagedserve_preemptions_total") > before


def test_a_constrained_stream_whose_worker_is_killed_mid_way_equals_the_undisturbed_one(small_pool_fleet, undisturbed):
    ids = small_pool_fleet.wait_workers(2)
    stream = Stream(small_pool_fleet, 0)
    deadline = time.monotonic() + 300
    while len(stream.tokens) < 10:  # mid-way: inside the array
        assert stream.error is None and stream.is_alive() and time.monotonic() < deadline, stream.error
        time.sleep(0.01)
    # NOTE: frozen while the victim is chosen, so that the stream cannot end first on a loaded machine
    for p in small_pool_fleet.workers:
        os.kill(p.pid, signal.SIGSTOP)
    try:
        names = {w.worker_id: w.name for w in small_pool_fleet.info().workers}  # NOTE: the metrics' worker label
        victim = max(ids, key=lambda w: small_pool_fleet.metric("pagedserve_kv_blocks_used", worker=names[w]))
        assert small_pool_fleet.metric("pagedserve_kv_blocks_used", worker=names[victim]) > 0
        os.kill(small_pool_fleet.pid_of(victim), signal.SIGKILL)
    finally:
        for p in small_pool_fleet.workers:
            if p.poll() is None:
                os.kill(p.pid, signal.SIGCONT)
    assert stream.result() == undisturbed[0]
    assert small_pool_fleet.metric("pagedserve_migrations_total") > 0
