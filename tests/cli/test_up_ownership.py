"""`up` knows its own children (issue 48): it refuses to start on a port that is taken (another `up`), its health wait
counts only the scheduler that answers with its nonce, and that scheduler refuses a worker of another `up`.

Real processes on loopback over a tiny Llama; every timeout is a hang guard, never a measure of speed."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc
from pagedserve_cli.up_cmd import NotOurScheduler, wait_healthy
from pagedserve_common.config import UP_NONCE_METADATA, UP_NONCE_VARIABLE
from scheduler_svc.worker_auth import OTHER_UP, other_up
from pagedserve_cli.bench.tiny_model import save_tiny_served_model
from tests.support.service import EXACT, KV_MEMORY, stop_processes, wait_until
from tests.support.fake_worker import FakeWorker, registration
from tests.support.processes import alive, children, free_port, stop_all, up, wait_for_line

EXE = [sys.executable, "-m", "pagedserve_cli.main"]
NONCE, OTHER_NONCE = "a1" * 16, "b2" * 16  # this scheduler's `up`, and another `up`
WAIT = 120  # seconds: a hang guard only


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> str:
    return save_tiny_served_model(tmp_path_factory.mktemp("tiny-served"))


def env_with(nonce: str | None) -> dict[str, str]:
    """This process's environment, with `up`'s nonce variable set to `nonce` (None: unset, as by hand)."""
    env = {k: v for k, v in os.environ.items() if k != UP_NONCE_VARIABLE}
    return env if nonce is None else {**env, UP_NONCE_VARIABLE: nonce}


@dataclass
class Scheduler:
    proc: subprocess.Popen
    listen: str
    worker_listen: str
    log: Path

    def worker_names(self) -> list[str]:
        with grpc.insecure_channel(self.listen) as ch:
            info = generate_pb2_grpc.GenerationStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        return [w.name for w in info.workers]


@contextmanager
def scheduler(model: str, log: Path, nonce: str | None) -> Iterator[Scheduler]:
    """A `pagedserve scheduler` as `up` starts it (with `nonce`), or as by hand (None), its stderr in `log`."""
    listen, worker_listen = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    with open(log, "wb") as err:
        proc = subprocess.Popen([*EXE, "scheduler", "--model", model, "--listen", listen, "--worker-listen",
                                 worker_listen, "--metrics", ""], stderr=err, env=env_with(nonce))
    try:
        wait_for_line(log, "scheduler listening", proc, timeout=WAIT)
        yield Scheduler(proc, listen, worker_listen, log)
    finally:
        stop_processes([proc])


def start_worker(model: str, sched: Scheduler, log: Path, nonce: str | None) -> subprocess.Popen:
    """A real `pagedserve worker` dialling `sched`, as `up` starts it (with `nonce`) or as by hand (None)."""
    with open(log, "wb") as err:
        return subprocess.Popen([*EXE, "worker", "--scheduler", sched.worker_listen, "--model", model, "--kv-memory",
                                 str(KV_MEMORY), "--threads", "1", *EXACT], stderr=err, env=env_with(nonce))


@pytest.fixture(scope="module")
def owned(tiny_model, tmp_path_factory) -> Iterator[Scheduler]:
    """A scheduler started with NONCE (as by `up`), and a worker started by hand (no nonce) attached to it."""
    logs = tmp_path_factory.mktemp("owned")
    with scheduler(tiny_model, logs / "scheduler.log", NONCE) as sched:
        worker = start_worker(tiny_model, sched, logs / "worker.log", None)
        try:
            assert wait_healthy(sched.listen, WAIT, [sched.proc, worker])
            yield sched
        finally:
            stop_processes([worker])


def held_port() -> tuple[socket.socket, str]:
    """A plain listening socket on a free loopback port (as another server holds it), and its HOST:PORT."""
    s = socket.socket()
    s.bind(("127.0.0.1", free_port()))
    s.listen()
    return s, f"127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("flag", ["--listen", "--worker-listen", "--http", "--metrics"])
def test_up_on_a_taken_port_exits_1_naming_the_flag_and_port_before_starting_anything(tmp_path, flag):
    holder, taken = held_port()
    ports = {f: f"127.0.0.1:{free_port()}" for f in ("--listen", "--worker-listen", "--http", "--metrics")}
    ports[flag] = taken
    try:
        # NOTE: a model that does not exist: the port is checked first, before the model pull and any child
        out = subprocess.run([*EXE, "up", "--model", str(tmp_path / "no-model-needed"), "--device", "cpu",
                              *[a for f, address in ports.items() for a in (f, address)]],
                             capture_output=True, text=True, timeout=WAIT, env=env_with(None))
    finally:
        holder.close()
    (line,) = out.stderr.splitlines()  # JSON (stderr is not a terminal), and up's own line alone: no child spoke
    said = json.loads(line)
    assert out.returncode == 1 and (said["process"], said["level"]) == ("up", "error"), out.stderr
    assert said["event"].startswith(f"{flag} {taken} is in use (another pagedserve up?"), said
    assert out.stdout == ""


def test_a_second_up_exits_1_and_leaves_the_first_serving(tiny_model, tmp_path):
    listen, worker_listen, http = (f"127.0.0.1:{free_port()}" for _ in range(3))
    same = ("--worker-listen", worker_listen, "--http", http)  # NOTE: tests.support.processes.up picks these anew
    with open(tmp_path / "first.err", "w") as err:
        first = up(tiny_model, listen, *same, stderr=err)
    try:
        assert first.stdout.readline().startswith(f"pagedserve is up: {listen}"), \
            (tmp_path / "first.err").read_text()[-3000:]
        kids = children(first.pid)
        with open(tmp_path / "second.err", "w") as err:
            second = up(tiny_model, listen, *same, stderr=err)
        try:
            assert second.wait(timeout=WAIT) == 1
            assert second.stdout.read() == ""  # never `pagedserve is up`
        finally:
            stop_all(second)
        said = [json.loads(line) for line in (tmp_path / "second.err").read_text().splitlines()]
        assert [e["process"] for e in said] == ["up"], said  # it started no child
        assert said[-1]["event"].startswith(f"--listen {listen} is in use"), said
        assert wait_healthy(listen, WAIT, [first])  # the first still serves, with its own worker
        assert all(alive(k) for k in kids) and set(children(first.pid)) == set(kids)  # and restarted nothing
    finally:
        stop_all(first)


def test_the_health_wait_counts_only_the_scheduler_with_its_nonce(owned):
    assert wait_healthy(owned.listen, WAIT, [owned.proc], up_nonce=NONCE)
    with pytest.raises(NotOurScheduler, match=f"{owned.listen} is answered by a server this `up` did not start"):
        wait_healthy(owned.listen, WAIT, [owned.proc], up_nonce=OTHER_NONCE)
    assert wait_healthy(owned.listen, WAIT, [owned.proc])  # a caller without a nonce (tests, bench) as before


def test_a_scheduler_started_by_hand_is_not_ups_either(tiny_model, tmp_path):
    """It answers with no nonce: not up's, serving or not (this one has no worker: NOT_SERVING)."""
    with scheduler(tiny_model, tmp_path / "scheduler.log", None) as sched:
        with pytest.raises(NotOurScheduler):
            wait_healthy(sched.listen, WAIT, [sched.proc], up_nonce=NONCE)


def test_a_real_worker_of_another_up_is_refused_and_exits_saying_why(owned, tiny_model, tmp_path):
    worker = start_worker(tiny_model, owned, tmp_path / "worker.log", OTHER_NONCE)
    try:
        assert worker.wait(timeout=WAIT) == 1  # NOTE: no endless dialling in: a refusal retrying cannot change
    finally:
        stop_processes([worker])
    line = wait_for_line(tmp_path / "worker.log", "the scheduler refused this worker", worker)
    assert "FAILED_PRECONDITION" in line and "another `pagedserve up`" in line, line
    refused = wait_for_line(owned.log, "another `pagedserve up`", owned.proc)
    assert "worker refused" in refused and "FAILED_PRECONDITION" in refused, refused
    assert NONCE not in owned.log.read_text() and OTHER_NONCE not in line
    assert len(owned.worker_names()) == 1  # the hand-started worker alone


@pytest.mark.parametrize("metadata, attaches", [
    (((UP_NONCE_METADATA, NONCE),), True), ((), True), (((UP_NONCE_METADATA, OTHER_NONCE),), False),
    (((UP_NONCE_METADATA, NONCE), (UP_NONCE_METADATA, OTHER_NONCE)), False)],
    ids=["its-own-up", "by-hand", "another-up", "two-nonces"])
def test_a_worker_attaches_with_its_schedulers_nonce_or_none(owned, tiny_model, metadata, attaches):
    name = f"fake:{len(metadata)}{attaches}"
    fake = FakeWorker(owned.worker_listen, registration(tiny_model, name=name), metadata)
    try:
        if attaches:
            wait_until(lambda: name in owned.worker_names(), timeout=WAIT)
            assert fake.status is None  # attached, its stream open
        else:
            code, details = fake.ended()
            assert (code, details) == (grpc.StatusCode.FAILED_PRECONDITION, OTHER_UP)
            assert fake.num_plans == 0 and name not in owned.worker_names()
    finally:
        fake.close()
    wait_until(lambda: not [n for n in owned.worker_names() if n.startswith("fake:")], timeout=WAIT)


def test_other_up_refuses_only_a_worker_of_another_up():
    assert other_up(NONCE, [NONCE]) is None and other_up(NONCE, [NONCE.encode()]) is None
    assert other_up(NONCE, []) is None  # started by hand
    assert other_up(None, [OTHER_NONCE]) is None  # a scheduler started by hand: as before
    assert other_up(NONCE, [OTHER_NONCE]) == OTHER_UP and other_up(NONCE, [NONCE, NONCE]) == OTHER_UP
