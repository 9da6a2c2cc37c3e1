"""The metrics port bounds what a peer costs (issue 50): idle connections are closed after the read timeout, at most
max_connections are served at once (the rest closed unanswered), and a reset connection is one log line, never a
traceback. prometheus_client's own server kept a thread per idle connection (1,017 of them: the scheduler at its
descriptor limit) and printed 17 lines per reset."""

from __future__ import annotations

import socket
import struct
import threading
import time

import httpx
from prometheus_client import CollectorRegistry, Counter

from pagedserve_common.ports import free_port
from scheduler_svc import metrics_http

WAIT = 60  # seconds: a hang guard only


def registry() -> CollectorRegistry:
    r = CollectorRegistry()
    Counter("pagedserve_test_things", "Things", registry=r).inc(3)
    return r


def scrape(port: int) -> str:
    return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=WAIT).text


def wait_until(condition) -> None:
    deadline = time.monotonic() + WAIT
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


def idle_connections(port: int, n: int) -> list[socket.socket]:
    return [socket.create_connection(("127.0.0.1", port), timeout=WAIT) for _ in range(n)]


def closed_by_server(s: socket.socket) -> bool:
    """Whether the server closed `s` (a read ends, or the connection was reset)."""
    try:
        return s.recv(1) == b""
    except ConnectionResetError:
        return True


def test_idle_connections_are_closed_after_the_read_timeout_and_scrapes_go_on():
    port = free_port()
    server = metrics_http.serve("127.0.0.1", port, registry(), read_timeout=10.0, max_connections=8)
    try:
        assert "pagedserve_test_things_total 3.0" in scrape(port)
        held = idle_connections(port, 8)  # every slot, sending nothing
        wait_until(lambda: server.num_active == 8)
        over = idle_connections(port, 4)  # past the cap: closed at once, unanswered
        assert all(closed_by_server(s) for s in over)
        assert server.num_refused >= 4
        assert all(closed_by_server(s) for s in held)  # the read timeout, not the peer, ended them
        assert "pagedserve_test_things_total 3.0" in scrape(port)  # the slots are free again
        threads = [t for t in threading.enumerate() if t.name != "metrics" and t.daemon]
        assert len(threads) < 16, threads
    finally:
        server.shutdown()
        server.server_close()
        for s in [*held, *over]:
            s.close()


def test_a_reset_connection_is_one_log_line_not_a_traceback(capfd):
    port = free_port()
    server = metrics_http.serve("127.0.0.1", port, registry(), read_timeout=5.0)
    try:
        for _ in range(5):
            s = socket.create_connection(("127.0.0.1", port), timeout=WAIT)
            s.sendall(b"GET /metrics HTTP/1.1\r\nHost: x\r\n")  # half a request head, then a reset
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            s.close()
        assert "pagedserve_test_things_total 3.0" in scrape(port)
        time.sleep(0.5)
        err = capfd.readouterr().err
        assert "Traceback" not in err, err
    finally:
        server.shutdown()
        server.server_close()
