"""Serves the HTTP app with uvicorn inside the scheduler's event loop (one process, one loop, one engine)."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import socket

import uvicorn

from pagedserve_common.startup import bind_failure, host_port
from scheduler_svc.http.connections import MAX_HEAD_BYTES, ConnectionLimits, GuardedH11Protocol
from scheduler_svc.listener import LISTEN_BACKLOG, Listener

KEEP_ALIVE_S = 5  # uvicorn's default: an idle keep-alive connection is closed after it


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        # NOTE: the scheduler owns SIGINT/SIGTERM: it drains (HTTP streams included) before it stops this server.
        yield


def parse_address(address: str) -> tuple[str, int]:
    host, port = host_port("--http", address)
    return host or "127.0.0.1", port


class HttpServer:
    """uvicorn on a socket bound here (so that a taken port fails the scheduler's start with a clear error)."""

    def __init__(self, app, address: str, limits: ConnectionLimits, ssl: tuple[str, str] | None = None) -> None:
        host, port = parse_address(address)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        try:
            bound = socket.create_server((host, port), family=family)
        except OSError as e:
            raise bind_failure("--http", address, e, off=True) from None
        self.socket = Listener.of(bound)
        self.address = address
        self.limits = limits
        certfile, keyfile = ssl or (None, None)  # HTTPS with the scheduler's --tls-cert/--tls-key
        # NOTE: uvicorn closes an idle keep-alive connection after timeout_keep_alive (5 s); the other bounds are
        # GuardedH11Protocol's
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off", ws="none",
                                http=functools.partial(GuardedH11Protocol, limits=limits), backlog=LISTEN_BACKLOG,
                                h11_max_incomplete_event_size=MAX_HEAD_BYTES, timeout_keep_alive=KEEP_ALIVE_S,
                                timeout_graceful_shutdown=1, ssl_certfile=certfile, ssl_keyfile=keyfile)
        self._server = _Server(config)
        self._task: asyncio.Task | None = None

    async def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._server.serve(sockets=[self.socket]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises why it could not start
                raise RuntimeError("the HTTP server stopped while starting")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._task is None:
            return
        self._server.should_exit = True
        await self._task
        self.socket.close()
