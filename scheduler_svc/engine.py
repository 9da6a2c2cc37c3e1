"""The scheduler service's core: places requests on workers, recomputes a lost worker's requests elsewhere."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import random
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

from pagedserve_common.config import EngineOptions
from pagedserve_common.step import StepError, StepPlan, StepResult
from scheduler_svc.core.step import ScheduledStep
from pagedserve_common.sampling import SamplingParams
from scheduler_svc import request_log
from scheduler_svc.core.request import FinishReason, Request, RequestOutput
from scheduler_svc.core.result_check import check_result
from scheduler_svc.core.tenancy import prefix_salt, scoped_request_id
from scheduler_svc.core.waiting import MAX_TENANT_COUNTERS, ServiceCounter
from scheduler_svc.errors import DRAINING, EngineError, ErrorCode
from scheduler_svc.metrics import Metrics
from scheduler_svc.routing import Router
from scheduler_svc.fleet import Fleet, Lost, WorkerHandle, bad_result, export, export_fleet
from scheduler_svc.structured.matcher import fill_bitmasks

if TYPE_CHECKING:  # NOTE: the front end makes the streams; the engine only feeds them
    from scheduler_svc.frontend.stream import RequestStream
    from scheduler_svc.structured.matcher import Grammar
    from scheduler_svc.tracing.spans import Tracing

log = structlog.get_logger("pagedserve.scheduler")

LEAVING_POLL_SECONDS = 0.5  # a leaving worker with nothing to run still has its drain deadline checked
NOT_YET = object()  # _next_step(wait=False): nothing to run now
# The longest a step's publishing waits for the next plan's write (a worker that reads no plans holds the write).
PLAN_WRITE_WAIT_SECONDS = 0.05
CONSTRAINT_GAVE_UP = ("structured_output: following the grammar took more work for one token than a step allows "
                      "(the output so far does not match it); give a simpler grammar")


@dataclass(slots=True)
class PendingStep:
    """A step whose results the scheduler has taken in (update) and its clients not yet (_publish)."""

    plan: StepPlan
    outputs: list[RequestOutput]
    result: StepResult
    step_seconds: float  # sent -> answer taken in: the step as the scheduler saw it


@dataclass(slots=True, kw_only=True)
class EngineConfig(EngineOptions):
    """The engine's flags (their defaults and meaning: pagedserve_common.config.EngineOptions; a None
    max_num_batched_tokens goes by the worker's device: SchedulerConfig.for_worker) and what the model says."""

    model_id: str
    max_model_len: int  # --max-model-len within the model's
    vocab_size: int
    eos_token_ids: tuple[int, ...] = ()


class Engine(Fleet):
    """Owns every request's stream and where it runs (`placement`: request id -> worker). Each worker has its
    own Scheduler (block tables of its pool); the Router picks a worker for a new request. A request that
    loses its worker is recomputed on another with all its streamed tokens, so its client sees no gap.

    NOTE: sequence ids come from one counter shared by all workers' schedulers: unique across the fleet.
    """

    def __init__(self, config: EngineConfig, metrics: Metrics | None = None) -> None:
        self.config = config
        self.metrics = metrics or Metrics(config.model_id, config.max_model_len)
        self.router = Router(config.routing)
        self.workers: dict[str, WorkerHandle] = {}
        self.streams: dict[str, RequestStream] = {}  # unfinished client requests
        self.placement: dict[str, WorkerHandle] = {}  # request id -> the worker it runs on
        self.unplaced: dict[str, tuple[Request, float]] = {}  # waiting for a worker: request id -> (it, deadline)
        self.draining = False
        self.last_worker_left: float | None = None  # monotonic; None while no worker has ever left
        self._worker_ids = itertools.count()
        self._seq_ids = itertools.count()
        # NOTE: --seed: the seeds of requests that bring none, drawn here in arrival order (not by each worker's
        # scheduler, where routing would decide the order); None: each worker's scheduler draws a random one
        self._seeds = None if config.seed is None else random.Random(config.seed)
        self.service = ServiceCounter()  # the fair policy's tenants' service, fleet-wide: every Scheduler's
        self.on_workers_changed = lambda num_workers: None  # health: SERVING iff a worker is attached
        self.tracing: Tracing | None = None  # --otlp-endpoint (scheduler_svc.tracing)

    @property
    def num_unfinished(self) -> int:
        return len(self.streams)

    # -- a worker's steps ----------------------------------------------------------------------------------
    async def _serve(self, w: WorkerHandle) -> None:
        """A worker's step loop: schedule -> [bitmasks] -> send -> [publish the step before] -> receive -> update,
        one plan in flight, until the worker detaches (it left, or the server stops) or is lost (the one place a loss
        is handled). A step's tokens are published (detokenized, streamed) once the next plan is written: the
        worker computes meanwhile instead of waiting for 64 streams' writes (float32, 64 requests: 0.65 -> 0.52 s idle).
        A sample whose text hits a stop string there has one more token computed in the plan already sent, which
        update() drops as it does an abort's."""
        pending: PendingStep | None = None
        step: ScheduledStep | None = None  # the step in flight: this loop holds it, the scheduler does not
        ended = None  # why the loop ended: a Lost, or None (detached)
        try:
            while True:
                step = await self._next_step(w, wait=pending is None)  # schedule: waits while there is nothing to run
                if step is NOT_YET:  # nothing to run before the streams have this step: publish it, then wait
                    step = None
                    self._publish(w, pending)
                    pending = None
                    continue
                if not isinstance(step, ScheduledStep):
                    ended, step = step, None
                    break
                plan = step.plan
                t0 = time.perf_counter()
                if due := step.constrained_due():  # structured output: each sample's allowed tokens
                    # NOTE: on a thread, off the event loop: every other stream, health and the other workers'
                    # loops go on meanwhile. Only this loop touches these matchers (update() runs after receive).
                    masks = await asyncio.to_thread(fill_bitmasks, [r.constraint for r in due],
                                                    self.config.vocab_size)
                    plan.token_bitmasks = dict(zip([r.seq_id for r in due], masks))
                if self.tracing is not None:
                    self.tracing.step(w, step, self.streams)
                w.plan_sent.clear()
                w.outbox.put_nowait(plan)  # send: the Attach stream encodes and writes it
                if pending is not None:
                    await self._plan_written(w)
                    self._publish(w, pending)
                    pending = None
                result = await self._receive(w, step)
                if not isinstance(result, StepResult):
                    ended = result
                    break
                outputs = w.scheduler.update(step, result.sampled, result.num_accepted_drafts, result.prompt_logprobs)
                pending, step = PendingStep(plan, outputs, result, time.perf_counter() - t0), None
            if pending is not None:  # NOTE: before a loss recomputes its requests elsewhere
                self._publish(w, pending)
            if isinstance(ended, Lost):
                self.lose_worker(w, ended, step)
        except Exception as e:  # a bug: end this worker's requests loudly rather than leave them hanging
            log.exception("step loop failed", worker=w.worker_id)
            self.detach(w)
            for req in w.scheduler.release_all(step):
                self.placement.pop(req.request_id, None)
                self._fail(req.request_id, ErrorCode.INTERNAL, f"internal error on {w.worker_id}: {e}", w.worker_id)

    @staticmethod
    async def _plan_written(w: WorkerHandle) -> None:
        """Until the Attach stream has written the plan just queued (or PLAN_WRITE_WAIT_SECONDS pass: a publish
        then goes ahead). NOTE: publishing wakes every client stream's writer; queued before the plan's write on the
        event loop, they held it back ~1 ms a step (float32, 64 requests: the worker's wait 2.1-2.3 -> 1.7 ms)."""
        try:
            await asyncio.wait_for(w.plan_sent.wait(), PLAN_WRITE_WAIT_SECONDS)
        except TimeoutError:
            pass

    async def _receive(self, w: WorkerHandle, step: ScheduledStep) -> StepResult | Lost:
        """The worker's answer to `plan`, checked, or why none will come: a missed deadline, a failed step, a
        broken stream, a wrong answer. NOTE: one plan in flight per worker, so the next answer is this plan's.
        The first step has the same deadline as any: a worker warms up (first calls, kernel builds) before it
        registers (worker_svc.warm_up), and a longer first deadline let a silent new worker hold requests 4x as
        long (241 s)."""
        timeout, plan = self.config.step_timeout, step.plan
        try:
            answer = await asyncio.wait_for(w.inbox.get(), timeout)
        except TimeoutError:
            return Lost("deadline", f"no answer to step {plan.step_id} within {timeout:g} s")
        if answer is None:  # detached while it waited: its requests were released or ended already
            return Lost("stream", "its stream ended")
        if isinstance(answer, Lost):
            return answer
        if isinstance(answer, StepError):
            return Lost("failed_step", f"step {answer.step_id} failed ({answer.kind.name}): {answer.message}")
        # NOTE: a worker that answers wrongly is lost, not its requests: they are recomputed elsewhere uncharged,
        # but for the one whose own entry was wrong (Lost.charged_request_ids).
        wrong = check_result(plan.step_id, answer, step.due_samples(), self.config.vocab_size,
                             bitmasks=plan.token_bitmasks, banned=step.banned_samples(),
                             allowed=step.allowed_samples(), drafted=step.drafted,
                             prompt_due=step.prompt_logprobs_due())
        if wrong is not None:
            blamed = step.request_id_of(wrong.seq_id) if wrong.seq_id is not None else None
            return bad_result(plan.step_id, wrong.message, frozenset(() if blamed is None else (blamed,)))
        w.num_steps += 1
        return answer

    async def _next_step(self, w: WorkerHandle, wait: bool = True) -> ScheduledStep | Lost | object | None:
        """The worker's next step; a Lost when its stream broke or its drain ran out; None once it is detached;
        NOT_YET when there is nothing to run now and `wait` is False."""
        while w.attached:
            if w.lost is not None:
                return w.lost
            if w.leaving and (lost := self._leaving_tick(w)) is not None:
                return lost
            if not w.attached:
                break
            step = w.scheduler.schedule()
            if step is not None:
                return step
            if not wait:
                return NOT_YET
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

    def _publish(self, w: WorkerHandle, step: PendingStep) -> None:
        """Streams a step's tokens to their clients and finishes the samples whose text hit a stop string (the
        scheduler cannot: stop strings need detokenized text); then the step's metrics."""
        plan, outputs, result = step.plan, step.outputs, step.result
        now, logprobs = time.monotonic(), result.logprobs
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
        m, wid = self.metrics, w.label
        m.step.labels(wid).observe(step.step_seconds)
        if w.back_to_back:
            m.worker_idle.labels(wid).observe(result.idle_seconds)
        w.back_to_back = True
        if plan.preempted_seq_ids:
            log.info("preempted", worker=wid, seq_ids=list(plan.preempted_seq_ids),
                     total=w.scheduler.num_preemptions)
        m.batch_size.labels(wid).observe(plan.num_seqs)
        export(w, m)
        export_fleet(self)

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
            if self._routable():
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
            log.info("request moved", request_id=req.client_request_id, worker=w.worker_id,
                     tokens=len(req.all_token_ids), migrations=req.num_migrations)

    def _wait_for_worker(self, req: Request) -> None:
        timeout = self.config.no_worker_timeout
        if timeout <= 0:
            self._fail(req.request_id, ErrorCode.UNAVAILABLE, self.no_worker_reason())
            return
        self.unplaced[req.request_id] = (req, time.monotonic() + timeout)
        export_fleet(self)  # NOTE: no step runs while no worker is attached: the queue gauges move here
        asyncio.get_running_loop().call_later(timeout, self._expire_unplaced)

    def _expire_unplaced(self) -> None:
        now = time.monotonic()
        for request_id, (_, deadline) in list(self.unplaced.items()):
            if deadline <= now + 0.01:
                del self.unplaced[request_id]
                self._fail(request_id, ErrorCode.UNAVAILABLE,
                           f"no worker was attached for {self.config.no_worker_timeout:g} s")
        export_fleet(self)

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
        if self.unplaced.pop(request_id, None) is not None:
            export_fleet(self)
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
