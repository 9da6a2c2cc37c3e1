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
from grpc_health.v1 import health_pb2
from grpc_health.v1._async import HealthServicer

from pagedserve_common.config import UP_NONCE_METADATA, UP_NONCE_VARIABLE, SchedulerOptions
from pagedserve_common.descriptors import AcceptErrors, raise_open_files_limit
from pagedserve_common.options import values
from pagedserve_common.startup import USAGE, StartupError, one_line
from scheduler_svc import gc_policy, tracing
from scheduler_svc.auth import Access
from scheduler_svc.core.waiting import read_tenant_weights
from scheduler_svc.engine import Engine, EngineConfig
from scheduler_svc.errors import ErrorCode
from scheduler_svc.metrics import Metrics
from scheduler_svc.grpc.servicers import WorkerControlServicer
from scheduler_svc.frontend import FrontEnd, Tokenizer, model_defaults
from scheduler_svc.frontend.limits import Limits
from scheduler_svc.ports import ConnectionCaps, Ports, client_server, http_server, start_metrics, worker_server
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


def input_limits(cfg: ServerConfig, max_model_len: int) -> Limits:
    """The client APIs' input bounds: those with a flag from it, the fixed ones from Limits."""
    return Limits.for_model(max_model_len, **values(cfg.limits))


def tenant_weights(cfg: ServerConfig) -> dict[str, float]:
    """--tenant-weights' file read (a bad one, or the flag without the fair policy, fails the start)."""
    path, policy = cfg.engine.tenant_weights, cfg.engine.scheduling_policy
    if not path:
        return {}
    if policy != "fair":
        raise StartupError(f"--tenant-weights needs --scheduling-policy fair (not {policy}): only the fair policy "
                           f"counts tenants' shares", USAGE)
    try:
        return read_tenant_weights(path)
    except ValueError as e:
        raise StartupError(str(e)) from None


def load_tokenizer(cfg: ServerConfig) -> Tokenizer:
    try:
        tokenizer = Tokenizer.from_model_dir(cfg.model_dir)
    except Exception as e:  # NOTE: the tokenizers library raises a bare Exception for a missing or broken file
        raise StartupError(f"--model {cfg.model}: cannot load its tokenizer (tokenizer.json) from {cfg.model_dir}: "
                           f"{one_line(e)}") from None
    if (template := model_defaults.chat_template(cfg.chat_template)) is not None:
        tokenizer.chat_template = template
    return tokenizer


def build_frontend(cfg: ServerConfig, traces: tracing.Tracing | None, weights: dict[str, float]) -> FrontEnd:
    """The engine (its fair shares set) and the front end both client APIs share."""
    tokenizer = load_tokenizer(cfg)
    names = model_defaults.model_names(cfg.served_model_name, cfg.model)
    config = engine_config(cfg, tokenizer)
    engine = Engine(config, Metrics(names[0], config.max_model_len), tracing=traces)
    engine.service.weights.update(weights)
    return FrontEnd(engine, tokenizer, input_limits(cfg, config.max_model_len), model_names=names,
                    sampling_defaults=model_defaults.sampling_defaults(cfg.generation_config, cfg.model_dir),
                    fill_context_cap=model_defaults.fill_context_cap(cfg.generation_config, cfg.model_dir))


class Health:
    """The health service: LIVENESS SERVING from start to exit; SERVICES SERVING iff a worker is attached and the
    scheduler is not draining (published as workers come and go)."""

    def __init__(self, engine: Engine, up_nonce: str | None) -> None:
        self.engine = engine
        self.servicer = UpHealth(up_nonce) if up_nonce else HealthServicer()

    async def start(self) -> None:
        for name in SERVICES:
            await self.servicer.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
        await self.servicer.set(LIVENESS, health_pb2.HealthCheckResponse.SERVING)
        self.engine.on_workers_changed = lambda num_workers: asyncio.get_running_loop().create_task(self.publish())

    async def publish(self) -> None:
        # NOTE: the status is read when this runs, not when it was scheduled: one scheduled before the drain began
        # must not set SERVING after it.
        engine = self.engine
        status = health_pb2.HealthCheckResponse.SERVING if engine.workers and not engine.draining \
            else health_pb2.HealthCheckResponse.NOT_SERVING
        for name in SERVICES:
            await self.servicer.set(name, status)


async def serve(cfg: ServerConfig, ready: asyncio.Event | None = None, traces: tracing.Tracing | None = None) -> None:
    """Runs until SIGINT or SIGTERM, then drains. `traces`: a test's tracing (else --otlp-endpoint's, if given)."""
    a, net, conn = cfg.access, cfg.network, cfg.connections
    access = Access.load(a.tls_cert, a.tls_key, a.tls_ca, a.api_key_file)  # first: a bad file fails fast
    weights = tenant_weights(cfg)
    traces = traces or tracing.start(cfg.observability.otlp_endpoint, cfg.model)
    gate = WorkerGate.load(net.worker_listen, a.worker_token_file, access.mutual, a.insecure_workers)
    caps = ConnectionCaps.of(conn, raise_open_files_limit("scheduler"))
    asyncio.get_running_loop().set_exception_handler(AcceptErrors())
    frontend = build_frontend(cfg, traces, weights)
    engine = frontend.engine
    up_nonce = os.environ.get(UP_NONCE_VARIABLE) or None  # set by `pagedserve up` alone
    health = Health(engine, up_nonce)
    await health.start()
    clients, client_gate = client_server(caps, access, frontend, health.servicer, net.listen,
                                         frontend.limits.max_message_size, cfg.engine.max_queued_requests,
                                         conn.header_timeout)
    workers, worker_gate = worker_server(caps, access, WorkerControlServicer(engine, gate.tokens, up_nonce),
                                         net.worker_listen, conn.header_timeout)
    if net.metrics:
        start_metrics(net.metrics, engine.metrics.registry)
    http = http_server(caps, access, frontend, net.http, cfg.tool_call_parser, conn.header_timeout,
                       conn.body_timeout) if net.http else None
    ports = Ports(clients, workers, client_gate, worker_gate, http)
    await ports.start()
    gc_policy.settle()  # NOTE: start-up is done: what it left alive is frozen, never walked by a collection again
    log_listening(cfg, access, gate, caps)
    await until_stopped(ready)
    await drain(engine, health, cfg.engine.drain_timeout)
    await ports.stop_clients(frontend)
    await detach_workers(engine, workers)
    if traces is not None:
        traces.shutdown()  # NOTE: after the drain: the last requests' spans go out too
    log.info("scheduler stopped")


def log_listening(cfg: ServerConfig, access: Access, gate: WorkerGate, caps: ConnectionCaps) -> None:
    net = cfg.network
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


async def until_stopped(ready: asyncio.Event | None) -> None:
    """Until SIGINT or SIGTERM (`ready` set once they are handled)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready.set()
    await stop.wait()


async def drain(engine: Engine, health: Health, timeout: float) -> None:
    """Refuses new requests (UNAVAILABLE) and lets running ones finish, `timeout` seconds at most: then ends them."""
    engine.draining = True
    # NOTE: not enter_graceful_shutdown(), which would set LIVENESS to NOT_SERVING too: a liveness probe would then
    # restart a scheduler that is finishing its streams.
    await health.publish()
    log.info("draining", unfinished=engine.num_unfinished, timeout_s=timeout)
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while engine.num_unfinished and loop.time() < deadline:
        await asyncio.sleep(0.05)
    if engine.num_unfinished:
        log.warning("drain timeout: ending the unfinished requests", unfinished=engine.num_unfinished)
        engine.fail_all(ErrorCode.UNAVAILABLE, f"the server shut down: the request did not finish within the "
                                               f"{timeout:g} s drain timeout")


async def detach_workers(engine: Engine, workers: grpc.aio.Server) -> None:
    """Detaches every worker (they stay up and dial in again, to a restarted scheduler), then stops their port."""
    detached = list(engine.workers.values())
    for w in detached:
        engine.detach(w)
        log.info("worker detached", worker=w.worker_id, reason="the scheduler stops")
    await workers.stop(grace=1.0)
    # A detached worker's step loop ends at its next wake-up: awaited, so that none is pending when the loop closes.
    loops = [w.task for w in detached if w.task is not None]
    if loops:
        await asyncio.wait(loops, timeout=5)
