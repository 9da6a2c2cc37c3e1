"""Start-up failures of real `pagedserve scheduler`, `worker` and `up` processes: one line on stderr naming the flag
or path and what to do, exit code 1 (the environment refused) or 2 (a usage error), never a traceback."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import sys

import pytest

from pagedserve_common.ports import free_port

EXE = [sys.executable, "-m", "pagedserve_cli.main"]
PORT_FLAGS = ("--http", "--listen", "--worker-listen", "--metrics")


def failure(out: subprocess.CompletedProcess, command: str) -> str:
    """The one line that is not a JSON log line (those may come before it: `open files limit`), as its message."""
    assert "Traceback" not in out.stderr, out.stderr
    plain = [line for line in out.stderr.splitlines() if not line.startswith("{")]
    assert len(plain) == 1, out.stderr
    prefix = f"pagedserve {command}: error: "
    assert plain[0].startswith(prefix), out.stderr
    return plain[0].removeprefix(prefix)


def scheduler(model: str, *args: str) -> subprocess.CompletedProcess:
    ports = {flag: f"127.0.0.1:{free_port()}" for flag in PORT_FLAGS}
    for flag, value in zip(args[::2], args[1::2]):
        ports.pop(flag, None)
    argv = [a for flag, address in ports.items() for a in (flag, address)]
    return subprocess.run([*EXE, "scheduler", "--model", model, *argv, *args], capture_output=True, text=True,
                          timeout=300)


@pytest.fixture
def taken():
    """HOST:PORT of a port another process listens on."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", free_port()))
        s.listen()
        yield "127.0.0.1:%d" % s.getsockname()[1]


@pytest.mark.parametrize("flag", PORT_FLAGS)
def test_a_taken_port_names_its_flag_and_address(tiny_served_model, taken, flag):
    out = scheduler(tiny_served_model, flag, taken)
    assert out.returncode == 1
    instead = f"pass another {flag} HOST:PORT" + (", or '' for none" if flag in ("--http", "--metrics") else "")
    assert failure(out, "scheduler") == f"{flag} {taken}: address already in use ({instead})"


def test_a_grpc_port_another_grpc_server_holds_is_refused_not_shared(tiny_served_model):
    """NOTE: gRPC's SO_REUSEPORT would let two schedulers share a port, each getting some of the connections."""
    import grpc

    server = grpc.server(thread_pool=None, options=(("grpc.so_reuseport", 1),))
    address = f"127.0.0.1:{server.add_insecure_port(f'127.0.0.1:{free_port()}')}"
    server.start()
    try:
        out = scheduler(tiny_served_model, "--listen", address)
    finally:
        server.stop(None)
    assert out.returncode == 1 and failure(out, "scheduler").startswith(f"--listen {address}: address already in use")


@pytest.mark.parametrize("args, message", [
    (["--listen", "127.0.0.1"], "--listen 127.0.0.1: expected HOST:PORT (a port 0-65535)"),
    (["--metrics", "127.0.0.1:70000"], "--metrics 127.0.0.1:70000: expected HOST:PORT (a port 0-65535)"),
    (["--max-num-seqs", "0"], "argument --max-num-seqs: expected an integer >= 1, got '0' (see `pagedserve "
                              "scheduler --help`)"),
    (["--bogus"], "unrecognized arguments: --bogus (see `pagedserve scheduler --help`)"),
])
def test_a_bad_flag_value_is_a_usage_error_naming_it(tiny_served_model, args, message):
    out = scheduler(tiny_served_model, *args)
    assert out.returncode == 2 and failure(out, "scheduler") == message


def test_a_model_directory_without_its_files_names_the_model(tiny_served_model, tmp_path):
    half = tmp_path / "half"
    half.mkdir()
    shutil.copy(f"{tiny_served_model}/config.json", half)  # a model directory, but no tokenizer nor weights
    out = scheduler(str(half))
    assert out.returncode == 1
    assert failure(out, "scheduler").startswith(f"--model {half}: cannot load its tokenizer (tokenizer.json) from")
    out = subprocess.run([*EXE, "worker", "--model", str(half), "--scheduler", f"127.0.0.1:{free_port()}"],
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 1
    assert failure(out, "worker").startswith(f"--model {half}: cannot load it from {half}: ")


def test_under_up_a_child_that_fails_to_start_ends_up_with_its_line(tiny_served_model, tmp_path):
    """Every line JSON naming its process (stderr is a pipe here), the last one up's, quoting the scheduler's.
    (A taken port is up's own check now: the scheduler fails on a malformed --tenant-weights file instead.)"""
    weights = tmp_path / "weights"
    weights.write_text("# tenant weight\nteam a 2\nteam-b 0\n")
    out = subprocess.run([*EXE, "up", "--model", tiny_served_model, "--http", f"127.0.0.1:{free_port()}",
                          "--listen", f"127.0.0.1:{free_port()}", "--worker-listen", f"127.0.0.1:{free_port()}",
                          "--metrics", "", "--tenant-weights", str(weights), "--scheduling-policy", "fair",
                          "--kv-memory", "4MiB", "--threads", "1"], capture_output=True, text=True, timeout=600)
    assert out.returncode == 1 and "Traceback" not in out.stderr, out.stderr
    lines = [json.loads(line) for line in out.stderr.splitlines()]
    assert {e["process"] for e in lines} <= {"up", "scheduler", "worker-0"}
    why = f"--tenant-weights {weights}:3: the weight must be > 0 and <= 1e+06, got 0"
    assert (lines[-1]["process"], lines[-1]["level"]) == ("up", "error")
    assert lines[-1]["event"] == f"scheduler exited during start-up (exit code 1): {why}"
    assert [e for e in lines if e["process"] == "scheduler" and e["level"] == "error"] == [
        {**lines[-1], "process": "scheduler", "event": f"pagedserve scheduler: error: {why}",
         "timestamp": next(e["timestamp"] for e in lines if e["process"] == "scheduler" and e["level"] == "error")}]
    assert out.stdout == ""  # never said it was up


def test_tenant_weights_need_the_fair_policy_and_a_well_formed_file(tiny_served_model, tmp_path):
    weights = tmp_path / "weights"
    weights.write_text("# tenant weight\nteam a 2\nteam-b 0\n")
    out = scheduler(tiny_served_model, "--tenant-weights", str(weights))
    assert out.returncode == 2 and failure(out, "scheduler") == (
        "--tenant-weights needs --scheduling-policy fair (not fcfs): only the fair policy counts tenants' shares")
    out = scheduler(tiny_served_model, "--tenant-weights", str(weights), "--scheduling-policy", "fair")
    assert out.returncode == 1
    assert failure(out, "scheduler") == f"--tenant-weights {weights}:3: the weight must be > 0 and <= 1e+06, got 0"
