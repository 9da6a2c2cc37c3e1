"""The scheduler service's core: places requests on workers, recomputes a lost worker's requests elsewhere."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from pagedserve_common.config import EngineOptions
from pagedserve_common.registration import WorkerRegistration
from pagedserve_common.sampling import SamplingParams
from scheduler_svc import request_log
from scheduler_svc.core.kv_snapshot import KVPoolSnapshot, MAX_SNAPSHOT_BLOCKS, snapshot
from scheduler_svc.core.request import FinishReason, Request, RequestOutput
from scheduler_svc.core.step import ScheduledStep
from scheduler_svc.core.tenancy import prefix_salt, scoped_request_id
from scheduler_svc.core.waiting import MAX_TENANT_COUNTERS, ServiceCounter
from scheduler_svc.errors import DRAINING, EngineError, ErrorCode
from scheduler_svc.metrics import Metrics
from scheduler_svc.routing import Router
from scheduler_svc.fleet import Fleet, Lost, WorkerHandle, export_fleet
from scheduler_svc.step_loop import StepLoop

if TYPE_CHECKING:  # NOTE: the front end makes the streams; the engine only feeds them
    from scheduler_svc.frontend.stream import RequestStream
    from scheduler_svc.structured.matcher import Grammar
    from scheduler_svc.tracing.spans import Tracing

log = structlog.get_logger("pagedserve.scheduler")

CONSTRAINT_GAVE_UP = ("structured_output: following the grammar took more work for one token than a step allows "
                      "(the output so far does not match it); give a simpler grammar")


@dataclass(slots=True, kw_only=True)
class EngineConfig(EngineOptions):
    """The engine's flags (their defaults and meaning: pagedserve_common.config.EngineOptions; a None
    max_num_batched_tokens goes by the worker's device: SchedulerConfig.for_worker) and what the model says."""

    model_id: str
    max_model_len: int  # --max-model-len within the model's
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()


class Engine:
    """Owns every request's stream and where it runs (`placement`: request id -> worker): admission, placement and
    failure. The Fleet holds the attached workers, each with its own Scheduler (block tables of its pool) and its
    StepLoop (the step in flight); the Router picks a worker for a new request. A request that loses its worker is
    recomputed on another with all its streamed tokens, so its client sees no gap.

    Its public methods are the front end's and the servicers' whole interface: submit, abort, check_queue,
    max_output_tokens, serving, model_workers, kv_state (requests); attach_worker, worker_leaving (the Attach
    stream); lose_worker, fail_worker, leaving_tick, deliver, trace_step, export_fleet (a StepLoop).
    """

    def __init__(self, config: EngineConfig, metrics: Metrics | None = None, tracing: Tracing | None = None) -> None:
        self.config = config
        self.metrics = metrics or Metrics(config.model_id, config.max_model_len)
        self.tracing = tracing  # --otlp-endpoint (scheduler_svc.tracing); None: no traces, and no work for them
        self.router = Router(config.routing)
        self.service = ServiceCounter()  # the fair policy's tenants' service, fleet-wide: every Scheduler's
        self.fleet = Fleet(config, self.metrics, self.service)
        self.streams: dict[str, RequestStream] = {}  # unfinished client requests
        self.placement: dict[str, WorkerHandle] = {}  # request id -> the worker it runs on
        self.unplaced: dict[str, tuple[Request, float]] = {}  # waiting for a worker: request id -> (it, deadline)
        self.draining = False
        # NOTE: --seed: the seeds of requests that bring none, drawn here in arrival order (not by each worker's
        # scheduler, where routing would decide the order); None: each worker's scheduler draws a random one
        self._seeds = None if config.seed is None else random.Random(config.seed)
        self.on_workers_changed = lambda num_workers: None  # health: SERVING iff a worker is attached

    @property
    def workers(self) -> dict[str, WorkerHandle]:
        """The attached workers by id (read-only: the Fleet takes them in and lets them go)."""
        return self.fleet.workers

    @property
    def num_unfinished(self) -> int:
        return len(self.streams)


    # -- workers: what their coming and going means for requests ------------------------------------------
    def attach_worker(self, reg: WorkerRegistration, origin: Mapping[str, str] | None = None) -> WorkerHandle:
        """Takes the worker in (Fleet.attach: raises EngineError naming the field at fault), starts its StepLoop and
        places the requests that waited for a worker."""
        w = self.fleet.attach(reg, origin)
        w.task = asyncio.get_running_loop().create_task(StepLoop(self, w).run())
        # NOTE: its series go once its step loop has ended, not at detach: its last step publishes after a detach
        # (a leave, a loss) and would otherwise bring them back, for good.
        w.task.add_done_callback(lambda _: self.metrics.worker_left(w.label))
        self._workers_changed()
        for request_id in list(self.unplaced):  # requests that waited for a worker
            req, _ = self.unplaced.pop(request_id)
            self._place_or_wait(req)
        return w

    def lose_worker(self, w: WorkerHandle, lost: Lost, in_flight: ScheduledStep | None = None) -> None:
        """The worker broke (or ran out of time leaving) with the step `in_flight` unanswered: recompute its
        requests on the others (those in that step are charged a migration, when the loss is the step's fault)."""
        if not w.attached:
            return
        reason = lost.reason
        if lost.charge:
            suspects = in_flight.request_ids() if in_flight is not None else set()
        else:
            suspects = lost.charged_request_ids
        self.detach(w)
        moved, failed = 0, 0
        for req in w.scheduler.release_all(in_flight):
            rid = req.request_id
            self.placement.pop(rid, None)
            stream = self.streams.get(rid)
            if stream is None:
                continue
            if rid in suspects:
                req.num_migrations += 1
            if req.num_migrations >= self.config.max_migrations:
                self._fail(rid, ErrorCode.INTERNAL, f"request {req.client_request_id} was in a step of "
                           f"{req.num_migrations} workers that failed (the last: {w.worker_id}: {reason}); it is not "
                           "retried again", w.worker_id)
                failed += 1
                continue
            self.metrics.migrations.inc()
            if stream.trace is not None:
                stream.trace.moved(w.worker_id, lost.kind, reason, len(req.all_token_ids))
            self._place_or_wait(req)
            moved += 1
        self.metrics.workers_lost.labels(lost.kind).inc()
        log.warning("worker lost; its requests are recomputed elsewhere", worker=w.worker_id, reason=reason,
                    migrated=moved, failed=failed, workers_left=len(self.workers))

    def fail_worker(self, w: WorkerHandle, in_flight: ScheduledStep | None, message: str) -> None:
        """A bug in the worker's step loop: its requests end with INTERNAL rather than hang."""
        self.detach(w)
        for req in w.scheduler.release_all(in_flight):
            self.placement.pop(req.request_id, None)
            self._fail(req.request_id, ErrorCode.INTERNAL, message, w.worker_id)

    def worker_leaving(self, w: WorkerHandle, reason: str) -> None:
        """The worker shuts down on purpose: no new requests; its queued ones move now, its running ones may
        finish within the drain timeout (then they move too); then its stream ends and it exits."""
        if not w.attached or w.leaving:
            return
        w.leaving, w.leave_deadline = True, time.monotonic() + self.config.drain_timeout
        log.info("worker leaving", worker=w.worker_id, reason=reason, running=w.scheduler.num_running,
                 waiting=w.scheduler.num_waiting)
        self._move_queued(w)  # NOTE: safe with a step in flight: queued requests are not in it
        w.wakeup.set()

    def leaving_tick(self, w: WorkerHandle) -> Lost | None:
        """Between a leaving worker's steps: move what can move, close it once it holds nothing; a Lost once its
        drain deadline has passed."""
        if time.monotonic() > w.leave_deadline:
            return Lost("leave_timeout", f"its requests did not finish within {self.config.drain_timeout:g} s of it "
                        "announcing it leaves", charge=False)
        self._move_queued(w)
        if not w.scheduler.has_unfinished_requests():
            self.detach(w)
            log.info("worker left", worker=w.worker_id, workers_left=len(self.workers))
        return None

    def _move_queued(self, w: WorkerHandle) -> None:
        """A leaving worker's queued requests (preempted ones too) go to the others, if there are any."""
        if not self.fleet.routable():
            return
        for req in w.scheduler.take_queued():
            self.placement.pop(req.request_id, None)
            self.metrics.migrations.inc()
            if (stream := self.streams.get(req.request_id)) is not None and stream.trace is not None:
                stream.trace.moved(w.worker_id, "leaving", "the worker leaves", len(req.all_token_ids))
            self._place_or_wait(req)

    def detach(self, w: WorkerHandle) -> None:
        """Ends the worker's step loop and its Attach stream (Fleet.detach); the router forgets it."""
        self.fleet.detach(w)
        self.router.forget_worker(w.worker_id)
        self._workers_changed()

    def _workers_changed(self) -> None:
        m, workers = self.metrics, self.workers
        m.workers.set(len(workers))
        m.protocol.fleet([w.registration for w in workers.values()], self.config.no_prefix_caching)
        self.export_fleet()
        self.on_workers_changed(len(workers))

    # -- a StepLoop's calls ----------------------------------------------------------------------------------
    def deliver(self, w: WorkerHandle, outputs: list[RequestOutput], logprobs: dict | None) -> None:
        """Streams a step's tokens to their clients and finishes the samples whose text hit a stop string (the
        scheduler cannot: stop strings need detokenized text)."""
        now = time.monotonic()
        for out in outputs:
            self.router.prefilled(out.request_id)  # its prompt's blocks are in the worker's cache now
            stream = self.streams.get(out.request_id)
            if stream is None:
                continue
            if out.constraint_failed:  # its text does not match its grammar: an error, not a finish reason
                w.scheduler.abort(out.request_id)  # its other samples too
                self.placement.pop(out.request_id, None)
                self._fail(out.request_id, ErrorCode.INVALID_ARGUMENT, CONSTRAINT_GAVE_UP, w.worker_id)
                continue
            reason = stream.push(out, logprobs.get(out.seq_id) if logprobs else None, now)
            if reason is FinishReason.STOP_STRING and out.finish_reason is None:
                w.scheduler.finish(out.request_id, FinishReason.STOP_STRING, out.index)
            if stream.done:
                del self.streams[out.request_id]
                self.placement.pop(out.request_id, None)
                request_log.finished(stream, w.worker_id)

    def trace_step(self, w: WorkerHandle, step: ScheduledStep) -> None:
        """A step goes to worker `w` (--otlp-endpoint: its requests' spans)."""
        if self.tracing is not None:
            self.tracing.step(w, step, self.streams)

    def export_fleet(self) -> None:
        export_fleet(self.metrics, self.fleet, len(self.unplaced))

    # -- what the front end reads --------------------------------------------------------------------------
    def serving(self) -> tuple[bool, str]:
        """(True, "") when requests can be served now, else (False, why): draining, or no worker attached."""
        if self.draining:
            return False, DRAINING
        if not self.workers:
            return False, self.no_worker_reason()
        return True, ""

    def model_workers(self) -> dict[str, WorkerRegistration]:
        """The attached workers' registrations by worker id (GetModelInfo, /v1/models)."""
        return {worker_id: w.registration for worker_id, w in self.workers.items()}

    def kv_state(self, worker_id: str = "", tenant: str | None = None) -> KVPoolSnapshot:
        """One worker's KV pool between two steps (GetKVState): `worker_id` as model_workers() names it, '' for
        the first attached; `tenant`: only that tenant's sequences (None: every tenant's, for an operator). Raises
        EngineError: UNAVAILABLE with no worker attached, NOT_FOUND naming an unknown id."""
        workers = self.workers
        if not workers:
            raise EngineError(ErrorCode.UNAVAILABLE, self.no_worker_reason())
        w = workers.get(worker_id) if worker_id else next(iter(workers.values()))
        if w is None:
            raise EngineError(ErrorCode.NOT_FOUND, f"worker_id {worker_id!r} is not attached (attached: "
                                                   f"{', '.join(workers)})", "worker_id")
        num_blocks = w.scheduler.config.num_blocks
        if num_blocks > MAX_SNAPSHOT_BLOCKS:
            raise EngineError(ErrorCode.FAILED_PRECONDITION, f"{w.worker_id} has {num_blocks:,} KV blocks; GetKVState "
                              f"describes pools of up to {MAX_SNAPSHOT_BLOCKS:,} (two bytes each, every call, on the "
                              "scheduler's event loop)")
        return snapshot(w.worker_id, w.scheduler, w.registration.kv_geometry, tenant)

    # -- requests -----------------------------------------------------------------------------------------
    def submit(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, cache_salt: str = "",
               *, open_stream: Callable[[Request], RequestStream], grammar: Grammar | None = None, priority: int = 0,
               tenant: str = "") -> RequestStream:
        """Admits a request and returns its stream, made by `open_stream` (the front end's: it detokenizes).
        NOTE: the front end checked the input (FrontEnd._check); here only what needs the fleet: a request id in
        use, the queue bound, and whether the chosen worker can ever hold it (Scheduler.check_fits). Raises
        EngineError; an INVALID_ARGUMENT one names the field at fault. `grammar`: sampling.structured_output
        compiled (the front end's), whose matchers the request's samples consume."""
        cfg = self.config
        if self.draining:
            raise EngineError(ErrorCode.UNAVAILABLE, DRAINING)
        if not self.workers and cfg.no_worker_timeout <= 0:
            raise EngineError(ErrorCode.UNAVAILABLE, self.no_worker_reason())
        request_id = request_id or uuid.uuid4().hex
        key = scoped_request_id(tenant, request_id)  # NOTE: ids are per tenant: another's "r1" is no conflict
        if key in self.streams:
            raise EngineError(ErrorCode.ALREADY_EXISTS, f"request_id {request_id!r} is already running")
        self.check_queue()
        counters = self.service.service
        if tenant not in counters and len(counters) >= MAX_TENANT_COUNTERS:  # amortized: down to half at a time
            self.service.prune({s.request.tenant for s in self.streams.values()}, MAX_TENANT_COUNTERS // 2)
        if sampling.seed is None and self._seeds is not None:
            sampling = dataclasses.replace(sampling, seed=self._seeds.getrandbits(63))
        salt = prefix_salt(tenant, cache_salt, cfg.shared_prefix_cache)
        req = Request(key, list(prompt_token_ids), sampling, salt, priority=priority, tenant=tenant,
                      constraint=grammar and grammar.constraint())
        try:
            if self.fleet.routable():
                self._place(req)
        except ValueError as e:  # the chosen worker is smaller than the scheduler's limits
            raise EngineError(ErrorCode.INVALID_ARGUMENT, str(e), getattr(e, "field", None)) from None
        stream = open_stream(req)
        self.streams[key] = stream
        if key not in self.placement:
            self._wait_for_worker(req)
        # NOTE: debug: at info it doubles the log's volume; the end line (request_log) says all of it and more
        log.debug("request added", request_id=request_id, tenant=tenant, worker=getattr(self.placement.get(key),
                  "worker_id", None), prompt_tokens=len(prompt_token_ids), max_tokens=sampling.max_tokens,
                  n=sampling.n)
        return stream

    @property
    def num_queued(self) -> int:
        """Requests waiting: for a worker, or on a worker for their first step (what --max-queued-requests bounds)."""
        return len(self.unplaced) + sum(w.scheduler.num_waiting for w in self.workers.values())

    def check_queue(self, num_new: int = 1) -> None:
        """Raises EngineError(RESOURCE_EXHAUSTED) unless `num_new` more requests fit in the queue now (a completions
        batch is one request per prompt)."""
        bound, num_queued = self.config.max_queued_requests, self.num_queued
        if num_queued + num_new <= bound:
            return
        if num_queued >= bound:
            raise EngineError(ErrorCode.RESOURCE_EXHAUSTED, f"the request queue is full: {num_queued} requests are "
                                                            f"waiting (--max-queued-requests {bound}); retry later")
        raise EngineError(ErrorCode.RESOURCE_EXHAUSTED,
                          f"the request queue has room for {bound - num_queued} more requests, and this one has "
                          f"{num_new} prompts, one request each (--max-queued-requests {bound}); retry later")

    def max_output_tokens(self, num_prompt_tokens: int, n: int = 1) -> int:
        """How many tokens a request may ask for to fill its context: up to max_model_len, and no more than the
        smallest attached pool can hold (a request that asks more is refused as never fitting)."""
        limits = [w.scheduler.max_output_tokens(num_prompt_tokens, n) for w in self.fleet.routable()]
        return min([self.config.max_model_len - num_prompt_tokens, *limits])

    def _place(self, req: Request) -> WorkerHandle:
        """Routes `req` to a worker and queues it there; raises ValueError when that worker can't serve it."""
        decision = self.router.choose(self.fleet.routable(), req.prompt_token_ids, req.cache_salt)
        w = self.workers[decision.worker_id]
        if req.seq_id < 0:  # never placed before
            w.scheduler.add_request(req)
        else:  # moved from a lost or leaving worker, with every token it has streamed
            w.scheduler.adopt(req)
        self.placement[req.request_id] = w
        self.router.routed(req.request_id, w.worker_id, req.prompt_token_ids, w.scheduler.config.block_size,
                           req.cache_salt)
        w.wakeup.set()
        return w

    def _place_or_wait(self, req: Request) -> None:
        if not self.fleet.routable():
            self._wait_for_worker(req)
            return
        moved = req.seq_id >= 0  # else it waited for a first worker
        try:
            w = self._place(req)
        except ValueError as e:  # the new worker is smaller than the old one
            self._fail(req.request_id, ErrorCode.INVALID_ARGUMENT, str(e))
            return
        if moved:
            log.info("request moved", request_id=req.client_request_id, worker=w.worker_id,
                     tokens=len(req.all_token_ids), migrations=req.num_migrations)

    def _wait_for_worker(self, req: Request) -> None:
        timeout = self.config.no_worker_timeout
        if timeout <= 0:
            self._fail(req.request_id, ErrorCode.UNAVAILABLE, self.no_worker_reason())
            return
        self.unplaced[req.request_id] = (req, time.monotonic() + timeout)
        self.export_fleet()  # NOTE: no step runs while no worker is attached: the queue gauges move here
        asyncio.get_running_loop().call_later(timeout, self._expire_unplaced)

    def _expire_unplaced(self) -> None:
        now = time.monotonic()
        for request_id, (_, deadline) in list(self.unplaced.items()):
            if deadline <= now + 0.01:
                del self.unplaced[request_id]
                self._fail(request_id, ErrorCode.UNAVAILABLE,
                           f"no worker was attached for {self.config.no_worker_timeout:g} s")
        self.export_fleet()

    def no_worker_reason(self) -> str:
        return self.fleet.no_worker_reason()

    def _fail(self, request_id: str, code: ErrorCode, message: str, worker: str | None = None) -> None:
        """Ends an admitted request with an error status. NOTE: every failure goes through here (one log line)."""
        stream = self.streams.pop(request_id, None)
        if stream is not None:
            stream.fail(code.value, message)
            request_log.failed(stream, worker, code, message)

    def abort(self, request_id: str) -> None:
        """Client cancel or deadline: its blocks go back to the pool at the next step."""
        stream = self.streams.pop(request_id, None)
        if self.unplaced.pop(request_id, None) is not None:
            self.export_fleet()
        self.router.prefilled(request_id)  # NOTE: its prompt no longer counts as pending on its worker
        w = self.placement.pop(request_id, None)
        if w is not None:
            w.scheduler.abort(request_id)
            w.wakeup.set()
        if stream is not None:  # NOTE: a stream already ended (finished, failed) was logged then
            request_log.aborted(stream, w and w.worker_id)

    def fail_all(self, code: ErrorCode, message: str) -> None:
        """Ends every unfinished request (shutdown after the drain timeout)."""
        for request_id in list(self.streams):
            w = self.placement.get(request_id)
            self._fail(request_id, code, message, w and w.worker_id)
            self.abort(request_id)  # NOTE: frees its blocks at the worker's next step
