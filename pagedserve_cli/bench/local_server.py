"""`pagedserve scheduler` and one CPU worker on loopback, each logging to a file, and a wait until they are idle:
what bench/load.py runs its clients against, and what tests/service/test_storms.py storms."""

from __future__ import annotations

import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from pagedserve_common.ports import free_port


@dataclass
class LocalServer:
    """`pagedserve scheduler` and one CPU worker on loopback, each logging to a file in `log_dir`."""

    address: str
    metrics: str
    log_dir: Path
    procs: list = field(default_factory=list)  # [worker, scheduler]
    worker_listen: str = ""

    @property
    def scheduler_pid(self) -> int:
        return self.procs[-1].pid

    @property
    def scheduler_log(self) -> Path:
        return self.log_dir / "scheduler.log"

    @classmethod
    def start(cls, model_dir: str, log_dir: Path, scheduler_args=(), worker_args=(), timeout: float = 180,
              scheduler_preexec=None):
        """`scheduler_preexec`: run in the scheduler's process before it starts (e.g. to lower a resource limit)."""
        from pagedserve_cli.up_cmd import wait_healthy

        listen, worker_listen, metrics = (f"127.0.0.1:{free_port()}" for _ in range(3))
        exe = [sys.executable, "-m", "pagedserve_cli.main"]
        log_dir.mkdir(parents=True, exist_ok=True)
        server = cls(listen, metrics, log_dir, worker_listen=worker_listen)
        with open(log_dir / "scheduler.log", "wb") as slog, open(log_dir / "worker.log", "wb") as wlog:
            server.procs.append(subprocess.Popen(
                [*exe, "worker", "--scheduler", worker_listen, "--model", model_dir, "--threads", "1",
                 *worker_args], stderr=wlog))
            server.procs.append(subprocess.Popen(
                [*exe, "scheduler", "--model", model_dir, "--listen", listen, "--worker-listen", worker_listen,
                 "--metrics", metrics, "--http", "", *scheduler_args], stderr=slog, preexec_fn=scheduler_preexec))
        try:
            wait_healthy(listen, timeout, server.procs)
        except BaseException:
            server.stop()
            raise
        return server

    def stop(self) -> None:
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            try:
                p.wait(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()

    def error_lines(self) -> list[str]:
        """The scheduler's log lines at level error, and any traceback."""
        return [line for line in self.scheduler_log.read_text(errors="replace").splitlines()
                if '"level": "error"' in line or "Traceback" in line]


IDLE_SERIES = ("pagedserve_requests_running", "pagedserve_requests_waiting", "pagedserve_kv_blocks_used")


def wait_idle(read, timeout: float = 120) -> dict:
    """Polls `read(series name)` until no request runs or waits and no KV block is held (free or cached-free
    blocks only); returns the last reading, idle or not once `timeout` is over."""
    deadline = time.monotonic() + timeout
    while True:
        reading = {name: read(name) for name in IDLE_SERIES}
        if not any(reading.values()) or time.monotonic() > deadline:
            return reading
        time.sleep(0.5)
