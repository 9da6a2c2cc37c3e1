"""The attached workers: each one's handle (its Scheduler and its Attach stream's queues), the Fleet that takes
them in and lets them go, and their metrics."""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

import structlog

from pagedserve_common.config import EngineOptions
from pagedserve_common.registration import MAX_NAME_CHARS, WorkerRegistration, name_error
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.speculation import SpecCounters
from scheduler_svc.core.waiting import ServiceCounter
from scheduler_svc.errors import EngineError, ErrorCode
from scheduler_svc.kv.manager import VALID_BLOCK_SIZES
from scheduler_svc.metrics import Metrics

log = structlog.get_logger("pagedserve.scheduler")


@dataclass(slots=True, frozen=True)
class Lost:
    """Why a worker can serve no more: the engine recomputes its requests elsewhere. `kind` labels
    pagedserve_workers_lost_total (stream, deadline, failed_step, bad_result, leave_timeout); with `charge`, the
    requests in its step in flight count a migration against --max-migrations, else only `charged_request_ids`.
    NOTE: a bad_result (an answer that contradicts its plan or the vocabulary) is the worker's fault: never charged
    to the requests batched with it, only to the one whose own entry was wrong (honest workers that all answer one
    request wrongly, NaN logprobs say, then end it with INTERNAL after --max-migrations instead of cycling)."""

    kind: str
    reason: str
    charge: bool = True
    charged_request_ids: frozenset[str] = frozenset()


def bad_result(step_id: int, wrong: str, charged_request_ids: frozenset[str] = frozenset()) -> Lost:
    """A worker whose answer to step `step_id` is wrong (`wrong` names the field and the sequence)."""
    return Lost("bad_result", f"its answer to step {step_id} is wrong: {wrong}", False, charged_request_ids)


@dataclass(slots=True)
class WorkerHandle:
    worker_id: str
    registration: WorkerRegistration
    scheduler: Scheduler  # NOTE: this worker's block tables: its pool, its prefix cache, its requests
    outbox: asyncio.Queue = field(default_factory=asyncio.Queue)  # StepPlan to send; None closes the stream
    inbox: asyncio.Queue = field(default_factory=asyncio.Queue)  # StepResult | StepError | Lost | None
    wakeup: asyncio.Event = field(default_factory=asyncio.Event)  # new work, a leave or a loss: plan again
    # set by the Attach stream once it has written the last plan queued (and when the stream ends)
    plan_sent: asyncio.Event = field(default_factory=asyncio.Event)
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
    # NOTE: its per-worker series' `worker` label: the name it registered with (HOST:PID), stable across scheduler
    # restarts; "" takes the name (or the worker id for a nameless one). Fleet.attach makes it unique among
    # the labels whose series exist (Metrics.labels_in_use): its series go when its step loop has ended.
    label: str = ""

    def __post_init__(self) -> None:
        self.label = self.label or self.registration.name or self.worker_id

    def fail(self, lost: Lost) -> None:
        """The stream broke (or was refused): the step loop ends on `lost`, now or when its step returns."""
        if self.lost is None:
            self.lost = lost
        self.inbox.put_nowait(lost)
        self.wakeup.set()
        self.plan_sent.set()


def export(w: WorkerHandle, m: Metrics) -> None:
    """The worker's pool gauges and counters, after a step."""
    kv, wid, p = w.scheduler.kv, w.label, m.protocol
    # NOTE: pool counters, not a walk over every sequence: this runs every step.
    m.kv_blocks_used.labels(wid).set(kv.pool.num_used_blocks)
    m.kv_blocks_cached.labels(wid).set(kv.pool.num_cached_free_blocks)
    queries, hits = kv.prefix_query_tokens - w.num_prefix_queries, kv.prefix_hit_tokens - w.num_prefix_hits
    preemptions = w.scheduler.num_preemptions - w.num_preemptions
    m.prefix_queries.labels(wid).inc(queries)
    m.prefix_hits.labels(wid).inc(hits)
    m.preemptions.labels(wid).inc(preemptions)
    p.prefix_queries.inc(queries)
    p.prefix_hits.inc(hits)
    p.preemptions.inc(preemptions)
    m.prefill_tokens.labels(wid).inc(w.scheduler.num_prefill_tokens - w.num_prefill_tokens)
    w.num_prefix_queries, w.num_prefix_hits = kv.prefix_query_tokens, kv.prefix_hit_tokens
    w.num_preemptions, w.num_prefill_tokens = w.scheduler.num_preemptions, w.scheduler.num_prefill_tokens
    if w.scheduler.spec is not None:
        _export_spec(w.scheduler.spec.take_counters(), wid, m)


def _export_spec(c: SpecCounters, wid: str, m: Metrics) -> None:
    """Speculative decoding's counters since the last step (the series exist from the first step on, at 0)."""
    p = m.protocol
    for mine, theirs, n in ((m.spec_drafts, p.spec_drafts, c.num_drafts),
                            (m.spec_draft_tokens, p.spec_draft_tokens, c.num_draft_tokens),
                            (m.spec_accepted_tokens, p.spec_accepted_tokens, c.num_accepted_tokens)):
        mine.labels(wid).inc(n)
        theirs.inc(n)
    for j, n in enumerate(c.accepted_per_pos):
        p.spec_accepted_per_pos.labels(p.model_name, str(j)).inc(n)


def export_fleet(m: Metrics, fleet: Fleet, num_unplaced: int) -> None:
    """The fleet-wide gauges: requests running and waiting (`num_unplaced`: waiting for a worker), KV usage over the
    attached workers."""
    workers = fleet.workers.values()
    running = sum(x.scheduler.num_running for x in workers)
    waiting = sum(x.scheduler.num_waiting for x in workers) + num_unplaced
    m.requests_running.set(running)
    m.requests_waiting.set(waiting)
    m.protocol.running.set(running)
    m.protocol.waiting.set(waiting)
    used = sum(x.scheduler.kv.pool.num_used_blocks for x in workers)
    total = sum(x.registration.num_blocks for x in workers)
    m.protocol.kv_usage.set(used / total if total else 0.0)  # NOTE: cached-but-evictable blocks count as free
    export_tenants(m, fleet)


def export_tenants(m: Metrics, fleet: Fleet) -> None:
    """Each tenant's counted service and sequences waiting on the workers, under its bounded label (a label's
    value: the sum over the tenants it stands for). NOTE: O(tenants), not O(queue): the queues keep the counts."""
    label = m.tenant_label
    waiting: dict[str, int] = dict.fromkeys(label.named, 0)
    for w in fleet.workers.values():
        for tenant, n in w.scheduler.waiting.num_waiting_by_tenant.items():
            key = label(tenant)
            waiting[key] = waiting.get(key, 0) + n
    for key, n in waiting.items():
        m.tenant_waiting.labels(key).set(n)
    service: dict[str, float] = {}
    for tenant, s in fleet.service.service.items():
        key = label(tenant)
        service[key] = service.get(key, 0.0) + s
    for key, s in service.items():
        m.tenant_service.labels(key).set(s)


def unique_label(name: str, taken: set[str]) -> str:
    """`name`, or name#2, name#3, ... while a worker's series hold it. NOTE: a restarted worker process can
    register with its old name (a container's PID is 1 again) before the scheduler has seen the old stream break:
    both are attached for a while, and their gauges must not overwrite each other's."""
    label, k = name, 2
    while label in taken:
        label, k = f"{name}#{k}", k + 1
    return label


def check_registration(reg: WorkerRegistration, max_blocks: int) -> None:
    """Raises INVALID_ARGUMENT naming the field and its bound when a registration is out of bounds. NOTE: a
    max_model_len above the scheduler's is fine: the scheduler's applies; one below it is refused (check_serves)."""
    if (why := name_error(reg.name)) is not None:
        raise EngineError(ErrorCode.INVALID_ARGUMENT, f"registration: name {_quoted(reg.name)} is out of bounds: {why} "
                          f"(a worker's name is at most {MAX_NAME_CHARS} characters: HOST:PID)", "name")
    bounds = (("num_blocks", reg.num_blocks, 1, max_blocks, " (--max-worker-blocks)"),
              ("num_cpu_blocks", reg.num_cpu_blocks, 0, max_blocks, " (--max-worker-blocks)"),
              ("max_model_len", reg.max_model_len, 1, None, ""))
    for name, value, low, high, flag in bounds:
        if value < low or (high is not None and value > high):
            bound = f"in {low:,} .. {high:,}{flag}" if high is not None else f">= {low}"
            raise EngineError(ErrorCode.INVALID_ARGUMENT, f"registration: {name} {value:,} is out of bounds: it must "
                              f"be {bound}", name)
    if reg.block_size not in VALID_BLOCK_SIZES:
        raise EngineError(ErrorCode.INVALID_ARGUMENT, f"registration: kv_geometry.block_size {reg.block_size:,} "
                          "is not a power of two from 8 to 256", "kv_geometry.block_size")


def check_serves(reg: WorkerRegistration, model_id: str, max_model_len: int) -> None:
    """Raises FAILED_PRECONDITION unless the worker serves every request the scheduler admits: the scheduler's
    model, with no shorter a context. NOTE: a worker that claimed less once made 5 of 6 honest requests fail (400):
    the scheduler checks a request against its own max_model_len, then against its worker's. (A vocabulary size
    is not in the registration: the model_id stands for it.)"""
    if reg.model_id != model_id:
        raise EngineError(ErrorCode.FAILED_PRECONDITION,
                          f"model_id {_quoted(reg.model_id, 200)} differs from the scheduler's {model_id!r}")
    if reg.max_model_len < max_model_len:
        raise EngineError(ErrorCode.FAILED_PRECONDITION,
                          f"registration: max_model_len {reg.max_model_len:,} is below the scheduler's "
                          f"{max_model_len:,} (--max-model-len within the model's): this worker could not serve "
                          "every request the scheduler admits", "max_model_len")


def _quoted(value: str, limit: int = 40) -> str:
    """What a peer sent, quoted short whatever its length (an error's details and the log stay small)."""
    return repr(value[:limit]) + (f" (+{len(value) - limit:,} characters)" if len(value) > limit else "")


class Fleet:
    """Owned by the Engine: the attached workers, each with its own Scheduler (its pool's block tables), made from
    the engine's flags and the worker's registration. NOTE: what a worker's coming and going means for requests
    (placement, migration, failure) is the engine's; this takes workers in and lets them go."""

    def __init__(self, config: EngineOptions, metrics: Metrics, service: ServiceCounter) -> None:
        """`config`: the engine's (scheduler_svc.engine.EngineConfig: these flags and the model's limits)."""
        self.config = config
        self.metrics = metrics
        self.service = service  # the fair policy's tenants' service, fleet-wide: every Scheduler's
        self.workers: dict[str, WorkerHandle] = {}
        self.last_worker_left: float | None = None  # monotonic; None while no worker has ever left
        self._worker_ids = itertools.count()
        # NOTE: sequence ids come from one counter shared by all workers' schedulers: unique across the fleet (a
        # moved sequence gets a fresh one)
        self._seq_ids = itertools.count()

    def attach(self, reg: WorkerRegistration, origin: Mapping[str, str] | None = None) -> WorkerHandle:
        """Checks the registration and takes the worker in; `origin` (who dialled in: peer, certificate subject or
        token id) goes to the log. Raises EngineError naming the field at fault."""
        cfg = self.config
        check_registration(reg, cfg.max_worker_blocks)
        check_serves(reg, cfg.model_id, cfg.max_model_len)
        if len(self.workers) >= cfg.max_workers:
            raise EngineError(ErrorCode.RESOURCE_EXHAUSTED, f"{len(self.workers)} workers are attached, the most "
                              f"--max-workers allows ({cfg.max_workers}); retry later")
        try:
            sched = Scheduler(SchedulerConfig.for_worker(cfg, reg), seq_ids=self._seq_ids, service=self.service)
        except ValueError as e:  # e.g. swap space under a static kv_allocation
            raise EngineError(ErrorCode.FAILED_PRECONDITION, str(e)) from None
        w = WorkerHandle(f"worker-{next(self._worker_ids)}", reg, sched)
        w.label = unique_label(w.label, self.metrics.labels_in_use)
        self.workers[w.worker_id] = w
        self.metrics.worker_attached(w.label, reg.num_blocks)
        log.info("worker attached", worker=w.worker_id, name=reg.name, metrics_label=w.label, num_blocks=reg.num_blocks,
                 block_size=reg.block_size, kv_cache_dtype=reg.dtype, device=reg.device, **(origin or {}))
        return w

    def detach(self, w: WorkerHandle) -> None:
        """Ends the worker's step loop and its Attach stream (a worker still running registers again); its
        per-worker series go when the loop has ended (Metrics.worker_left)."""
        w.attached = False
        self.workers.pop(w.worker_id, None)
        if not self.workers:
            self.last_worker_left = time.monotonic()
        w.inbox.put_nowait(None)
        w.outbox.put_nowait(None)
        w.wakeup.set()
        self.metrics.remove_gauges(w.label)  # NOTE: at once: they describe the fleet now

    def routable(self) -> list[WorkerHandle]:
        """The workers that take new requests (all but the leaving ones)."""
        return [w for w in self.workers.values() if not w.leaving]

    def no_worker_reason(self) -> str:
        """Why no worker takes a new request now; honest about the past (none yet, or the last one left)."""
        if self.workers:
            return "no worker takes new requests: every attached worker is leaving"
        if self.last_worker_left is None:
            return "no worker is attached yet"
        return f"no worker is attached (the last one left {time.monotonic() - self.last_worker_left:.0f} s ago)"
