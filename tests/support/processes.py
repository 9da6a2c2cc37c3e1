"""Helpers for tests that start `pagedserve` processes: `up`'s children, whether one is alive, stopping them all,
waiting for a log line."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from pagedserve_common.ports import free_port


def children(pid: int) -> list[int]:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
        return [int(c) for c in f.read().split()]


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def stop_all(proc: subprocess.Popen) -> None:
    """Cleanup after a failed assertion: no process outlives the test."""
    if proc.poll() is None:
        kids = children(proc.pid)
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
        for k in kids:
            if alive(k):
                os.kill(k, signal.SIGKILL)


def up(model: str, listen: str, *extra: str, stderr=None) -> subprocess.Popen:
    """`pagedserve up` with the tests' small pool, one thread and float32 weights (`auto` is bfloat16 on a CPU with
    AVX512-BF16 or AMX: the block counts and greedy tokens the tests assert are float32's on every CPU)."""
    # Its own session, like a shell job: Ctrl-C is SIGINT to the whole process group.
    return subprocess.Popen([sys.executable, "-m", "pagedserve_cli.main", "up", "--model", model, "--listen", listen,
                             "--worker-listen", f"127.0.0.1:{free_port()}", "--metrics", "",
                             "--http", f"127.0.0.1:{free_port()}", "--kv-memory", "4MiB", "--threads", "1",
                             "--dtype", "float32", *extra],
                            stdout=subprocess.PIPE, stderr=stderr, text=True, start_new_session=True)


def wait_for_line(log: Path, text: str, proc: subprocess.Popen, timeout: float = 180.0) -> str:
    """The first line of the file `log` holding `text`, polled for (a hang guard of `timeout` seconds); fails
    early when `proc`, which writes the log, exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in log.read_text(errors="replace").splitlines():
            if text in line:
                return line
        assert proc.poll() is None, f"exited {proc.returncode}: {log.read_text()[-2000:]}"
        time.sleep(0.2)
    raise AssertionError(f"no {text!r} in {log} after {timeout:.0f} s: {log.read_text()[-2000:]}")
