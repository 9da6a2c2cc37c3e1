"""Runs the scheduler service: the client API, the worker endpoint, health, reflection and metrics."""

from __future__ import annotations

import asyncio
import json
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import grpc
import structlog
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1._async import HealthServicer
from grpc_reflection.v1alpha import reflection

from pagedserve.v1 import generate_pb2, worker_pb2, worker_pb2_grpc
from pagedserve_common.config import (DEFAULT_MAX_CONNECTIONS, UP_NONCE_METADATA, UP_NONCE_VARIABLE, ConnectionOptions,
                                      SchedulerOptions)
from pagedserve_common.descriptors import AcceptErrors, raise_open_files_limit
from pagedserve_common.options import values
from pagedserve_common.startup import USAGE, StartupError, bind_failure, host_port, one_line
from scheduler_svc import gc_policy, metrics_http, tracing
from scheduler_svc.auth import Access, add_port
from scheduler_svc.connection_gate import INTERNAL_HOST, UNIX_SCHEMES, ConnectionGate
from scheduler_svc.core.waiting import read_tenant_weights
from scheduler_svc.engine import Engine, EngineConfig
from scheduler_svc.errors import ErrorCode
from scheduler_svc.metrics import Metrics
from scheduler_svc.grpc.servicers import GenerationServicer, WorkerControlServicer, add_generation_servicer
from scheduler_svc.frontend import FrontEnd, Tokenizer, model_defaults
from scheduler_svc.frontend.limits import Limits
from scheduler_svc.worker_auth import WorkerGate

log = structlog.get_logger("pagedserve.scheduler")
SERVICES = ("", "pagedserve.v1.Generation")  # SERVING iff a worker is attached and the scheduler is not draining
# NOTE: SERVING from start to exit, draining included: a liveness probe (Kubernetes' gRPC probe) asks for this name,
# so that a scheduler with no worker, or one finishing its streams, is not restarted.
LIVENESS = "liveness"


@dataclass(slots=True, kw_only=True)
class ServerConfig(SchedulerOptions):
    """`pagedserve scheduler`'s flags (the tree of pagedserve_common.config) and where its model is."""

    model_dir: str  # --model resolved to a local directory (its config.json and tokenizer)


def engine_config(cfg: ServerConfig, tokenizer: Tokenizer) -> EngineConfig:
    model = json.loads((Path(cfg.model_dir) / "config.json").read_text())
    max_len = int(model.get("max_position_embeddings", 2048))
    return EngineConfig(**values(cfg.engine), model_id=cfg.model,
                        max_model_len=min(cfg.max_model_len or max_len, max_len),
                        vocab_size=int(model["vocab_size"]), eos_token_ids=tokenizer.eos_token_ids)


class UpHealth(HealthServicer):
    """Health that names the `pagedserve up` that started this scheduler: its nonce (UP_NONCE_VARIABLE) in each
    Check's trailing metadata, so that up's health wait (pagedserve_cli.up_cmd.wait_healthy) tells its own scheduler
    from another one answering on the port (a second `up` would otherwise report the first's as its own)."""

    def __init__(self, up_nonce: str) -> None:
        super().__init__()
        self.up_nonce = up_nonce

    async def Check(self, request, context):
        context.set_trailing_metadata(((UP_NONCE_METADATA, self.up_nonce),))
        return await super().Check(request, context)


# NOTE: keepalive on the worker endpoint finds a dead peer (a killed host, a stopped process, a cut cable) in
# about KEEPALIVE_TIME + KEEPALIVE_TIMEOUT even while it has no step in flight; workers ping as well
# (worker_svc.client), so the server must accept pings that often.
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000
# NOTE: gRPC sets SO_REUSEPORT by default: a second scheduler on a taken port would start and share it silently
NO_PORT_SHARING = (("grpc.so_reuseport", 0),)
WORKER_SERVER_OPTIONS = (
    *NO_PORT_SHARING,
    ("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
    ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.max_receive_message_length", 64 << 20),
    ("grpc.max_send_message_length", 64 << 20),
)

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
PER_PEER_SHARE = 4  # one peer may hold a quarter of a port by default: one peer cannot hold it
# NOTE: ... and at least this many (or the whole of a smaller port): `up`'s workers all dial from one address, and
# one host's benchmark client may open dozens of HTTP connections
MIN_PER_PEER = 16


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


def input_limits(cfg: ServerConfig, max_model_len: int) -> Limits:
    """The client APIs' input bounds: those with a flag from it, the fixed ones from Limits."""
    return Limits.for_model(max_model_len, **values(cfg.limits))


async def serve(cfg: ServerConfig, ready: asyncio.Event | None = None, traces: tracing.Tracing | None = None) -> None:
    """Runs until SIGINT or SIGTERM, then drains. `traces`: a test's tracing (else --otlp-endpoint's, if given)."""
    a, net = cfg.access, cfg.network
    access = Access.load(a.tls_cert, a.tls_key, a.tls_ca, a.api_key_file)  # first: a bad file fails fast
    if cfg.engine.tenant_weights and cfg.engine.scheduling_policy != "fair":
        raise StartupError(f"--tenant-weights needs --scheduling-policy fair (not {cfg.engine.scheduling_policy}): "
                           f"only the fair policy counts tenants' shares", USAGE)
    try:
        weights = read_tenant_weights(cfg.engine.tenant_weights) if cfg.engine.tenant_weights else {}
    except ValueError as e:
        raise StartupError(str(e)) from None
    traces = traces or tracing.start(cfg.observability.otlp_endpoint, cfg.model)
    gate = WorkerGate.load(net.worker_listen, a.worker_token_file, access.mutual, a.insecure_workers)
    caps = ConnectionCaps.of(cfg.connections, raise_open_files_limit("scheduler"))
    asyncio.get_running_loop().set_exception_handler(AcceptErrors())
    try:
        tokenizer = Tokenizer.from_model_dir(cfg.model_dir)
    except Exception as e:  # NOTE: the tokenizers library raises a bare Exception for a missing or broken file
        raise StartupError(f"--model {cfg.model}: cannot load its tokenizer (tokenizer.json) from {cfg.model_dir}: "
                           f"{one_line(e)}") \
            from None
    if (template := model_defaults.chat_template(cfg.chat_template)) is not None:
        tokenizer.chat_template = template
    names = model_defaults.model_names(cfg.served_model_name, cfg.model)
    config = engine_config(cfg, tokenizer)
    engine = Engine(config, Metrics(names[0], config.max_model_len))
    engine.service.weights.update(weights)
    limits = input_limits(cfg, engine.config.max_model_len)
    frontend = FrontEnd(engine, tokenizer, limits, tracing=traces, model_names=names,
                        sampling_defaults=model_defaults.sampling_defaults(cfg.generation_config, cfg.model_dir),
                        fill_context_cap=model_defaults.fill_context_cap(cfg.generation_config, cfg.model_dir))
    up_nonce = os.environ.get(UP_NONCE_VARIABLE) or None  # set by `pagedserve up` alone
    health = UpHealth(up_nonce) if up_nonce else HealthServicer()
    for name in SERVICES:
        await health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
    await health.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)

    async def publish_serving() -> None:
        # NOTE: the status is read when this runs, not when it was scheduled: one scheduled before the drain began
        # must not set SERVING after it.
        status = health_pb2.HealthCheckResponse.SERVING if engine.workers and not engine.draining \
            else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in SERVICES:
            await health.set(name, status)

    engine.on_workers_changed = lambda num_workers: asyncio.get_running_loop().create_task(publish_serving())
    # NOTE: grpc refuses a larger message with RESOURCE_EXHAUSTED before the servicer (or the parser) sees it.
    pending = pending_call_options(cfg.engine.max_queued_requests)
    clients = grpc.aio.server(options=(*NO_PORT_SHARING, ("grpc.max_receive_message_length", limits.max_message_size),
                                       *pending,
                                       *connection_options(caps.grpc, cfg.connections.header_timeout)),
                              interceptors=access.interceptors(),
                              maximum_concurrent_rpcs=pending[0][1])  # NOTE: beyond, RESOURCE_EXHAUSTED at once
    add_generation_servicer(GenerationServicer(frontend, access.api_keys), clients)
    health_pb2_grpc.add_HealthServicer_to_server(health, clients)
    reflection.enable_server_reflection(
        (generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name,
         health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME), clients)
    client_gate = serve_port(clients, "--listen", net.listen, access.clients, caps.grpc, caps.grpc_per_peer)
    workers = grpc.aio.server(options=(*WORKER_SERVER_OPTIONS, ("grpc.max_concurrent_streams", MAX_WORKER_STREAMS),
                                       *connection_options(caps.workers, cfg.connections.header_timeout)),
                              maximum_concurrent_rpcs=MAX_WORKER_RPCS)
    control = WorkerControlServicer(engine, gate.tokens, up_nonce)
    worker_pb2_grpc.add_WorkerControlServicer_to_server(control, workers)
    reflection.enable_server_reflection(
        (worker_pb2.DESCRIPTOR.services_by_name["WorkerControl"].full_name, reflection.SERVICE_NAME), workers)
    worker_gate = serve_port(workers, "--worker-listen", net.worker_listen, access.workers, caps.workers,
                             caps.workers_per_peer)
    control.original_peer = worker_gate and worker_gate.original_peer
    if net.metrics:
        host, port = host_port("--metrics", net.metrics)
        try:
            metrics_http.serve(host or "0.0.0.0", port, engine.metrics.registry)
        except OSError as e:
            raise bind_failure("--metrics", net.metrics, e, off=True) from None
    http = None
    if net.http:
        from scheduler_svc.http.app import create_app
        from scheduler_svc.http.connections import ConnectionLimits
        from scheduler_svc.http.server import HttpServer
        from scheduler_svc.peers import PeerCounts

        http = HttpServer(create_app(frontend, access.api_keys, cfg.tool_call_parser), net.http, ConnectionLimits(
            caps.http, cfg.connections.header_timeout, cfg.connections.body_timeout, PeerCounts(caps.http_per_peer)),
            ssl=access.http_ssl)
    await workers.start()
    await clients.start()
    for port_gate in (worker_gate, client_gate):
        if port_gate is not None:
            await port_gate.start()
    if http is not None:
        await http.start()
    gc_policy.settle()  # NOTE: start-up is done: what it left alive is frozen, never walked by a collection again
    log.info("scheduler listening", listen=net.listen, worker_listen=net.worker_listen, http=net.http,
             metrics=net.metrics, model=cfg.model, tls=access.clients is not None, mutual_tls=access.mutual,
             api_keys=len(access.api_keys or ()), worker_auth=gate.auth, worker_tokens=len(gate.tokens or ()),
             max_http_connections=caps.http if net.http else None, max_grpc_connections=caps.grpc,
             max_worker_connections=caps.workers, max_connections_per_peer=caps.grpc_per_peer,
             otlp_endpoint=cfg.observability.otlp_endpoint)
    if gate.insecure:
        log.warning("the worker port is reachable from other hosts and authenticates no worker "
                    "(--insecure-workers): whoever reaches it can attach as a worker and receive prompts",
                    worker_listen=net.worker_listen)
    elif access.workers is not None and not access.mutual and gate.tokens is None:
        log.warning("the worker port asks no client certificate (no --tls-ca): whoever reaches it can attach "
                    "as a worker and receive prompts", worker_listen=net.worker_listen)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready.set()
    await stop.wait()
    # Drain: refuse new requests (UNAVAILABLE), let running ones finish, then stop.
    engine.draining = True
    # NOTE: not health.enter_graceful_shutdown(), which would set LIVENESS to NOT_SERVING too: a liveness probe
    # would then restart a scheduler that is finishing its streams.
    await publish_serving()
    log.info("draining", unfinished=engine.num_unfinished, timeout_s=cfg.engine.drain_timeout)
    deadline = loop.time() + cfg.engine.drain_timeout
    while engine.num_unfinished and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if engine.num_unfinished:
        log.warning("drain timeout: ending the unfinished requests", unfinished=engine.num_unfinished)
        engine.fail_all(ErrorCode.UNAVAILABLE, f"the server shut down: the request did not finish within the "
                                               f"{cfg.engine.drain_timeout:g} s drain timeout")
    if client_gate is not None:
        client_gate.close()  # NOTE: no new connection; the open ones end with grpc's
    await clients.stop(grace=1.0)
    frontend.pool.shutdown()
    if http is not None:
        await http.stop()
    detached = list(engine.workers.values())
    for w in detached:  # NOTE: the workers stay up and dial in again, to a restarted scheduler
        engine.detach(w)
        log.info("worker detached", worker=w.worker_id, reason="the scheduler stops")
    await workers.stop(grace=1.0)
    # A detached worker's step loop ends at its next wake-up: awaited, so that none is pending when the loop closes.
    loops = [w.task for w in detached if w.task is not None]
    if loops:
        await asyncio.wait(loops, timeout=5)
    if traces is not None:
        traces.shutdown()  # NOTE: after the drain: the last requests' spans go out too
    log.info("scheduler stopped")
