"""`pagedserve up` as a supervisor: it restarts a child that dies and stops them in order (scheduler, then workers)."""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading

import grpc
import pytest

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc
from pagedserve_cli.main import build_parser
from pagedserve_cli.serve_cmd import parse_device, scheduler_policy_argv
from pagedserve_cli.up_cmd import describe_exit, restart_delay, worker_devices
from pagedserve_common.startup import StartupError
from pagedserve_common.ports import free_port
from tests.support.service import wait_until
from tests.support.processes import alive, children, stop_all, up


def cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode().split("\0")
    except FileNotFoundError:  # gone already
        return []


def role(pid: int) -> str:
    """'scheduler' or 'worker': the subcommand a child of `up` runs ('' for a zombie, whose cmdline is empty)."""
    args = cmdline(pid)
    return args[args.index("pagedserve_cli.main") + 1] if "pagedserve_cli.main" in args else ""


def num_workers(listen: str) -> int:
    with grpc.insecure_channel(listen) as ch:
        return len(generate_pb2_grpc.GenerationStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=5).workers)


def generate(listen: str, max_tokens: int) -> int:
    with grpc.insecure_channel(listen) as ch:
        msgs = generate_pb2_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
            prompt="hi", sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)),
            timeout=60)
        return sum(len(m.token_ids) for m in msgs)


def test_a_killed_worker_is_logged_and_restarted(tiny_served_model, tmp_path):
    listen = f"127.0.0.1:{free_port()}"
    log = tmp_path / "stderr"
    with open(log, "w") as err:
        proc = up(tiny_served_model, listen, "--workers", "2", stderr=err)
    try:
        line = proc.stdout.readline()
        assert line.startswith(f"pagedserve is up: {listen} (2 worker(s)"), line
        kids = children(proc.pid)
        workers = [k for k in kids if role(k) == "worker"]
        assert len(workers) == 2 and len(kids) == 3
        victim = workers[1]
        os.kill(victim, signal.SIGKILL)

        wait_until(lambda: "died (killed by SIGKILL); restarting" in log.read_text())
        text = log.read_text()
        assert f"(pid {victim}) died (killed by SIGKILL); restarting" in text, text
        wait_until(lambda: len([k for k in children(proc.pid) if role(k) == "worker" and k not in kids]) == 1)
        wait_until(lambda: num_workers(listen) == 2, timeout=120)
        assert proc.poll() is None  # one child dying does not take `up` down
        assert not alive(victim)
        assert generate(listen, 3) == 3
        all_kids = set(kids) | set(children(proc.pid))

        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=120) == 0
        assert not [k for k in all_kids if alive(k)]
        text = log.read_text()
        said = [e["event"] for e in map(json.loads, text.splitlines()) if e["process"] == "up"]
        assert said.index("draining the scheduler") < said.index("stopping workers")
        assert "Traceback" not in text
    finally:
        stop_all(proc)


def test_children_have_their_own_sessions_and_die_with_up(tiny_served_model):
    proc, kids = up(tiny_served_model, f"127.0.0.1:{free_port()}", "--workers", "2"), []
    try:
        assert proc.stdout.readline().startswith("pagedserve is up")
        kids = children(proc.pid)
        assert len(kids) == 3
        assert all(os.getsid(k) == k for k in kids)  # Ctrl-C in the terminal reaches only `up`
        os.kill(proc.pid, signal.SIGKILL)  # no ordered stop: PR_SET_PDEATHSIG sends each child SIGTERM
        proc.wait(timeout=10)
        wait_until(lambda: not [k for k in kids if alive(k)], timeout=90)
    finally:
        for k in kids:
            if alive(k):
                os.kill(k, signal.SIGKILL)
        stop_all(proc)


def test_sigterm_to_up_lets_streams_in_flight_finish(tiny_served_model, tmp_path):
    listen = f"127.0.0.1:{free_port()}"
    with open(tmp_path / "stderr", "w") as err:
        proc = up(tiny_served_model, listen, "--workers", "2", stderr=err)
    try:
        assert proc.stdout.readline().startswith(f"pagedserve is up: {listen}")
        kids = children(proc.pid)
        n, max_tokens = 6, 40
        first_token = [threading.Event() for _ in range(n)]
        tokens, errors = [0] * n, [None] * n

        def stream(i: int) -> None:
            try:
                with grpc.insecure_channel(listen) as ch:
                    for m in generate_pb2_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
                            prompt=f"stream {i}", sampling=pb.SamplingParams(
                                max_tokens=max_tokens, temperature=0, ignore_eos=True)), timeout=120):
                        tokens[i] += len(m.token_ids)
                        if tokens[i]:
                            first_token[i].set()
            except grpc.RpcError as e:
                errors[i] = e
            finally:
                first_token[i].set()

        threads = [threading.Thread(target=stream, args=(i,)) for i in range(n)]
        for t in threads:
            t.start()
        for e in first_token:
            assert e.wait(timeout=120)
        proc.send_signal(signal.SIGTERM)
        for t in threads:
            t.join(timeout=120)
        assert proc.wait(timeout=120) == 0
        assert errors == [None] * n
        assert tokens == [max_tokens] * n
        assert not [k for k in kids if alive(k)]
    finally:
        stop_all(proc)


def test_worker_devices_round_robin_over_the_gpus():
    assert worker_devices("cuda", 3, 2) == ["cuda:0", "cuda:1", "cuda:0"]
    assert worker_devices("cuda", 2, 4) == ["cuda:0", "cuda:1"]
    assert worker_devices("cuda", 2, 1) == ["cuda:0", "cuda:0"]
    assert worker_devices("cuda:1", 3, 2) == ["cuda:1", "cuda:1", "cuda:1"]  # pinned
    assert worker_devices("cpu", 2, 8) == ["cpu", "cpu"]
    with pytest.raises(ValueError, match="no GPU"):
        worker_devices("cuda", 2, 0)


def test_restart_backoff_doubles_on_a_crash_loop_and_resets_after_a_long_life():
    delays, delay = [], 0.0
    for _ in range(8):
        delay = restart_delay(0.5, delay)
        delays.append(delay)
    assert delays == [1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0, 30.0]
    assert restart_delay(10.0, 30.0) == 0.0  # lived 10 s or more: at once
    assert restart_delay(3600.0, 0.0) == 0.0
    assert restart_delay(9.9, 0.0) == 1.0  # after a long life, a quick death starts the back-off over


def test_describe_exit():
    assert describe_exit(-9) == "killed by SIGKILL"
    assert describe_exit(-15) == "killed by SIGTERM"
    assert describe_exit(1) == "exit code 1"
    assert describe_exit(0) == "exit code 0"


def test_device_flag_accepts_cpu_cuda_and_cuda_n():
    good = ("cpu", "cuda", "cuda:0", "cuda:3", "cuda:auto")
    assert [parse_device(d) for d in good] == list(good)
    for bad in ("gpu", "cuda:", "cuda:x", "cuda:-1", "cpu:0", "CUDA", "cuda:AUTO"):
        with pytest.raises(argparse.ArgumentTypeError, match="cpu, cuda, cuda:N .* or cuda:auto"):
            parse_device(bad)
    for cmd in ("worker", "up"):
        with pytest.raises(SystemExit):
            build_parser().parse_args([cmd, "--device", "gpu"])
        assert build_parser().parse_args([cmd, "--device", "cuda:1"]).device == "cuda:1"


def test_up_forwards_only_the_scheduler_flags_given():
    args = build_parser().parse_args(["up"])
    assert scheduler_policy_argv(args) == []
    args = build_parser().parse_args(["up", "--routing", "round-robin", "--step-timeout", "5", "--max-migrations", "2",
                                      "--no-worker-timeout", "0", "--drain-timeout", "7.5"])
    argv = scheduler_policy_argv(args)
    assert argv == ["--routing", "round-robin", "--step-timeout", "5.0", "--max-migrations", "2",
                    "--no-worker-timeout", "0.0", "--drain-timeout", "7.5"]
    sched = build_parser().parse_args(["scheduler", *argv])
    assert (sched.routing, sched.step_timeout, sched.max_migrations, sched.no_worker_timeout, sched.drain_timeout) \
        == ("round-robin", 5.0, 2, 0.0, 7.5)
    sched = build_parser().parse_args(["scheduler"])
    assert (sched.routing, sched.step_timeout, sched.max_migrations, sched.no_worker_timeout, sched.drain_timeout) \
        == ("kv", 60.0, 3, 60.0, 30.0)


def test_gpu_kv_budget_never_exceeds_the_free_memory(monkeypatch):
    import torch

    from worker_svc import worker

    gib = 2**30
    state = {"free": 0, "total": 100 * gib, "peak": 10 * gib, "held": 8 * gib}  # weights 8, activations 2 GiB
    for name in ("synchronize", "reset_peak_memory_stats", "empty_cache"):
        monkeypatch.setattr(torch.cuda, name, lambda *a: None)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (state["free"], state["total"]))
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda *a: state["peak"])
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda *a: state["held"])

    def budget(free: int) -> int:
        state["free"] = free
        return worker._profile_kv_memory(lambda **kw: None, torch.device("cpu"), 0.9)

    # Alone on the GPU: 90 % of it less our peak.
    assert budget(92 * gib) == 90 * gib - 10 * gib
    # Another process holds 50 GiB: what is free, less the activations' room (2 GiB) and the headroom.
    assert budget(42 * gib) == 42 * gib - 2 * gib - worker.GPU_HEADROOM
    assert budget(1 * gib) == 0  # nothing to spare is no pool, never a negative one


def test_set_device_selects_the_gpu_and_rejects_a_missing_one(monkeypatch):
    import torch

    from worker_svc import worker

    chosen = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "set_device", chosen.append)
    worker.set_device("cpu")
    worker.set_device("cuda:1")
    worker.set_device("cuda")
    assert chosen == [1, 0]
    with pytest.raises(StartupError, match="--device cuda:2: 2 GPU"):  # one line naming the flag, exit code 2
        worker.set_device("cuda:2")
