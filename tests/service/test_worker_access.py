"""Worker authentication against real processes: a scheduler whose worker port is reachable refuses to start unless
its workers authenticate (or --insecure-workers); with --worker-token-file, fake workers written from the protos
without the token are refused with UNAUTHENTICATED and get no plan, while the real worker with it serves."""

from __future__ import annotations

import random
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc
from scheduler_svc.worker_auth import token_id
from pagedserve_common.ports import free_port
from tests.support.service import MAX_BATCHED, Service, start_worker, stop_processes, wait_until
from tests.support.fake_worker import FakeWorker, registration
from tests.support.processes import wait_for_line
from tests.support.worker import assert_same_greedy, reference_greedy, reference_model

EXE = [sys.executable, "-m", "pagedserve_cli.main"]
_rng = random.Random(23)
TOKEN = "worker-token-" + "".join(_rng.choices("abcdefghijklmnopqrstuvwxyz0123456789", k=32))
OLD_TOKEN = "old-token-" + "".join(_rng.choices("abcdefghijklmnopqrstuvwxyz0123456789", k=32))
WRONG_TOKEN = "wrong-token-" + TOKEN[::-1]
SECRETS = (TOKEN, OLD_TOKEN, WRONG_TOKEN)
PROMPT_IDS = [random.Random(5).randrange(3, 49152) for _ in range(24)]
NEW = 12


def scheduler_cmd(model: str, worker_listen: str, *extra: str) -> list[str]:
    return [*EXE, "scheduler", "--model", model, "--listen", f"127.0.0.1:{free_port()}", "--worker-listen",
            worker_listen, "--metrics", "", *extra]


def test_a_reachable_worker_port_without_worker_authentication_fails_the_start(tiny_served_model):
    port = free_port()
    out = subprocess.run(scheduler_cmd(tiny_served_model, f"0.0.0.0:{port}"), capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 2, out.stderr
    assert f"pagedserve scheduler: error: --worker-listen 0.0.0.0:{port} is not loopback-only" in out.stderr
    for what_to_do in ("--worker-token-file", "--tls-ca", "--insecure-workers"):
        assert what_to_do in out.stderr, out.stderr


def test_with_insecure_workers_it_starts_and_warns(tiny_served_model, tmp_path):
    log = tmp_path / "scheduler.log"
    with open(log, "wb") as err:
        proc = subprocess.Popen(scheduler_cmd(tiny_served_model, f"0.0.0.0:{free_port()}", "--insecure-workers"),
                                stderr=err)
    try:
        listening = wait_for_line(log, "scheduler listening", proc)
        assert '"worker_auth": "none (--insecure-workers)"' in listening, listening
        warning = wait_for_line(log, "authenticates no worker (--insecure-workers)", proc)
        assert '"level": "warning"' in warning, warning
    finally:
        stop_processes([proc])


@dataclass
class Gated(Service):
    logs: Path = Path()
    tokens: Path = Path()

    def start_worker(self, name: str, *extra: str) -> tuple[subprocess.Popen, Path]:
        log = self.logs / f"{name}.log"
        return start_worker(log, self.worker_listen, self.model_dir, *extra), log

    def worker_names(self) -> list[str]:
        with self.channel() as ch:
            info = generate_pb2_grpc.GenerationStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
        return [w.name for w in info.workers]

    def all_logs(self) -> str:
        return "".join(p.read_text(errors="replace") for p in sorted(self.logs.glob("*.log")))


@pytest.fixture(scope="module")
def gated(tiny_served_model, tmp_path_factory):
    """A scheduler on every interface with a token file of two tokens (a rotation under way), and a real worker
    holding the newer one."""
    from pagedserve_cli.up_cmd import wait_healthy

    logs, tokens = tmp_path_factory.mktemp("logs"), tmp_path_factory.mktemp("tokens")
    (tokens / "scheduler").write_text(f"# the scheduler's: the old token and the new one\n{OLD_TOKEN}\n{TOKEN}\n")
    (tokens / "worker").write_text(f"# this worker's\n{TOKEN}\n")
    (tokens / "wrong").write_text(f"{WRONG_TOKEN}\n")
    port = free_port()
    listen, metrics = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    with open(logs / "scheduler.log", "wb") as err:
        sched = subprocess.Popen([*EXE, "scheduler", "--model", tiny_served_model, "--listen", listen,
                                  "--worker-listen", f"0.0.0.0:{port}", "--metrics", metrics,
                                  "--max-num-batched-tokens", str(MAX_BATCHED),
                                  "--worker-token-file", str(tokens / "scheduler")], stderr=err)
    g = Gated(tiny_served_model, listen, metrics, [sched], "", f"127.0.0.1:{port}", logs, tokens)
    worker, _ = g.start_worker("worker", "--worker-token-file", str(tokens / "worker"))
    g.procs.insert(0, worker)  # NOTE: procs are [worker, scheduler], as Service.worker_paused expects
    try:
        wait_healthy(listen, 120, g.procs)
        yield g
    finally:
        stop_processes(g.procs)


def fake_worker(gated: Gated, name: str, metadata=()) -> FakeWorker:
    """A worker written from the protos (tests/support/fake_worker.py), registering as `name` with `metadata`."""
    return FakeWorker(gated.worker_listen, registration(gated.model_dir, name=name), metadata)


def generate(gated: Gated) -> list[int]:
    with gated.channel() as ch:
        msgs = list(generate_pb2_grpc.GenerationStub(ch).Generate(
            pb.GenerateRequest(prompt_token_ids=PROMPT_IDS, sampling=pb.SamplingParams(max_tokens=NEW, temperature=0)),
            timeout=120))
    return [t for m in msgs for t in m.token_ids]


def bearer(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


@pytest.mark.parametrize("metadata, why", [
    ((), "no worker token"), (bearer(WRONG_TOKEN), "invalid worker token"), ((("authorization", TOKEN),),
                                                                             "no worker token"),
    (bearer(TOKEN) + bearer(TOKEN), "more than one authorization")], ids=["none", "wrong", "no-scheme", "two"])
def test_a_fake_worker_without_a_valid_token_is_unauthenticated_and_gets_no_plan(gated, metadata, why):
    fake = fake_worker(gated, "evil:666", metadata)
    try:
        code, details = fake.ended()
        assert code == grpc.StatusCode.UNAUTHENTICATED, (code, details)
        assert why in details and all(s not in details for s in SECRETS)
        assert fake.num_plans == 0
        # An honest request meanwhile: served by the real worker alone, with its exact greedy tokens.
        assert_same_greedy(generate(gated), *reference_greedy(reference_model(gated.model_dir), PROMPT_IDS, NEW))
        assert gated.worker_names() != [] and "evil:666" not in gated.worker_names()
        assert gated.metric("pagedserve_workers") == 1
    finally:
        fake.close()


def test_the_same_fake_worker_with_a_token_of_the_file_attaches(gated):
    """The control: the refusals above are the token's doing (the old token of a rotation counts too)."""
    for token, name in ((OLD_TOKEN, "fake:1"), (TOKEN, "fake:2")):
        fake = fake_worker(gated, name, bearer(token))
        try:
            wait_until(lambda: name in gated.worker_names())
            assert fake.status is None  # attached, its stream still open
        finally:
            fake.close()
        wait_until(lambda: gated.worker_names() == [n for n in gated.worker_names() if not n.startswith("fake:")]
                   and gated.metric("pagedserve_workers") == 1)
    line = wait_for_line(gated.logs / "scheduler.log", '"name": "fake:2"', gated.procs[-1])
    assert "worker attached" in line and f'"token_id": "{token_id(TOKEN)}"' in line, line


def test_a_real_worker_without_the_token_keeps_dialling_and_says_why(gated):
    workers = [gated.start_worker("worker-no-token"),
               gated.start_worker("worker-wrong-token", "--worker-token-file", str(gated.tokens / "wrong"))]
    try:
        for (proc, log), why in zip(workers, ("no worker token", "invalid worker token")):
            line = wait_for_line(log, "waiting for the scheduler", proc)
            assert why in line and "--worker-token-file" in line, line  # the scheduler's reason, and a hint
            assert proc.poll() is None  # it keeps trying, with its backoff
        assert gated.metric("pagedserve_workers") == 1 and len(gated.worker_names()) == 1
    finally:
        stop_processes([p for p, _ in workers])


def test_the_log_names_peer_and_token_id_and_never_a_token(gated):
    fake = fake_worker(gated, "evil:667", bearer(WRONG_TOKEN))
    try:
        fake.ended()
    finally:
        fake.close()
    sched_log = gated.logs / "scheduler.log"
    listening = wait_for_line(sched_log, "scheduler listening", gated.procs[-1])
    assert '"worker_auth": "token"' in listening and '"worker_tokens": 2' in listening, listening
    attached = wait_for_line(sched_log, "worker attached", gated.procs[-1])  # the real worker's, first
    assert '"peer": "ipv4:127.0.0.1:' in attached and f'"token_id": "{token_id(TOKEN)}"' in attached, attached
    refused = wait_for_line(sched_log, "invalid worker token", gated.procs[-1])
    assert "worker refused" in refused and '"peer": "ipv4:127.0.0.1:' in refused and "UNAUTHENTICATED" in refused
    logs = gated.all_logs()
    for secret in SECRETS:
        assert secret not in logs


def test_up_gives_its_workers_the_token_of_a_reachable_worker_port(tiny_served_model, tmp_path):
    from tests.support.processes import stop_all, up

    (tmp_path / "worker-token").write_text(f"{TOKEN}\n")
    listen = f"127.0.0.1:{free_port()}"
    with open(tmp_path / "stderr", "w") as err:
        proc = up(tiny_served_model, listen, "--worker-listen", f"0.0.0.0:{free_port()}",
                  "--worker-token-file", str(tmp_path / "worker-token"), stderr=err)
    try:
        line = proc.stdout.readline()
        assert line.startswith(f"pagedserve is up: {listen} (1 worker(s)"), (tmp_path / "stderr").read_text()[-3000:]
        with grpc.insecure_channel(listen) as ch:
            msgs = list(generate_pb2_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
                prompt_token_ids=PROMPT_IDS, sampling=pb.SamplingParams(max_tokens=NEW, temperature=0)), timeout=120))
        assert sum(len(m.token_ids) for m in msgs) == NEW
    finally:
        stop_all(proc)
    log = (tmp_path / "stderr").read_text()
    assert f'"token_id": "{token_id(TOKEN)}"' in log and TOKEN not in log
