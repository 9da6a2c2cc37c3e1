"""Serves the HTTP app with uvicorn inside the scheduler's event loop (one process, one loop, one engine)."""

from __future__ import annotations

import asyncio
import contextlib
import socket

import uvicorn


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self):
        # NOTE: the scheduler owns SIGINT/SIGTERM: it drains (HTTP streams included) before it stops this server.
        yield


def parse_address(address: str) -> tuple[str, int]:
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"--http: expected HOST:PORT, got {address!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


class HttpServer:
    """uvicorn on a socket bound here (so that a taken port fails the scheduler's start with a clear error)."""

    def __init__(self, app, address: str, ssl: tuple[str, str] | None = None) -> None:
        host, port = parse_address(address)
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.socket = socket.create_server((host, port), family=family)
        self.address = address
        certfile, keyfile = ssl or (None, None)  # HTTPS with the scheduler's --tls-cert/--tls-key
        config = uvicorn.Config(app, log_config=None, access_log=False, lifespan="off", http="h11", ws="none",
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
