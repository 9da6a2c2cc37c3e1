"""The scheduler's listening side: the client API's and the worker port's gRPC servers (with their connection
bounds and per-peer gates), the HTTP front and the metrics port, built from the flags, started and stopped as one."""

from __future__ import annotations

from dataclasses import dataclass

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from pagedserve.v1 import generate_pb2, worker_pb2, worker_pb2_grpc
from pagedserve_common.config import DEFAULT_MAX_CONNECTIONS, MIN_PER_PEER, PER_PEER_SHARE, ConnectionOptions
from pagedserve_common.grpc_options import NO_PORT_SHARING, WORKER_SERVER_OPTIONS, receive_limit
from pagedserve_common.startup import bind_failure, host_port
from scheduler_svc import metrics_http
from scheduler_svc.auth import Access, add_port
from scheduler_svc.connection_gate import INTERNAL_HOST, UNIX_SCHEMES, ConnectionGate
from scheduler_svc.grpc.servicers import GenerationServicer, WorkerControlServicer, add_generation_servicer

log = structlog.get_logger("pagedserve.scheduler")

# NOTE: the spurious CANCELLED of a flood. grpc.aio picks up new calls one at a time from the event loop; until
# then grpc core holds them in a backlog, and past `grpc.server.max_pending_requests` (default 1000) it drops
# them at random (all of them past the hard limit, default 3000) by cancelling the stream: the client gets a bare
# CANCELLED and the servicer never runs, so nothing is logged. 1,500 calls at once lost 1-4% of them that way.
# Refusing is the engine's job (RESOURCE_EXHAUSTED past --max-queued-requests), so the backlog only has to hold a
# burst until the loop gets to it. It stays a bound on memory: a pending call holds about 15 KB (measured: 10,000
# of them, +150 MB), so this default costs at most ~250 MB under a flood 16 times the default queue.
MIN_PENDING_CALLS = 1 << 14


def pending_call_options(max_queued_requests: int) -> tuple[tuple[str, int], ...]:
    limit = max(MIN_PENDING_CALLS, 4 * max_queued_requests)
    return (("grpc.server.max_pending_requests", limit), ("grpc.server.max_pending_requests_hard_limit", limit))


# NOTE: the worker port's connection bounds. Workers are few, and each needs one connection with one stream (Attach,
# which lasts as long as the worker): these leave room for a large fleet and its reconnections, not for a flood.
MAX_WORKER_CONNECTIONS = 1024
MAX_WORKER_STREAMS = 16  # per connection
MAX_WORKER_RPCS = 1024
# A connection with no RPC this long gets a GOAWAY (clients reconnect on their next). NOTE: seconds, not minutes:
# idle connections are what a peer holds a port with (4,150 of them, kept 5 minutes, locked every client out).
IDLE_CONNECTION_MS = 15_000


# NOTE: a gRPC connection through a ConnectionGate holds three descriptors (the client's, the relay's, grpc's)
GATED_DESCRIPTORS = 3


@dataclass(slots=True, frozen=True)
class ConnectionCaps:
    """How many connections each port holds at once, and each peer on it (None: no per-peer cap, no gate)."""

    http: int
    grpc: int
    workers: int
    http_per_peer: int | None
    grpc_per_peer: int | None
    workers_per_peer: int | None

    @classmethod
    def of(cls, opts: ConnectionOptions, num_files: int) -> ConnectionCaps:
        """The flags', else shares of the open files limit `num_files`: a quarter each for the HTTP front and the
        client API, an eighth for the worker port, the rest for everything else (refusals under way, the
        tokenizer processes' pipes, model files, metrics); a gated port's share holds a third as many."""
        share = max(16, min(DEFAULT_MAX_CONNECTIONS, num_files // 4))
        gated = opts.max_connections_per_peer != 0
        per_descriptors = GATED_DESCRIPTORS if gated else 1
        http = opts.max_http_connections or share
        grpc_cap = opts.max_grpc_connections or max(16, share // per_descriptors)
        workers = max(8, min(MAX_WORKER_CONNECTIONS, num_files // 8 // per_descriptors))

        def per_peer(cap: int) -> int | None:
            if not gated:
                return None
            return opts.max_connections_per_peer or min(cap, max(MIN_PER_PEER, cap // PER_PEER_SHARE))

        return cls(http, grpc_cap, workers, per_peer(http), per_peer(grpc_cap), per_peer(workers))


def connection_options(max_connections: int, header_timeout: float) -> tuple[tuple[str, int], ...]:
    """grpc core's bounds on a port's connections. NOTE: beyond max_allowed_incoming_connections grpc accepts a
    connection and closes it at once; the handshake timeout closes one that never speaks HTTP/2 (or TLS); the
    idle timeout closes one with no RPC, never one with a stream open, however long (Generate, Attach)."""
    return (("grpc.max_allowed_incoming_connections", max_connections),
            ("grpc.server_handshake_timeout_ms", max(1, round(header_timeout * 1000))),
            ("grpc.max_connection_idle_ms", IDLE_CONNECTION_MS))


def serve_port(server: grpc.aio.Server, flag: str, address: str, credentials: grpc.ServerCredentials | None,
               max_connections: int, max_per_peer: int | None) -> ConnectionGate | None:
    """Listens on `address` for `server`: through a ConnectionGate (bound now, started with the server) when peers
    are capped and the address is TCP; else grpc listens there itself."""
    if max_per_peer is None or address.startswith(UNIX_SCHEMES):
        add_port(server, flag, address, credentials)
        return None
    gate = ConnectionGate.bind(flag, address, max_connections, max_per_peer)
    gate.grpc_port = add_port(server, flag, f"{INTERNAL_HOST}:0", credentials)
    return gate


@dataclass(slots=True)
class Ports:
    """Every listening server of one scheduler; `http` None without --http. NOTE: built (bound) before any starts,
    so that a taken port fails the start before anything serves."""

    clients: grpc.aio.Server
    workers: grpc.aio.Server
    client_gate: ConnectionGate | None
    worker_gate: ConnectionGate | None
    http: object | None  # scheduler_svc.http.server.HttpServer

    async def start(self) -> None:
        await self.workers.start()
        await self.clients.start()
        for gate in (self.worker_gate, self.client_gate):
            if gate is not None:
                await gate.start()
        if self.http is not None:
            await self.http.start()

    async def stop_clients(self, frontend) -> None:
        """The client APIs, after the drain: no new connection; the open ones end with grpc's."""
        if self.client_gate is not None:
            self.client_gate.close()
        await self.clients.stop(grace=1.0)
        frontend.pool.shutdown()
        if self.http is not None:
            await self.http.stop()


def client_server(caps: ConnectionCaps, access: Access, frontend, health, listen: str, max_message_size: int,
                  max_queued_requests: int, header_timeout: float) -> tuple[grpc.aio.Server, ConnectionGate | None]:
    """The client API (Generation, health, reflection) on --listen. NOTE: grpc refuses a message over
    max_message_size with RESOURCE_EXHAUSTED before the servicer (or the parser) sees it."""
    pending = pending_call_options(max_queued_requests)
    server = grpc.aio.server(options=(*NO_PORT_SHARING, *receive_limit(max_message_size),
                                      *pending, *connection_options(caps.grpc, header_timeout)),
                             interceptors=access.interceptors(),
                             maximum_concurrent_rpcs=pending[0][1])  # NOTE: beyond, RESOURCE_EXHAUSTED at once
    add_generation_servicer(GenerationServicer(frontend, access.api_keys), server)
    health_pb2_grpc.add_HealthServicer_to_server(health, server)
    reflection.enable_server_reflection(
        (generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name,
         health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), server)
    return server, serve_port(server, "--listen", listen, access.clients, caps.grpc, caps.grpc_per_peer)


def worker_server(caps: ConnectionCaps, access: Access, control: WorkerControlServicer, worker_listen: str,
                  header_timeout: float) -> tuple[grpc.aio.Server, ConnectionGate | None]:
    """The worker port (WorkerControl, reflection) on --worker-listen."""
    server = grpc.aio.server(options=(*WORKER_SERVER_OPTIONS, ("grpc.max_concurrent_streams", MAX_WORKER_STREAMS),
                                      *connection_options(caps.workers, header_timeout)),
                             maximum_concurrent_rpcs=MAX_WORKER_RPCS)
    worker_pb2_grpc.add_WorkerControlServicer_to_server(control, server)
    reflection.enable_server_reflection(
        (worker_pb2.DESCRIPTOR.services_by_name["WorkerControl"].full_name, reflection.SERVICE_NAME), server)
    gate = serve_port(server, "--worker-listen", worker_listen, access.workers, caps.workers, caps.workers_per_peer)
    control.original_peer = gate and gate.original_peer
    return server, gate


def http_server(caps: ConnectionCaps, access: Access, frontend, address: str, tool_call_parser: str,
                header_timeout: float, body_timeout: float):
    """The OpenAI-compatible HTTP front on --http (imported here: a scheduler without it never loads it)."""
    from scheduler_svc.http.app import create_app
    from scheduler_svc.http.connections import ConnectionLimits
    from scheduler_svc.http.server import HttpServer
    from scheduler_svc.peers import PeerCounts

    limits = ConnectionLimits(caps.http, header_timeout, body_timeout, PeerCounts(caps.http_per_peer))
    return HttpServer(create_app(frontend, access.api_keys, tool_call_parser), address, limits, ssl=access.http_ssl)


def start_metrics(address: str, registry) -> None:
    """The Prometheus port on --metrics (a thread of its own: scheduler_svc.metrics_http)."""
    host, port = host_port("--metrics", address)
    try:
        metrics_http.serve(host or "0.0.0.0", port, registry)
    except OSError as e:
        raise bind_failure("--metrics", address, e, off=True) from None
