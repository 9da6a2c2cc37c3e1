"""One attached worker as the scheduler sees it: its own Scheduler, its Attach stream's queues, its step loop."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Protocol

import structlog

from scheduler_svc.convert import plan_to_pb, result_from_pb
from scheduler_svc.core.plan import StepFailure, WorkerRegistration
from scheduler_svc.core.request import RequestOutput
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.metrics import Metrics

log = structlog.get_logger("pagedserve.scheduler")

FIRST_STEP_TIMEOUT_FACTOR = 4  # a worker's first step may compile kernels (NVRTC, the CPU kernel's cache)
LEAVING_POLL_SECONDS = 0.5


@dataclass(slots=True)
class WorkerHandle:
    worker_id: str
    registration: WorkerRegistration
    scheduler: Scheduler  # NOTE: this worker's block tables: its pool, its prefix cache, its requests
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)  # plan protobufs; None closes the stream
    inbox: asyncio.Queue = field(default_factory=asyncio.Queue)  # StepResult protobuf | StepFailure | None: gone
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)
    task: asyncio.Task | None = None
    attached: bool = True  # False once detached (lost, or left); its step loop then ends
    leaving: bool = False  # announced a deliberate shutdown: gets no new requests
    leave_deadline: float = 0.0  # monotonic time by which its running requests move elsewhere
    num_steps: int = 0
    num_prefix_queries: int = 0  # KV manager counters already exported
    num_prefix_hits: int = 0
    num_preemptions: int = 0
    num_prefill_tokens: int = 0


class Fleet(Protocol):
    """What the step loop needs from the engine."""

    metrics: Metrics
    step_timeout: float

    def dispatch(self, w: WorkerHandle, outputs: list[RequestOutput], result) -> None: ...
    def lose_worker(self, w: WorkerHandle, kind: str, reason: str, charge: bool = True) -> None: ...
    def leaving_tick(self, w: WorkerHandle) -> None: ...


async def run_steps(w: WorkerHandle, fleet: Fleet) -> None:
    """Plans a step, sends it, awaits the result under a deadline, applies it; until the worker detaches.

    NOTE: one plan in flight per worker. A worker that misses the deadline, whose stream ends, or that
    reports a failed step is lost: the engine recomputes its requests on the others.
    """
    sched, m, wid = w.scheduler, fleet.metrics, w.worker_id
    back_to_back = False  # NOTE: the worker's idle time counts only between steps that had work waiting
    while w.attached:
        if w.leaving:
            fleet.leaving_tick(w)
            if not w.attached:
                return
        plan = sched.schedule()
        if plan is None:
            w.wakeup.clear()
            if w.leaving:  # re-check its deadline now and then, even with nothing to run
                try:
                    await asyncio.wait_for(w.wakeup.wait(), LEAVING_POLL_SECONDS)
                except TimeoutError:
                    pass
            else:
                await w.wakeup.wait()
            back_to_back = False
            continue
        t0 = time.perf_counter()
        w.outbox.put_nowait(plan_to_pb(plan))
        timeout = fleet.step_timeout * (FIRST_STEP_TIMEOUT_FACTOR if w.num_steps == 0 else 1)
        try:
            answer = await asyncio.wait_for(w.inbox.get(), timeout)
        except TimeoutError:
            fleet.lose_worker(w, "deadline", f"no answer to step {plan.step_id} within {timeout:g} s")
            return
        if not w.attached:  # NOTE: detached while it waited (lost, or the server stops): its requests were
            return          # released or ended, so a result queued ahead of the detach is stale
        if answer is None:
            fleet.lose_worker(w, "stream", "its stream ended")
            return
        if isinstance(answer, StepFailure):
            fleet.lose_worker(w, "failed_step",
                              f"step {answer.step_id} failed ({answer.kind}): {answer.message}")
            return
        if answer.step_id != plan.step_id:
            raise RuntimeError(f"the worker answered step {answer.step_id} to plan {plan.step_id}")
        w.num_steps += 1
        outputs = sched.update(plan, result_from_pb(answer))
        m.step.labels(wid).observe(time.perf_counter() - t0)
        if back_to_back:
            m.worker_idle.labels(wid).observe(answer.idle_seconds)
        back_to_back = True
        if plan.preempted_seq_ids:
            log.info("preempted", worker=wid, seq_ids=list(plan.preempted_seq_ids), total=sched.num_preemptions)
        m.batch_size.labels(wid).observe(plan.num_seqs)
        fleet.dispatch(w, outputs, answer)
        export(w, m)


def export(w: WorkerHandle, m: Metrics) -> None:
    kv, wid = w.scheduler.kv, w.worker_id
    # NOTE: pool counters, not kv.stats(): that walks every sequence, and this runs every step.
    m.kv_blocks_used.labels(wid).set(kv.pool.num_used_blocks)
    m.kv_blocks_cached.labels(wid).set(kv.pool.num_cached_free_blocks)
    m.prefix_queries.labels(wid).inc(kv.prefix_query_tokens - w.num_prefix_queries)
    m.prefix_hits.labels(wid).inc(kv.prefix_hit_tokens - w.num_prefix_hits)
    m.preemptions.labels(wid).inc(w.scheduler.num_preemptions - w.num_preemptions)
    m.prefill_tokens.labels(wid).inc(w.scheduler.num_prefill_tokens - w.num_prefill_tokens)
    w.num_prefix_queries, w.num_prefix_hits = kv.prefix_query_tokens, kv.prefix_hit_tokens
    w.num_preemptions, w.num_prefill_tokens = w.scheduler.num_preemptions, w.scheduler.num_prefill_tokens
