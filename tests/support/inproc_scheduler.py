"""The real scheduler (scheduler_svc.server.serve) in this process, with real `pagedserve worker` processes, for
tests that read what it holds in memory (its spans: tests/service/test_tracing.py)."""

from __future__ import annotations

import asyncio
import os
import signal
import tempfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagedserve_cli.main import build_parser
from pagedserve_cli.serve_cmd import scheduler_config
from pagedserve_cli.up_cmd import wait_healthy
from pagedserve_common.ports import free_port
from tests.support.service import start_worker, stop_processes

MAX_BATCHED = 64


@dataclass
class InProcess:
    listen: str
    http: str
    worker_listen: str
    model_dir: str
    workers: list = field(default_factory=list)  # the worker processes, in the order they started
    logs: Path = field(default_factory=lambda: Path(tempfile.mkdtemp(prefix="inproc-workers-")))

    def start_worker(self):
        proc = start_worker(self.logs / f"worker-{len(self.workers)}.log", self.worker_listen, self.model_dir)
        self.workers.append(proc)
        return proc


def run(model_dir: str, body: Callable[[InProcess], Any], *extra: str, traces=None, num_workers: int = 1) -> Any:
    """Serves with the scheduler flags `extra` (and `traces`, a tracing.Tracing) and `num_workers` workers, runs
    body(server) in a thread once they are attached, then stops the scheduler as a signal does (SIGTERM to this
    process: serve() drains on it) and the workers. Returns what body returned."""
    server = InProcess(*(f"127.0.0.1:{free_port()}" for _ in range(3)), model_dir)
    args = build_parser().parse_args(["scheduler", "--model", model_dir, "--listen", server.listen, "--worker-listen",
                                      server.worker_listen, "--metrics", "", "--http", server.http,
                                      "--max-num-batched-tokens", str(MAX_BATCHED), *extra])
    from scheduler_svc.server import serve

    async def main() -> Any:
        ready = asyncio.Event()
        task = asyncio.get_running_loop().create_task(serve(scheduler_config(args, model_dir), ready, traces))
        waiter = asyncio.ensure_future(ready.wait())
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        if task.done():
            waiter.cancel()
            task.result()  # raises why it did not start
        try:
            for _ in range(num_workers):
                server.start_worker()
            await asyncio.to_thread(wait_healthy, server.listen, 180, server.workers, num_workers=num_workers)
            return await asyncio.to_thread(body, server)
        finally:
            await asyncio.to_thread(stop_processes, server.workers)  # NOTE: a leaving worker waits on serve()
            if not task.done():  # NOTE: else no handler is installed any more, and the signal would end pytest
                os.kill(os.getpid(), signal.SIGTERM)
            await task
    return asyncio.run(main())
