"""`pagedserve up` without --worker-token-file makes a fresh worker token for its own children on every start (issue
50): its worker port is loopback, but loopback is every local user's, and a process that attaches as a worker reads
other clients' prompts and chooses their replies. Another Unix user cannot read the token, and a worker without it
(one written from the protos) is refused and gets no plan, while up's own worker serves."""

from __future__ import annotations

import os
import stat
import subprocess
from pathlib import Path

import grpc
import pytest

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc
from pagedserve_common.ports import free_port
from tests.support.fake_worker import FakeWorker, registration
from tests.support.processes import children, stop_all, up

NOBODY = 65534
NEW = 6


def flag_of(pid: int, flag: str) -> str:
    """The value of `flag` on process `pid`'s command line."""
    argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")
    return argv[argv.index(flag) + 1]


@pytest.fixture(scope="module")
def upped(tiny_served_model, tmp_path_factory):
    """`up` as a user starts it (no token flag), and its scheduler's pid."""
    log = tmp_path_factory.mktemp("up") / "stderr"
    listen = f"127.0.0.1:{free_port()}"
    with open(log, "w") as err:
        proc = up(tiny_served_model, listen, stderr=err)
    try:
        line = proc.stdout.readline()
        assert line.startswith(f"pagedserve is up: {listen}"), log.read_text()[-3000:]
        scheduler = next(pid for pid in children(proc.pid) if "scheduler" in Path(f"/proc/{pid}/cmdline").read_text())
        yield listen, scheduler, tiny_served_model
    finally:
        stop_all(proc)


def generate(listen: str) -> int:
    with grpc.insecure_channel(listen) as ch:
        msgs = generate_pb2_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
            prompt="The capital of France", sampling=pb.SamplingParams(max_tokens=NEW, temperature=0)), timeout=120)
        return sum(len(m.token_ids) for m in msgs)


def test_the_token_file_is_private_to_the_user_who_ran_up(upped):
    _, scheduler, _ = upped
    path = Path(flag_of(scheduler, "--worker-token-file"))
    assert stat.S_IMODE(path.stat().st_mode) == 0o600 and stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert path.stat().st_uid == os.geteuid()
    assert len(path.read_text().split()[-1]) >= 32  # the token: 32 random bytes, URL-safe base64
    if os.geteuid() == 0:  # NOTE: then another user is at hand: nobody cannot read it (root reads any file)
        out = subprocess.run(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "cat", str(path)],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode != 0 and "Permission denied" in out.stderr and not out.stdout, out


def test_a_worker_without_the_token_is_refused_and_gets_no_plan_while_ups_own_serve(upped):
    listen, scheduler, model = upped
    worker_listen = flag_of(scheduler, "--worker-listen")
    fake = FakeWorker(worker_listen, registration(model, name="intruder:1"))
    try:
        code, details = fake.ended()
        assert code == grpc.StatusCode.UNAUTHENTICATED and "no worker token" in details, (code, details)
        assert generate(listen) == NEW  # served by up's own worker
        assert fake.num_plans == 0
    finally:
        fake.close()
