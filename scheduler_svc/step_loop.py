"""One worker's step loop: schedule -> [bitmasks] -> send -> [publish the step before] -> receive -> update."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Protocol

import structlog

from pagedserve_common.config import EngineOptions
from pagedserve_common.step import StepError, StepPlan, StepResult
from scheduler_svc.core.request import RequestOutput
from scheduler_svc.core.result_check import check_result
from scheduler_svc.core.step import ScheduledStep
from scheduler_svc.fleet import Lost, WorkerHandle, bad_result, export
from scheduler_svc.metrics import Metrics
from scheduler_svc.structured.matcher import fill_bitmasks

log = structlog.get_logger("pagedserve.scheduler")

LEAVING_POLL_SECONDS = 0.5  # a leaving worker with nothing to run still has its drain deadline checked
NOT_YET = object()  # _next_step(wait=False): nothing to run now
# The longest a step's publishing waits for the next plan's write (a worker that reads no plans holds the write).
PLAN_WRITE_WAIT_SECONDS = 0.05


class StepLoopOwner(Protocol):
    """What a StepLoop needs of the engine, which owns the loop's requests (their streams, placement, failure)."""

    config: EngineOptions  # step_timeout; with the model's vocab_size (scheduler_svc.engine.EngineConfig)
    metrics: Metrics

    def deliver(self, w: WorkerHandle, outputs: list[RequestOutput], logprobs: dict | None) -> None: ...
    def lose_worker(self, w: WorkerHandle, lost: Lost, in_flight: ScheduledStep | None = None) -> None: ...
    def fail_worker(self, w: WorkerHandle, in_flight: ScheduledStep | None, message: str) -> None: ...
    def leaving_tick(self, w: WorkerHandle) -> Lost | None: ...
    def trace_step(self, w: WorkerHandle, step: ScheduledStep) -> None: ...
    def export_fleet(self) -> None: ...


@dataclass(slots=True)
class PendingStep:
    """A step whose results the scheduler has taken in (update) and its clients not yet (_publish)."""

    plan: StepPlan
    outputs: list[RequestOutput]
    result: StepResult
    step_seconds: float  # sent -> answer taken in: the step as the scheduler saw it


class StepLoop:
    """Owns worker `w`'s steps, one plan in flight, until the worker detaches (it left, or the server stops) or is
    lost. The step in flight lives here (a ScheduledStep from schedule() to update()), nowhere else. What the steps
    mean for requests goes to the engine (StepLoopOwner): `deliver` (tokens to their streams), `lose_worker` (the one
    place a loss is handled; `fail_worker` for a bug here) and `leaving_tick` (a leaving worker's drain)."""

    def __init__(self, engine: StepLoopOwner, w: WorkerHandle) -> None:
        self.engine = engine
        self.w = w
        self.step_timeout = engine.config.step_timeout
        self.vocab_size = engine.config.vocab_size

    async def run(self) -> None:
        """A step's tokens are published (detokenized, streamed) once the next plan is written: the worker computes
        meanwhile instead of waiting for 64 streams' writes (float32, 64 requests: 0.65 -> 0.52 s idle). A sample
        whose text hits a stop string there has one more token computed in the plan already sent, which update()
        drops as it does an abort's."""
        w, engine = self.w, self.engine
        pending: PendingStep | None = None
        step: ScheduledStep | None = None  # the step in flight
        ended = None  # why the loop ended: a Lost, or None (detached)
        try:
            while True:
                step = await self._next_step(wait=pending is None)  # schedule: waits while there is nothing to run
                if step is NOT_YET:  # nothing to run before the streams have this step: publish it, then wait
                    step = None
                    self._publish(pending)
                    pending = None
                    continue
                if not isinstance(step, ScheduledStep):
                    ended, step = step, None
                    break
                t0 = time.perf_counter()
                await self._send(step, pending is not None)
                if pending is not None:
                    await self._plan_written(w)
                    self._publish(pending)
                    pending = None
                result = await self._receive(step)
                if not isinstance(result, StepResult):
                    ended = result
                    break
                outputs = w.scheduler.update(step, result.sampled, result.num_accepted_drafts, result.prompt_logprobs)
                pending, step = PendingStep(step.plan, outputs, result, time.perf_counter() - t0), None
            if pending is not None:  # NOTE: before a loss recomputes its requests elsewhere
                self._publish(pending)
            if isinstance(ended, Lost):
                engine.lose_worker(w, ended, step)
        except Exception as e:  # a bug: end this worker's requests loudly rather than leave them hanging
            log.exception("step loop failed", worker=w.worker_id)
            engine.fail_worker(w, step, f"internal error on {w.worker_id}: {e}")

    async def _send(self, step: ScheduledStep, publishing: bool) -> None:
        """Fills the step's bitmasks (structured output) and queues its plan for the Attach stream to write."""
        w, plan = self.w, step.plan
        if due := step.constrained_due():  # structured output: each sample's allowed tokens
            # NOTE: on a thread, off the event loop: every other stream, health and the other workers'
            # loops go on meanwhile. Only this loop touches these matchers (update() runs after receive).
            masks = await asyncio.to_thread(fill_bitmasks, [r.constraint for r in due], self.vocab_size)
            plan.token_bitmasks = dict(zip([r.seq_id for r in due], masks))
        self.engine.trace_step(w, step)
        w.plan_sent.clear()
        w.outbox.put_nowait(plan)  # send: the Attach stream encodes and writes it

    @staticmethod
    async def _plan_written(w: WorkerHandle) -> None:
        """Until the Attach stream has written the plan just queued (or PLAN_WRITE_WAIT_SECONDS pass: a publish
        then goes ahead). NOTE: publishing wakes every client stream's writer; queued before the plan's write on the
        event loop, they held it back ~1 ms a step (float32, 64 requests: the worker's wait 2.1-2.3 -> 1.7 ms)."""
        try:
            await asyncio.wait_for(w.plan_sent.wait(), PLAN_WRITE_WAIT_SECONDS)
        except TimeoutError:
            pass

    async def _receive(self, step: ScheduledStep) -> StepResult | Lost:
        """The worker's answer to the step's plan, checked, or why none will come: a missed deadline, a failed step,
        a broken stream, a wrong answer. NOTE: one plan in flight per worker, so the next answer is this plan's.
        The first step has the same deadline as any: a worker warms up (first calls, kernel builds) before it
        registers (worker_svc.warm_up), and a longer first deadline let a silent new worker hold requests 4x as
        long (241 s)."""
        w, timeout, plan = self.w, self.step_timeout, step.plan
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
        wrong = check_result(plan.step_id, answer, step.due_samples(), self.vocab_size,
                             bitmasks=plan.token_bitmasks, banned=step.banned_samples(),
                             allowed=step.allowed_samples(), drafted=step.drafted,
                             prompt_due=step.prompt_logprobs_due())
        if wrong is not None:
            blamed = step.request_id_of(wrong.seq_id) if wrong.seq_id is not None else None
            return bad_result(plan.step_id, wrong.message, frozenset(() if blamed is None else (blamed,)))
        w.num_steps += 1
        return answer

    async def _next_step(self, wait: bool = True) -> ScheduledStep | Lost | object | None:
        """The worker's next step; a Lost when its stream broke or its drain ran out; None once it is detached;
        NOT_YET when there is nothing to run now and `wait` is False."""
        w = self.w
        while w.attached:
            if w.lost is not None:
                return w.lost
            if w.leaving and (lost := self.engine.leaving_tick(w)) is not None:
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

    def _publish(self, step: PendingStep) -> None:
        """Hands a step's tokens to the engine for their clients; then the step's metrics."""
        w, engine, plan, result = self.w, self.engine, step.plan, step.result
        engine.deliver(w, step.outputs, result.logprobs)
        m, wid = engine.metrics, w.label
        m.step.labels(wid).observe(step.step_seconds)
        if w.back_to_back:
            m.worker_idle.labels(wid).observe(result.idle_seconds)
        w.back_to_back = True
        if plan.preempted_seq_ids:
            log.info("preempted", worker=wid, seq_ids=list(plan.preempted_seq_ids),
                     total=w.scheduler.num_preemptions)
        m.batch_size.labels(wid).observe(plan.num_seqs)
        export(w, m)
        engine.export_fleet()
