"""Service lifecycle with real processes: NOT_SERVING until a worker dials in, then a clean drain on SIGTERM."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc
from tests.service.conftest import free_port


def health(address: str, service: str = ""):
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status


def wait_until(cond, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            if cond():
                return
        except grpc.RpcError:
            pass
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.1)


def test_not_serving_until_a_worker_attaches_then_drains_on_sigterm(tiny_served_model):
    listen, worker_listen = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    exe = [sys.executable, "-m", "pagedserve_cli.main"]
    sched = subprocess.Popen([*exe, "scheduler", "--model", tiny_served_model, "--listen", listen,
                              "--worker-listen", worker_listen, "--metrics", ""])
    worker = None
    try:
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        wait_until(lambda: health(listen) == not_serving)
        assert health(listen, "pagedserve.v1.Generation") == not_serving
        with grpc.insecure_channel(listen) as ch:
            try:
                list(generate_pb2_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(prompt="hi")))
                raise AssertionError("served without a worker")
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE
        worker = subprocess.Popen([*exe, "worker", "--scheduler", worker_listen, "--model", tiny_served_model,
                                   "--kv-memory", "4MiB"])
        wait_until(lambda: health(listen) == health_pb2.HealthCheckResponse.SERVING)
        sched.send_signal(signal.SIGTERM)
        assert sched.wait(timeout=60) == 0
        assert worker.wait(timeout=60) == 0  # the worker leaves by itself once the scheduler is gone
    finally:
        for p in (worker, sched):
            if p is not None and p.poll() is None:
                p.kill()
