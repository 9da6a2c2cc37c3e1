"""The metrics port's HTTP server (--metrics): the registry as Prometheus text, from threads, with its cost bounded.

NOTE: prometheus_client's start_http_server keeps a thread per connection for as long as the peer holds it (1,017
idle connections took the scheduler to its descriptor limit) and prints a traceback for every reset one. Here a
connection gets READ_TIMEOUT seconds per read, at most MAX_CONNECTIONS are served at once (more are closed at once
without an answer), and a failed connection is one log line (counted, once per interval)."""

from __future__ import annotations

import socket
import sys
import threading
from wsgiref.simple_server import WSGIRequestHandler, make_server

import structlog
from prometheus_client import CollectorRegistry, make_wsgi_app
from prometheus_client.exposition import ThreadingWSGIServer

from pagedserve_common.descriptors import EveryInterval

log = structlog.get_logger("pagedserve.metrics")

READ_TIMEOUT = 10.0  # seconds a connection may take for each read (its request, or the next one on keep-alive)
MAX_CONNECTIONS = 64  # served at once: scrapers are few


class _Handler(WSGIRequestHandler):
    timeout = READ_TIMEOUT  # NOTE: socketserver.StreamRequestHandler sets it on the connection's socket

    def log_message(self, format, *args) -> None:  # noqa: A002 - the base class's signature
        pass


class MetricsServer(ThreadingWSGIServer):
    """A thread per connection, at most `max_connections` at once; errors logged as one line each interval."""

    daemon_threads = True
    max_connections = MAX_CONNECTIONS

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self._lock = threading.Lock()
        self.num_active = 0  # connections being served now (NOTE: under _lock)
        self.errors = EveryInterval()
        self.num_refused = 0

    def _take_slot(self) -> bool:
        with self._lock:
            if self.num_active >= self.max_connections:
                return False
            self.num_active += 1
            return True

    def _free_slot(self) -> None:
        with self._lock:
            self.num_active -= 1

    def process_request(self, request, client_address) -> None:
        if not self._take_slot():  # NOTE: on the accepting thread: closed before any read
            self.num_refused += 1
            self.errors.note("over the cap", lambda count: log.warning(
                "metrics connections refused: the cap is reached", cap=self.max_connections, count=count))
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._free_slot()
            raise

    def process_request_thread(self, request, client_address) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._free_slot()

    def handle_error(self, request, client_address) -> None:
        """One line (not socketserver's traceback) per kind of failure and interval: a reset, a timeout."""
        error = sys.exc_info()[1]
        kind = type(error).__name__
        self.errors.note(kind, lambda count: log.info("metrics connection failed", error=kind, count=count,
                                                      detail=str(error)[:200]))


def serve(host: str, port: int, registry: CollectorRegistry, read_timeout: float = READ_TIMEOUT,
          max_connections: int = MAX_CONNECTIONS) -> MetricsServer:
    """Serves `registry` on HOST:PORT from a daemon thread, in the classic text format whatever the scraper asks for.
    NOTE: prometheus_client 0.26's OpenMetrics output (what Prometheus asks for first) writes
    vllm:num_requests_waiting's samples as vllm_num_requests_waiting while its TYPE line keeps the colon
    (prometheus/client_python#1177): Prometheus would store every vllm: series under another name than the endpoint
    picker and vLLM's dashboards read. Raises OSError when the port is taken."""
    app = make_wsgi_app(registry)

    def classic(environ, start_response):
        environ.pop("HTTP_ACCEPT", None)
        return app(environ, start_response)

    family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)[0][0]
    server_class = type("FamilyMetricsServer", (MetricsServer,), {"address_family": family,
                                                                  "max_connections": max_connections})
    handler_class = type("TimedHandler", (_Handler,), {"timeout": read_timeout})
    httpd = make_server(host, port, classic, server_class, handler_class=handler_class)
    threading.Thread(target=httpd.serve_forever, name="metrics", daemon=True).start()
    return httpd
