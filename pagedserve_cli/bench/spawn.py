"""Starts a private `pagedserve up` (scheduler + one worker on free loopback ports) for one side of a benchmark."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from pagedserve_common.ports import free_port

STOP_TIMEOUT_S = 60.0


@dataclass(slots=True)
class SpawnConfig:
    """What every side of a comparison shares: the model, its dtype and the worker's KV budget."""

    model: str
    dtype: str = "auto"
    kv_memory: str | None = None
    max_model_len: int | None = None
    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    threads: int | None = None
    speculative: str | None = None  # --speculative (None: the server's default)
    num_speculative_tokens: int | None = None
    startup_timeout: float = 600.0
    http: bool = False  # also serve the OpenAI-compatible HTTP API (Spawned.http)


@dataclass(slots=True)
class Spawned:
    """A running `pagedserve up`; its output goes to `log_path` (shown when start-up fails)."""

    proc: subprocess.Popen
    address: str
    metrics: str
    log_path: str
    argv: list[str] = field(default_factory=list)
    http: str = ""  # HOST:PORT of the HTTP API, when SpawnConfig.http

    @property
    def openai_url(self) -> str:
        return f"http://{self.http}/v1"

    def stop(self) -> int:
        """SIGTERM (up drains, then stops its children), SIGKILL after a minute; returns the exit status."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return self.proc.returncode

    def log_tail(self, num_chars: int = 4000) -> str:
        try:
            with open(self.log_path, encoding="utf-8", errors="replace") as f:
                return f.read()[-num_chars:]
        except OSError:
            return ""


def up_argv(cfg: SpawnConfig, listen: str, worker_listen: str, metrics: str, extra: list[str],
            http: str = "") -> list[str]:
    """The `pagedserve up` command line of one side: `extra` carries what the side changes (e.g. its
    --kv-allocation); `http` is the HTTP API's address ("" for none)."""
    argv = [sys.executable, "-m", "pagedserve_cli.main", "up", "--model", cfg.model, "--dtype", cfg.dtype,
            "--listen", listen, "--worker-listen", worker_listen, "--metrics", metrics, "--http", http,
            "--startup-timeout", str(cfg.startup_timeout)]
    for flag, value in (("--kv-memory", cfg.kv_memory), ("--max-model-len", cfg.max_model_len),
                        ("--max-num-seqs", cfg.max_num_seqs), ("--max-num-batched-tokens", cfg.max_num_batched_tokens),
                        ("--threads", cfg.threads), ("--speculative", cfg.speculative),
                        ("--num-speculative-tokens", cfg.num_speculative_tokens)):
        if value is not None:
            argv += [flag, str(value)]
    return argv + extra


def spawn(cfg: SpawnConfig, extra: list[str], name: str) -> Spawned:
    """Starts `pagedserve up` and returns once it serves with its worker attached (RuntimeError otherwise)."""
    from pagedserve_cli.up_cmd import wait_healthy

    address, metrics = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    http = f"127.0.0.1:{free_port()}" if cfg.http else ""
    argv = up_argv(cfg, address, f"127.0.0.1:{free_port()}", metrics, extra, http)
    log = tempfile.NamedTemporaryFile("w", prefix=f"pagedserve-bench-{name}-", suffix=".log", delete=False)
    # NOTE: its own process group, so a Ctrl-C of the bench reaches it only through stop().
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    log.close()
    side = Spawned(proc, address, metrics, log.name, argv, http)
    try:
        wait_healthy(address, cfg.startup_timeout, [proc])
    except (RuntimeError, TimeoutError) as e:
        side.stop()
        raise RuntimeError(f"{name}: `pagedserve up` did not start ({e}); its log:\n{side.log_tail()}") from None
    except BaseException:
        side.stop()
        raise
    time.sleep(0.1)
    return side
