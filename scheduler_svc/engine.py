"""The scheduler service's core: places requests on workers, recomputes a lost worker's requests elsewhere."""

from __future__ import annotations

import asyncio
import itertools
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from pagedserve_common.config import CPU_BATCHED_TOKENS, GPU_BATCHED_TOKENS, EngineOptions
from pagedserve_common.plan import StepPlan
from pagedserve_common.registration import WorkerRegistration
from pagedserve_common.result import StepResult
from pagedserve_common.sampling import SamplingParams
from scheduler_svc import request_log
from scheduler_svc.core.request import FinishReason, Request, RequestOutput
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.errors import DRAINING, EngineError, ErrorCode
from scheduler_svc.metrics import Metrics
from scheduler_svc.routing import Router
from scheduler_svc.worker_link import Lost, WorkerHandle, export

if TYPE_CHECKING:  # NOTE: the front end makes the streams; the engine only feeds them
    from scheduler_svc.frontend.stream import RequestStream

log = structlog.get_logger("pagedserve.scheduler")

LEAVING_POLL_SECONDS = 0.5  # a leaving worker with nothing to run still has its drain deadline checked


@dataclass(slots=True, kw_only=True)
class EngineConfig(EngineOptions):
    """The engine's flags (their defaults and meaning: pagedserve_common.config.EngineOptions; a None
    max_num_batched_tokens goes by the worker's device: default_batched_tokens) and what the model says."""

    model_id: str
    max_model_len: int  # --max-model-len within the model's
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()


def default_batched_tokens(device: str) -> int:
    return CPU_BATCHED_TOKENS if device.startswith("cpu") or not device else GPU_BATCHED_TOKENS


class Engine:
    """Owns every request's stream and where it runs (`placement`: request id -> worker). Each worker has its
    own Scheduler (block tables of its pool); the Router picks a worker for a new request. A request that
    loses its worker is recomputed on another with all its streamed tokens, so its client sees no gap.

    NOTE: sequence ids come from one counter shared by all workers' schedulers: unique across the fleet.
    """

    def __init__(self, config: EngineConfig, metrics: Metrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or Metrics()
        self.router = Router(config.routing)
        self.workers: dict[str, WorkerHandle] = {}
        self.streams: dict[str, RequestStream] = {}  # unfinished client requests
        self.placement: dict[str, WorkerHandle] = {}  # request id -> the worker it runs on
        self.unplaced: dict[str, tuple[Request, float]] = {}  # waiting for a worker: request id -> (it, deadline)
        self.draining = False
        self.last_worker_left: float | None = None  # monotonic; None while no worker has ever left
        self._worker_ids = itertools.count()
        self._seq_ids = itertools.count()
        self.on_workers_changed = lambda num_workers: None  # health: SERVING iff a worker is attached

    @property
    def num_unfinished(self) -> int:
        return len(self.streams)

    # -- workers ------------------------------------------------------------------------------------------
    def attach_worker(self, reg: WorkerRegistration) -> WorkerHandle:
        if reg.model_id != self.config.model_id:
            raise EngineError(ErrorCode.FAILED_PRECONDITION,
                              f"model_id {reg.model_id!r} differs from the scheduler's {self.config.model_id!r}")
        if reg.num_blocks < 1:
            raise EngineError(ErrorCode.INVALID_ARGUMENT, "num_blocks must be >= 1")
        cfg = self.config
        try:
            sched = Scheduler(SchedulerConfig(
                num_blocks=reg.num_blocks, max_model_len=min(cfg.max_model_len, reg.max_model_len),
                max_num_seqs=cfg.max_num_seqs,
                max_num_batched_tokens=cfg.max_num_batched_tokens or default_batched_tokens(reg.device),
                block_size=reg.block_size, enable_prefix_caching=not cfg.no_prefix_caching,
                eos_token_ids=cfg.eos_token_ids, num_cpu_blocks=reg.num_cpu_blocks,
                kv_allocation=cfg.kv_allocation), seq_ids=self._seq_ids)
        except ValueError as e:  # e.g. swap space under a static kv_allocation
            raise EngineError(ErrorCode.FAILED_PRECONDITION, str(e)) from None
        w = WorkerHandle(f"worker-{next(self._worker_ids)}", reg, sched)
        self.workers[w.worker_id] = w
        self.metrics.kv_blocks_total.labels(w.worker_id).set(reg.num_blocks)
        w.task = asyncio.get_running_loop().create_task(self._serve(w))
        log.info("worker attached", worker=w.worker_id, name=reg.name, num_blocks=reg.num_blocks,
                 block_size=reg.block_size, dtype=reg.dtype, device=reg.device)
        self._workers_changed()
        for request_id in list(self.unplaced):  # requests that waited for a worker
            req, _ = self.unplaced.pop(request_id)
            self._place_or_wait(req)
        return w

    def lose_worker(self, w: WorkerHandle, lost: Lost) -> None:
        """The worker broke (or ran out of time leaving): recompute its requests on the others."""
        if not w.attached:
            return
        reason = lost.reason
        suspects = w.scheduler.in_flight_request_ids() if lost.charge else set()
        self.detach(w)
        moved, failed = 0, 0
        limit = self.config.max_migrations
        for req in w.scheduler.release_all():
            rid = req.request_id
            self.placement.pop(rid, None)
            stream = self.streams.get(rid)
            if stream is None:
                continue
            if rid in suspects:
                req.num_migrations += 1
            if req.num_migrations >= limit:
                self._fail(rid, ErrorCode.INTERNAL, f"request {rid} was in a step of {req.num_migrations} workers "
                           f"that failed (the last: {w.worker_id}: {reason}); it is not retried again", w.worker_id)
                failed += 1
                continue
            self.metrics.migrations.inc()
            self._place_or_wait(req)
            moved += 1
        self.metrics.workers_lost.labels(lost.kind).inc()
        log.warning("worker lost; its requests are recomputed elsewhere", worker=w.worker_id, reason=reason,
                    migrated=moved, failed=failed, workers_left=len(self.workers))

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

    def _leaving_tick(self, w: WorkerHandle) -> Lost | None:
        """Between a leaving worker's steps: move what can move, close it once it holds nothing."""
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
        if not self._routable():
            return
        for req in w.scheduler.take_queued():
            self.placement.pop(req.request_id, None)
            self.metrics.migrations.inc()
            self._place_or_wait(req)

    def detach(self, w: WorkerHandle) -> None:
        """Ends the worker's step loop and its Attach stream (a worker still running registers again)."""
        w.attached = False
        self.workers.pop(w.worker_id, None)
        if not self.workers:
            self.last_worker_left = time.monotonic()
        self.router.forget_worker(w.worker_id)
        w.inbox.put_nowait(None)
        w.outbox.put_nowait(None)
        w.wakeup.set()
        for name in self.metrics.PER_WORKER_GAUGES:
            try:
                getattr(self.metrics, name).remove(w.worker_id)
            except KeyError:
                pass
        self._workers_changed()

    def _workers_changed(self) -> None:
        self.metrics.workers.set(len(self.workers))
        self.on_workers_changed(len(self.workers))

    # -- a worker's steps ----------------------------------------------------------------------------------
    async def _serve(self, w: WorkerHandle) -> None:
        """A worker's step loop: schedule -> send -> receive -> update -> publish, one plan in flight, until the
        worker detaches (it left, or the server stops) or is lost (the one place a loss is handled)."""
        try:
            while True:
                plan = await self._next_plan(w)  # schedule: waits while there is nothing to run
                if not isinstance(plan, StepPlan):
                    break
                t0 = time.perf_counter()
                w.send(plan)
                result = await w.receive(plan, self.config.step_timeout)
                if not isinstance(result, StepResult):
                    plan = result
                    break
                outputs = w.scheduler.update(plan, result.sampled)
                self._publish(w, plan, outputs, result, t0)
            if isinstance(plan, Lost):
                self.lose_worker(w, plan)
        except Exception as e:  # a bug: end this worker's requests loudly rather than leave them hanging
            log.exception("step loop failed", worker=w.worker_id)
            self.detach(w)
            for req in w.scheduler.release_all():
                self.placement.pop(req.request_id, None)
                self._fail(req.request_id, ErrorCode.INTERNAL, f"internal error on {w.worker_id}: {e}", w.worker_id)

    async def _next_plan(self, w: WorkerHandle) -> StepPlan | Lost | None:
        """The worker's next plan; a Lost when its stream broke or its drain ran out; None once it is detached."""
        while w.attached:
            if w.lost is not None:
                return w.lost
            if w.leaving and (lost := self._leaving_tick(w)) is not None:
                return lost
            if not w.attached:
                break
            plan = w.scheduler.schedule()
            if plan is not None:
                return plan
            w.wakeup.clear()
            w.back_to_back = False
            if w.leaving:  # re-check its deadline now and then, even with nothing to run
                try:
                    await asyncio.wait_for(w.wakeup.wait(), LEAVING_POLL_SECONDS)
                except TimeoutError:
                    pass
            else:
                await w.wakeup.wait()
        return None

    def _publish(self, w: WorkerHandle, plan: StepPlan, outputs: list[RequestOutput], result: StepResult,
                 t0: float) -> None:
        """Streams a step's tokens to their clients and finishes the samples whose text hit a stop string (the
        scheduler cannot: stop strings need detokenized text); then the step's metrics."""
        now, logprobs = time.monotonic(), result.logprobs
        for out in outputs:
            self.router.prefilled(out.request_id)  # its prompt's blocks are in the worker's cache now
            stream = self.streams.get(out.request_id)
            if stream is None:
                continue
            reason = stream.push(out, logprobs.get(out.seq_id) if logprobs else None, now)
            if reason is FinishReason.STOP_STRING and out.finish_reason is None:
                w.scheduler.finish(out.request_id, FinishReason.STOP_STRING, out.index)
            if stream.done:
                del self.streams[out.request_id]
                self.placement.pop(out.request_id, None)
                request_log.finished(stream, w.worker_id)
        m, wid = self.metrics, w.worker_id
        m.step.labels(wid).observe(time.perf_counter() - t0)
        if w.back_to_back:
            m.worker_idle.labels(wid).observe(result.idle_seconds)
        w.back_to_back = True
        if plan.preempted_seq_ids:
            log.info("preempted", worker=wid, seq_ids=list(plan.preempted_seq_ids),
                     total=w.scheduler.num_preemptions)
        m.batch_size.labels(wid).observe(plan.num_seqs)
        m.requests_running.set(sum(x.scheduler.num_running for x in self.workers.values()))
        m.requests_waiting.set(sum(x.scheduler.num_waiting for x in self.workers.values()) + len(self.unplaced))
        export(w, m)

    # -- requests -----------------------------------------------------------------------------------------
    def submit(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams, cache_salt: str = "",
               *, open_stream: Callable[[Request], RequestStream]) -> RequestStream:
        """Admits a request and returns its stream, made by `open_stream` (the front end's: it detokenizes).
        NOTE: the front end checked the input (FrontEnd._check); here only what needs the fleet: a request id in
        use, the queue bound, and whether the chosen worker can ever hold it (Scheduler.check_fits). Raises
        EngineError; an INVALID_ARGUMENT one names the field at fault."""
        cfg = self.config
        if self.draining:
            raise EngineError(ErrorCode.UNAVAILABLE, DRAINING)
        if not self.workers and cfg.no_worker_timeout <= 0:
            raise EngineError(ErrorCode.UNAVAILABLE, self.no_worker_reason())
        request_id = request_id or uuid.uuid4().hex
        if request_id in self.streams:
            raise EngineError(ErrorCode.ALREADY_EXISTS, f"request_id {request_id!r} is already running")
        req = Request(request_id, list(prompt_token_ids), sampling, cache_salt or None)
        num_queued = len(self.unplaced) + sum(w.scheduler.num_waiting for w in self.workers.values())
        if num_queued >= cfg.max_queued_requests:
            raise EngineError(ErrorCode.RESOURCE_EXHAUSTED,
                              f"{cfg.max_queued_requests} requests are already queued; retry later")
        try:
            if self._routable():
                self._place(req)
        except ValueError as e:  # the chosen worker is smaller than the scheduler's limits
            raise EngineError(ErrorCode.INVALID_ARGUMENT, str(e), getattr(e, "field", None)) from None
        stream = open_stream(req)
        self.streams[request_id] = stream
        if request_id not in self.placement:
            self._wait_for_worker(req)
        # NOTE: debug: at info it doubles the log's volume; the end line (request_log) says all of it and more
        log.debug("request added", request_id=request_id, worker=getattr(self.placement.get(request_id),
                  "worker_id", None), prompt_tokens=len(prompt_token_ids), max_tokens=sampling.max_tokens,
                  n=sampling.n)
        return stream

    def max_output_tokens(self, num_prompt_tokens: int, n: int = 1) -> int:
        """How many tokens a request may ask for to fill its context: up to max_model_len, and no more than the
        smallest attached pool can hold (a request that asks more is refused as never fitting)."""
        limits = [w.scheduler.max_output_tokens(num_prompt_tokens, n) for w in self._routable()]
        return min([self.config.max_model_len - num_prompt_tokens, *limits])

    def _routable(self) -> list[WorkerHandle]:
        return [w for w in self.workers.values() if not w.leaving]

    def _place(self, req: Request) -> WorkerHandle:
        """Routes `req` to a worker and queues it there; raises ValueError when that worker can't serve it."""
        decision = self.router.choose(self._routable(), req.prompt_token_ids, req.cache_salt)
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
        if not self._routable():
            self._wait_for_worker(req)
            return
        moved = req.seq_id >= 0  # else it waited for a first worker
        try:
            w = self._place(req)
        except ValueError as e:  # the new worker is smaller than the old one
            self._fail(req.request_id, ErrorCode.INVALID_ARGUMENT, str(e))
            return
        if moved:
            log.info("request moved", request_id=req.request_id, worker=w.worker_id, tokens=len(req.all_token_ids),
                     migrations=req.num_migrations)

    def _wait_for_worker(self, req: Request) -> None:
        timeout = self.config.no_worker_timeout
        if timeout <= 0:
            self._fail(req.request_id, ErrorCode.UNAVAILABLE, self.no_worker_reason())
            return
        self.unplaced[req.request_id] = (req, time.monotonic() + timeout)
        asyncio.get_running_loop().call_later(timeout, self._expire_unplaced)

    def _expire_unplaced(self) -> None:
        now = time.monotonic()
        for request_id, (_, deadline) in list(self.unplaced.items()):
            if deadline <= now + 0.01:
                del self.unplaced[request_id]
                self._fail(request_id, ErrorCode.UNAVAILABLE,
                           f"no worker was attached for {self.config.no_worker_timeout:g} s")

    def no_worker_reason(self) -> str:
        """Why no worker takes a new request now; honest about the past (none yet, or the last one left)."""
        if self.workers:
            return "no worker takes new requests: every attached worker is leaving"
        if self.last_worker_left is None:
            return "no worker is attached yet"
        return f"no worker is attached (the last one left {time.monotonic() - self.last_worker_left:.0f} s ago)"

    def _fail(self, request_id: str, code: ErrorCode, message: str, worker: str | None = None) -> None:
        """Ends an admitted request with an error status. NOTE: every failure goes through here (one log line)."""
        stream = self.streams.pop(request_id, None)
        if stream is not None:
            stream.fail(code.value, message)
            request_log.failed(stream, worker, code, message)

    def abort(self, request_id: str) -> None:
        """Client cancel or deadline: its blocks go back to the pool at the next step."""
        stream = self.streams.pop(request_id, None)
        self.unplaced.pop(request_id, None)
        self.router.prefilled(request_id)
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
