"""Service lifecycle with real processes: NOT_SERVING until a worker dials in, then a clean drain on SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc
from pagedserve_cli.up_cmd import core_shares
from scheduler_svc.errors import DRAINING
from scheduler_svc.server import LIVENESS
from pagedserve_common.ports import free_port
from tests.support.service import wait_until
from tests.support.processes import alive, children, stop_all, up


def health(address: str, service: str = ""):
    with grpc.insecure_channel(address) as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service), timeout=30).status


def test_not_serving_until_a_worker_attaches_then_drains_on_sigterm(tiny_served_model):
    listen, worker_listen = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    exe = [sys.executable, "-m", "pagedserve_cli.main"]
    sched = subprocess.Popen([*exe, "scheduler", "--model", tiny_served_model, "--listen", listen,
                              "--worker-listen", worker_listen, "--metrics", "", "--no-worker-timeout", "1"])
    worker = None
    try:
        not_serving = health_pb2.HealthCheckResponse.NOT_SERVING
        wait_until(lambda: health(listen) == not_serving)
        assert health(listen, "pagedserve.v1.Generation") == not_serving
        with grpc.insecure_channel(listen) as ch:
            try:
                list(generate_pb2_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(prompt="hi")))
                raise AssertionError("served without a worker")
            except grpc.RpcError as e:  # after waiting --no-worker-timeout for one
                assert (e.code(), e.details()) == (grpc.StatusCode.UNAVAILABLE, "no worker was attached for 1 s")
        worker = subprocess.Popen([*exe, "worker", "--scheduler", worker_listen, "--model", tiny_served_model,
                                   "--kv-memory", "4MiB"])
        wait_until(lambda: health(listen) == health_pb2.HealthCheckResponse.SERVING)
        sched.send_signal(signal.SIGTERM)
        assert sched.wait(timeout=120) == 0
        # The worker outlives the scheduler: it dials in again, with backoff, and attaches to the next one.
        sched = subprocess.Popen([*exe, "scheduler", "--model", tiny_served_model, "--listen", listen,
                                  "--worker-listen", worker_listen, "--metrics", ""])
        wait_until(lambda: health(listen) == health_pb2.HealthCheckResponse.SERVING)
        assert worker.poll() is None
        worker.send_signal(signal.SIGTERM)
        assert worker.wait(timeout=120) == 0  # and leaves at once on SIGTERM, with nothing to hand over
    finally:
        for p in (worker, sched):
            if p is not None and p.poll() is None:
                p.kill()


def test_liveness_is_serving_without_a_worker_and_while_draining(tiny_served_model):
    # What Kubernetes' probes ask (deploy/kubernetes): "" and the API say whether to send requests (readiness),
    # `liveness` whether the process is alive: a scheduler waiting for workers or finishing its streams is.
    listen = f"127.0.0.1:{free_port()}"
    exe = [sys.executable, "-m", "pagedserve_cli.main"]
    sched = subprocess.Popen([*exe, "scheduler", "--model", tiny_served_model, "--listen", listen,
                              "--worker-listen", f"127.0.0.1:{free_port()}", "--metrics", "",
                              "--no-worker-timeout", "300", "--drain-timeout", "300", "--max-queued-requests", "1"])
    serving, not_serving = health_pb2.HealthCheckResponse.SERVING, health_pb2.HealthCheckResponse.NOT_SERVING
    try:
        wait_until(lambda: health(listen, LIVENESS) == serving)
        assert (health(listen), health(listen, "pagedserve.v1.Generation")) == (not_serving, not_serving)
        with grpc.insecure_channel(listen) as ch:
            stub = generate_pb2_grpc.GenerationStub(ch)
            # One request waits for a worker, so the drain waits for it; it is in once the queue (one request) is
            # full. NOTE: should a probe get the slot first, that request was refused and is sent again.
            calls = [stub.Generate(pb.GenerateRequest(prompt="waits"))]

            def queue_full() -> bool:
                if calls[-1].done():
                    calls.append(stub.Generate(pb.GenerateRequest(prompt="waits")))
                    return False
                try:
                    list(stub.Generate(pb.GenerateRequest(prompt="probe"), timeout=5))
                except grpc.RpcError as e:
                    return e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                return False
            wait_until(queue_full)
            sched.send_signal(signal.SIGTERM)

            def refused_as_draining() -> bool:
                try:
                    list(stub.Generate(pb.GenerateRequest(prompt="late"), timeout=30))
                except grpc.RpcError as e:
                    return e.details() == DRAINING
                return False
            wait_until(refused_as_draining)
            assert health(listen, LIVENESS) == serving
            assert (health(listen), health(listen, "pagedserve.v1.Generation")) == (not_serving, not_serving)
            assert sched.poll() is None and not calls[-1].done()  # still draining
            calls[-1].cancel()
    finally:
        if sched.poll() is None:
            sched.kill()
        sched.wait(30)


@pytest.mark.parametrize("how", ["SIGTERM to up", "Ctrl-C to the process group"])
def test_up_runs_n_workers_as_processes_and_stops_them_all(tiny_served_model, tmp_path, how):
    listen = f"127.0.0.1:{free_port()}"
    with open(tmp_path / "stderr", "w") as err:
        proc = up(tiny_served_model, listen, "--workers", "2", stderr=err)
    try:
        line = proc.stdout.readline()
        assert line.startswith(f"pagedserve is up: {listen} (2 worker(s) on cpu"), line
        kids = children(proc.pid)
        assert len(kids) == 3  # one scheduler, two workers
        # The workers split the cores between them (disjoint while there are enough); the scheduler is free.
        cores = sorted(os.sched_getaffinity(0))
        pinned = sorted(sorted(os.sched_getaffinity(k)) for k in kids if sorted(os.sched_getaffinity(k)) != cores)
        if len(cores) >= 2:
            assert pinned == sorted(core_shares(cores, 2))
        with grpc.insecure_channel(listen) as ch:
            info = generate_pb2_grpc.GenerationStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=60)
            assert sorted(w.worker_id for w in info.workers) == ["worker-0", "worker-1"]
            msgs = list(generate_pb2_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
                prompt="hi", sampling=pb.SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)), timeout=60))
            assert sum(len(m.token_ids) for m in msgs) == 3
        if how == "SIGTERM to up":
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=120) == 0
        assert not [k for k in kids if alive(k)]
        assert "Traceback" not in (tmp_path / "stderr").read_text()
    finally:
        stop_all(proc)


def test_core_shares_split_without_oversubscribing():
    assert core_shares([0, 1], 1) == [[0, 1]]
    assert core_shares([0, 1], 2) == [[0], [1]]
    assert core_shares([0, 1, 2, 3, 4, 5, 6, 7], 3) == [[0, 1], [2, 3, 4], [5, 6, 7]]
    assert core_shares([4, 5], 3) == [[4], [5], [4]]  # more workers than cores: one core each, round robin


def test_up_stopped_during_start_up_leaves_no_process_behind(tiny_served_model):
    proc = up(tiny_served_model, f"127.0.0.1:{free_port()}")
    try:
        wait_until(lambda: len(children(proc.pid)) >= 2, interval=0.01)  # both started, not yet healthy
        kids = children(proc.pid)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
        assert proc.stdout.read() == ""  # it never claimed to be up
        assert not [k for k in kids if alive(k)]
    finally:
        stop_all(proc)
