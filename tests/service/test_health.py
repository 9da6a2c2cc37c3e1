"""`pagedserve health` against real processes: exit 0 only when SERVING (and, with --worker, that host attached)."""

import os
import socket
import subprocess
import sys

import pytest

from pagedserve_cli.health_cmd import worker_attached
from pagedserve_common.ports import free_port

HEALTH = [sys.executable, "-m", "pagedserve_cli.main", "health"]


def health(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*HEALTH, *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


def test_serving_with_a_worker_attached(service):
    out = health("--server", service.address)
    assert (out.returncode, out.stdout.strip()) == (0, f"{service.address}: SERVING")
    assert health("--server", service.address, "--service", "pagedserve.v1.Generation").returncode == 0


def test_worker_flag_requires_a_worker_registered_from_that_host(service):
    # The test's worker process runs on this host, so it registered as HOSTNAME:PID.
    assert health("--server", service.address, "--worker", socket.gethostname()).returncode == 0
    out = health("--server", service.address, "--worker", "no-such-host")
    assert out.returncode == 1 and "no worker from no-such-host is attached" in out.stderr


def test_the_server_address_can_come_from_the_environment(service):
    assert health(env={"PAGEDSERVE_SERVER": service.address}).returncode == 0


def test_nothing_listening_is_unhealthy():
    out = health("--server", f"127.0.0.1:{free_port()}", "--timeout", "2")
    assert out.returncode == 1 and ("UNAVAILABLE" in out.stderr or "DEADLINE_EXCEEDED" in out.stderr)


def test_a_scheduler_without_workers_is_not_serving_configured_by_environment_alone(tiny_served_model):
    listen = f"127.0.0.1:{free_port()}"
    env = {"PAGEDSERVE_MODEL": tiny_served_model, "PAGEDSERVE_LISTEN": listen,
           "PAGEDSERVE_WORKER_LISTEN": f"127.0.0.1:{free_port()}", "PAGEDSERVE_METRICS": ""}
    sched = subprocess.Popen([sys.executable, "-m", "pagedserve_cli.main", "scheduler"],
                             env={**os.environ, **env}, stderr=subprocess.DEVNULL)
    try:
        for _ in range(600):  # until it answers at all (NOT_SERVING rather than UNAVAILABLE)
            out = health("--server", listen, "--timeout", "2")
            if "NOT_SERVING" in out.stderr or sched.poll() is not None:
                break
        assert sched.poll() is None, "the scheduler exited"
        assert (out.returncode, out.stderr.strip()) == (1, f"{listen}: NOT_SERVING")
    finally:
        sched.terminate()
        sched.wait(30)


@pytest.mark.parametrize("names, host, expected", [
    (["a1b2c3:7"], "a1b2c3", True), (["a1b2c3:7"], "a1b2c3:7", True), (["a1b2c3d:7"], "a1b2c3", False),
    ([], "a1b2c3", False)])
def test_worker_attached_matches_the_host_part(names, host, expected):
    class W:
        def __init__(self, name):
            self.name = name
    assert worker_attached([W(n) for n in names], host) is expected
