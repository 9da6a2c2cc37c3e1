"""One attached worker as the scheduler sees it: its own Scheduler, and its Attach stream as send and receive."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from pagedserve_common.plan import StepPlan
from pagedserve_common.registration import WorkerRegistration
from pagedserve_common.result import StepError, StepResult
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.metrics import Metrics

FIRST_STEP_TIMEOUT_FACTOR = 4  # a worker's first step may compile kernels (NVRTC, the CPU kernel's cache)


@dataclass(slots=True, frozen=True)
class Lost:
    """Why a worker can serve no more: the engine recomputes its requests elsewhere. `kind` labels
    pagedserve_workers_lost_total (stream, deadline, failed_step, leave_timeout); with `charge`, the requests in
    its step in flight count a migration against --max-migrations."""

    kind: str
    reason: str
    charge: bool = True


@dataclass(slots=True)
class WorkerHandle:
    worker_id: str
    registration: WorkerRegistration
    scheduler: Scheduler  # NOTE: this worker's block tables: its pool, its prefix cache, its requests
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)  # StepPlan to send; None closes the stream
    inbox: asyncio.Queue = field(default_factory=asyncio.Queue)  # StepResult | StepError | Lost | None
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)  # new work, a leave or a loss: plan again
    task: asyncio.Task | None = None
    attached: bool = True  # False once detached (lost, or left); its step loop then ends
    lost: Lost | None = None  # set by the Attach stream when it breaks; the step loop ends on it
    leaving: bool = False  # announced a deliberate shutdown: gets no new requests
    leave_deadline: float = 0.0  # monotonic time by which its running requests move elsewhere
    num_steps: int = 0
    back_to_back: bool = False  # NOTE: the worker's idle time counts only between steps that had work waiting
    num_prefix_queries: int = 0  # KV manager counters already exported
    num_prefix_hits: int = 0
    num_preemptions: int = 0
    num_prefill_tokens: int = 0

    def fail(self, lost: Lost) -> None:
        """The stream broke (or was refused): the step loop ends on `lost`, now or when its step returns."""
        if self.lost is None:
            self.lost = lost
        self.inbox.put_nowait(lost)
        self.wakeup.set()

    def send(self, plan: StepPlan) -> None:
        self.outbox.put_nowait(plan)

    async def receive(self, plan: StepPlan, step_timeout: float) -> StepResult | Lost:
        """The worker's answer to `plan`, or why none will come: a missed deadline, a failed step, a broken stream.
        NOTE: one plan in flight per worker, so the next answer is this plan's."""
        timeout = step_timeout * (FIRST_STEP_TIMEOUT_FACTOR if self.num_steps == 0 else 1)
        try:
            answer = await asyncio.wait_for(self.inbox.get(), timeout)
        except TimeoutError:
            return Lost("deadline", f"no answer to step {plan.step_id} within {timeout:g} s")
        if answer is None:  # detached while it waited: its requests were released or ended already
            return Lost("stream", "its stream ended")
        if isinstance(answer, Lost):
            return answer
        if isinstance(answer, StepError):
            return Lost("failed_step", f"step {answer.step_id} failed ({answer.kind.name}): {answer.message}")
        if answer.step_id != plan.step_id:
            raise RuntimeError(f"the worker answered step {answer.step_id} to plan {plan.step_id}")
        self.num_steps += 1
        return answer


def export(w: WorkerHandle, m: Metrics) -> None:
    """The worker's pool gauges and counters, after a step."""
    kv, wid = w.scheduler.kv, w.worker_id
    # NOTE: pool counters, not a walk over every sequence: this runs every step.
    m.kv_blocks_used.labels(wid).set(kv.pool.num_used_blocks)
    m.kv_blocks_cached.labels(wid).set(kv.pool.num_cached_free_blocks)
    m.prefix_queries.labels(wid).inc(kv.prefix_query_tokens - w.num_prefix_queries)
    m.prefix_hits.labels(wid).inc(kv.prefix_hit_tokens - w.num_prefix_hits)
    m.preemptions.labels(wid).inc(w.scheduler.num_preemptions - w.num_preemptions)
    m.prefill_tokens.labels(wid).inc(w.scheduler.num_prefill_tokens - w.num_prefill_tokens)
    w.num_prefix_queries, w.num_prefix_hits = kv.prefix_query_tokens, kv.prefix_hit_tokens
    w.num_preemptions, w.num_prefill_tokens = w.scheduler.num_preemptions, w.scheduler.num_prefill_tokens
