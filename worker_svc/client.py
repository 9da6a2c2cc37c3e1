"""The worker process: dials in to the scheduler, registers, answers one StepPlan per step; dials in again
(with backoff, an empty pool) when the stream breaks, and leaves on SIGTERM once the scheduler lets it."""

from __future__ import annotations

import dataclasses
import os
import queue
import random
import signal
import socket
import time
from dataclasses import dataclass

import grpc
import structlog
import torch

from pagedserve.v1 import worker_pb2, worker_pb2_grpc
from pagedserve_common import wire
from pagedserve_common.grpc_options import WORKER_CHANNEL_OPTIONS
from pagedserve_common.config import UP_NONCE_METADATA, UP_NONCE_VARIABLE
from pagedserve_common.registration import WorkerRegistration, default_name
from pagedserve_common.step import StepError, StepErrorKind
from pagedserve_common.signals import exit_now
from worker_svc import cpu_path
from worker_svc.batch import BadPlan
from worker_svc.threads import ThreadGovernor
from worker_svc.warm_up import warm_up
from worker_svc.worker import WorkerConfig, available_cores, create_runner

log = structlog.get_logger("pagedserve.worker")

# Configuration errors: dialling in again cannot help.
FATAL_CODES = (grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.INVALID_ARGUMENT)
OUTBOX_POLL_SECONDS = 0.2
UNAUTHENTICATED_HINT = ("the scheduler requires a worker token: give this worker --worker-token-file with a token "
                        "of the scheduler's --worker-token-file")


class Shutdown:
    """SIGTERM/SIGINT: the first asks to leave (the scheduler moves this worker's work, then ends the stream);
    a second one exits at once. NOTE: the handler only sets attributes: it may interrupt the main thread
    while that thread holds a lock (a queue's, say), so it must not take one."""

    def __init__(self) -> None:
        self.requested = False
        self.reason = ""

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, self._handle)

    def _handle(self, signum, frame) -> None:
        if self.requested:
            exit_now()
        self.requested, self.reason = True, signal.Signals(signum).name


@dataclass(slots=True)
class Backoff:
    """Delays between attempts to dial in: doubling from `first` up to `cap`, with jitter so that a fleet
    does not dial a restarted scheduler in lockstep."""

    first: float = 0.5
    cap: float = 5.0
    current: float = 0.0

    def next(self) -> float:
        self.current = self.first if not self.current else min(self.cap, self.current * 2)
        return self.current * random.uniform(0.8, 1.2)

    def reset(self) -> None:
        self.current = 0.0


@dataclass(slots=True)
class _Throttle:
    """A warning said at most once every `seconds` while the scheduler stays away, not at every attempt."""

    seconds: float = 30.0
    last: float = float("-inf")

    def due(self) -> bool:
        """Whether the warning is due now; if it is, the next one is `seconds` away."""
        now = time.monotonic()
        if now - self.last <= self.seconds:
            return False
        self.last = now
        return True


def make_governor(cfg: WorkerConfig) -> ThreadGovernor | None:
    """Adaptive compute threads, unless --threads fixed them (or the worker is on a GPU)."""
    if cfg.threads is not None or cfg.device != "cpu":
        return None

    def changed(old: int, new: int, waiting: float, idle: float) -> None:
        log.info("compute threads changed", threads=new, was=old, cores_waiting=round(waiting, 2),
                 cores_idle=round(idle, 2))
    return ThreadGovernor(available_cores(), torch.set_num_threads, on_change=changed)


def run_worker(scheduler: str, cfg: WorkerConfig, shutdown: Shutdown | None = None,
               credentials: grpc.ChannelCredentials | None = None, channel_options=(), metadata=()) -> int:
    """Serves until asked to leave; returns the exit status (1 when the scheduler refuses this worker's
    configuration). With `credentials` it dials in over TLS (`channel_options` may name the certificate's expected
    host); `metadata` goes with its Attach call (its worker token)."""
    # NOTE: a worker that `pagedserve up` started says so (its nonce): the scheduler of another `up` refuses it
    # (FAILED_PRECONDITION, fatal below) instead of taking it in, when two `up`s meet on one --worker-listen.
    if up_nonce := os.environ.get(UP_NONCE_VARIABLE):
        metadata = (*metadata, (UP_NONCE_METADATA, up_nonce))
    runner, reg = create_runner(cfg)
    if shutdown is None:
        shutdown = Shutdown()
        shutdown.install()
    governor = make_governor(cfg)
    # NOTE: before registering: the first request would otherwise pay for first calls and an unsettled thread count
    # (TTFT 1.5-2.9 s, ~0.1 s later)
    warm_up_steps, warm_up_s = warm_up(runner, governor.tick if governor is not None else None)
    _log_ready(scheduler, runner, reg, governor, warm_up_steps, warm_up_s)
    backoff, warning = Backoff(), _Throttle()
    while not shutdown.requested:
        with dial(scheduler, credentials, [*WORKER_CHANNEL_OPTIONS, *channel_options]) as channel:
            try:
                _wait_ready(channel, shutdown)
            except grpc.FutureTimeoutError:
                if not shutdown.requested and warning.due():
                    # NOTE: a refused client certificate looks like a scheduler that is down: retried with the
                    # same backoff (the scheduler's CA may change without restarting this worker), said here.
                    log.warning("waiting for the scheduler", scheduler=scheduler, **connect_error(channel))
                _sleep(backoff.next(), shutdown)
                continue
            started = time.monotonic()
            try:
                serve_plans(channel, runner, reg, governor, shutdown, metadata)
            except grpc.RpcError as e:
                if _refused(e, scheduler, warning):
                    return 1
            runner.reset()
        if shutdown.requested:
            break
        if time.monotonic() - started > 30:  # it served a while: dial in again promptly
            backoff.reset()
        _sleep(backoff.next(), shutdown)
    log.info("worker leaving", reason=shutdown.reason)
    return 0


def _log_ready(scheduler: str, runner, reg: WorkerRegistration, governor: ThreadGovernor | None,
               warm_up_steps: int, warm_up_s: float) -> None:
    log.info("worker ready", scheduler=scheduler, num_blocks=reg.num_blocks, block_size=reg.block_size,
             dtype=str(runner.loaded.dtype).removeprefix("torch."), dtype_reason=runner.loaded.dtype_reason,
             weights_reason=runner.loaded.weights_reason,
             kv_cache_dtype=reg.dtype, device=reg.device,
             kv_bytes=runner.pool.nbytes, threads=torch.get_num_threads(),
             cores=available_cores(), adaptive_threads=bool(governor and governor.enabled),
             attention=runner.backend.name, int8_qk=bool(getattr(runner.backend, "int8_qk", False)),
             forward=runner.forward_path, batch_invariant=runner.batch_invariant,
             cpu_path=cpu_path.current().name, warm_up_steps=warm_up_steps,
             warm_up_s=round(warm_up_s, 3))


def _refused(e: grpc.RpcError, scheduler: str, warning: _Throttle) -> bool:
    """Says why the stream to the scheduler ended; True when the scheduler refused this worker's configuration
    (FATAL_CODES: dialling in again cannot help)."""
    if e.code() == grpc.StatusCode.UNAUTHENTICATED:
        # NOTE: like a refused certificate: retried with the backoff (the scheduler may come back with a token file
        # that holds this worker's token), said at most every 30 s.
        if warning.due():
            log.warning("waiting for the scheduler", scheduler=scheduler, error=e.details(), hint=UNAUTHENTICATED_HINT)
        return False
    if e.code() in FATAL_CODES:
        log.error("the scheduler refused this worker", code=e.code().name, details=e.details())
        return True
    log.warning("the stream to the scheduler broke; dialling in again with an empty pool", code=e.code().name,
                details=e.details())
    return False


def dial(scheduler: str, credentials: grpc.ChannelCredentials | None, options) -> grpc.Channel:
    if credentials is None:
        return grpc.insecure_channel(scheduler, options=options)
    return grpc.secure_channel(scheduler, credentials, options=options)


def connect_error(channel: grpc.Channel, timeout: float = 5.0) -> dict[str, str]:
    """Why `channel` does not connect: {'error': gRPC's words, 'hint': what to check} ({} when it does). A call to
    a method no server has: with no connection, its error is the connection's own."""
    try:
        channel.unary_unary("/pagedserve.v1.Probe/Connect")(b"", timeout=timeout)
        return {}
    except grpc.RpcError as e:
        if e.code() != grpc.StatusCode.UNAVAILABLE:
            return {}
        details = e.details() or ""
    if "Connection refused" in details:
        return {"error": details, "hint": "is the scheduler running?"}
    if any(s in details for s in ("handshake", "Socket closed", "SSL")):
        return {"error": details, "hint": "TLS set-up failed: with --tls-ca the scheduler accepts only workers whose "
                                          "--tls-cert its CA signed; a TLS scheduler needs --tls-ca here, a "
                                          "plaintext one none"}
    return {"error": details}


def _wait_ready(channel: grpc.Channel, shutdown: Shutdown, timeout: float = 5.0) -> None:
    """Returns once `channel` is connected; raises grpc.FutureTimeoutError after `timeout` seconds, or at once
    when asked to leave (so that a SIGTERM is not kept waiting for the attempt to end)."""
    ready, deadline = grpc.channel_ready_future(channel), time.monotonic() + timeout
    try:
        while True:
            try:
                ready.result(timeout=0.1)
                return
            except grpc.FutureTimeoutError:
                if shutdown.requested or time.monotonic() >= deadline:
                    raise
    finally:
        ready.cancel()  # NOTE: no-op once connected; else it stops watching the channel's state


def _sleep(seconds: float, shutdown: Shutdown) -> None:
    deadline = time.monotonic() + seconds
    while not shutdown.requested and time.monotonic() < deadline:
        time.sleep(min(0.1, deadline - time.monotonic()))


def serve_plans(channel: grpc.Channel, runner, reg: WorkerRegistration, governor: ThreadGovernor | None = None,
                shutdown: Shutdown | None = None, metadata=()) -> None:
    """Attach (with call `metadata`): registration first, then one StepResult (or StepError) per StepPlan, until
    the scheduler ends the stream. Raises grpc.RpcError when the stream breaks (or is refused)."""
    shutdown = shutdown or Shutdown()
    outbox: queue.Queue = queue.Queue()
    # NOTE: HOST:PID, within the bounds the scheduler checks (a host name it would refuse is made one it takes)
    reg = dataclasses.replace(reg, name=reg.name or default_name(socket.gethostname(), os.getpid()))
    outbox.put(worker_pb2.WorkerMessage(registration=wire.registration_to_pb(reg)))

    def messages():
        announced = False
        while True:
            if shutdown.requested and not announced:
                announced = True
                yield worker_pb2.WorkerMessage(leaving=worker_pb2.Leaving(reason=shutdown.reason or "shutdown"))
            try:
                msg = outbox.get(timeout=OUTBOX_POLL_SECONDS)
            except queue.Empty:
                continue
            if msg is None:
                return
            yield msg

    try:
        sent_at = None
        for plan_pb in worker_pb2_grpc.WorkerControlStub(channel).Attach(messages(), metadata=metadata):
            t0 = time.perf_counter()
            outbox.put(worker_pb2.WorkerMessage(**_answer(runner, plan_pb, t0, sent_at)))
            sent_at = time.perf_counter()
            if governor is not None:
                governor.tick()
        log.info("the scheduler ended the stream")
    finally:
        outbox.put(None)


def _answer(runner, plan_pb, t0: float, sent_at: float | None) -> dict:
    """{'result': StepResult} or {'error': StepError}: a refused plan or a failed step is reported, not fatal."""
    try:
        result = runner.step(wire.plan_from_pb(plan_pb))
    except BadPlan as e:
        log.error("refused a bad plan", step_id=plan_pb.step_id, error=str(e))
        return {"error": wire.step_error_to_pb(StepError(plan_pb.step_id, StepErrorKind.BAD_PLAN, str(e)))}
    except Exception as e:  # NOTE: out of device memory, a kernel fault: the scheduler recomputes elsewhere
        log.exception("step failed", step_id=plan_pb.step_id)
        return {"error": wire.step_error_to_pb(StepError(plan_pb.step_id, StepErrorKind.STEP_FAILED,
                                                         f"{type(e).__name__}: {e}"))}
    # NOTE: the step's time as the scheduler sees it includes decoding the plan
    result.step_seconds = time.perf_counter() - t0
    result.idle_seconds = 0.0 if sent_at is None else t0 - sent_at
    return {"result": wire.result_to_pb(result)}
