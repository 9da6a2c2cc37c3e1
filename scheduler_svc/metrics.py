"""Prometheus metrics of the scheduler service (served as text at http://METRICS/metrics)."""

from __future__ import annotations

import functools
import threading
from collections.abc import Iterator

from prometheus_client import (CollectorRegistry, Counter, GCCollector, Gauge, Histogram, PlatformCollector,
                               ProcessCollector)
from prometheus_client.metrics_core import Metric

from scheduler_svc.metrics_protocol import ProtocolMetrics

# NOTE: up to 30 minutes and past it: docs/kv-cache.md's own CPU run has a 160 s TTFT.
_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600, 1800, 3600)
_CREATED_SUFFIXES = ("_created", "_gcreated")
LOST_KINDS = ("stream", "deadline", "failed_step", "bad_result", "leave_timeout")  # fleet.Lost.kind
MAX_TENANT_LABELS = 16  # tenants with series of their own; the rest share OTHER_TENANT's
OTHER_TENANT = "other"
# The `worker` label of the workers that have left: each one's counters and histograms are added to it as its own
# series go (Metrics.worker_left), so that /metrics holds the attached workers' series and one more set, however
# many have come and gone, and a sum over the label never drops.
DEPARTED = "departed"
_DEPARTED_HELP = f' (by worker; worker="{DEPARTED}" holds the counts of the workers that have left, added as each left)'


class TenantLabels:
    """The `tenant` label's values, bounded: the first MAX_TENANT_LABELS tenants to send a request keep their own
    name for the process's life, later ones are OTHER_TENANT. NOTE: first come rather than a moving top N: a
    series that changed hands would mix two tenants' counts. The shared tenant (no header) is the empty value."""

    def __init__(self, max_labels: int = MAX_TENANT_LABELS) -> None:
        self.max_labels = max_labels
        self.named: set[str] = set()

    def __call__(self, tenant: str) -> str:
        if tenant in self.named:
            return tenant
        if len(self.named) < self.max_labels and tenant != OTHER_TENANT:
            self.named.add(tenant)
            return tenant
        return OTHER_TENANT


class Registry(CollectorRegistry):
    """A registry without the *_created twin of each counter and histogram (a time series per label set that
    dashboards never read). NOTE: dropped here, at collection, not by prometheus_client's process-wide
    disable_created_metrics(), which would change every other registry in the process too.

    `lock`: a scrape reads every value under it, and Metrics.worker_left moves a worker's counts under it, so that
    a scrape sees them once (in the worker's series or in DEPARTED's), never twice nor not at all."""

    def __init__(self) -> None:
        super().__init__()
        self.lock = threading.Lock()

    def collect(self) -> Iterator[Metric]:
        with self.lock:  # NOTE: collected whole, then yielded: a consumer that stops early holds no lock
            metrics = list(super().collect())
        for metric in metrics:
            created = tuple(metric.name + suffix for suffix in _CREATED_SUFFIXES)
            if any(s.name in created for s in metric.samples):
                metric.samples = [s for s in metric.samples if s.name not in created]
            yield metric


class Metrics:
    """One registry per service, so that tests can run several in one process: the pagedserve_* series, the
    model-server protocol's vllm:* ones (`protocol`), and the process, platform and GC collectors. Per-worker
    series carry a `worker` label: the name the worker registered with (HOST:PID, WorkerHandle.label), so that a
    worker's series keep their meaning across scheduler restarts."""

    def __init__(self, model_name: str = "", max_model_len: int = 2048) -> None:
        r = self.registry = Registry()
        ProcessCollector(registry=r)
        PlatformCollector(registry=r)
        GCCollector(registry=r)
        # NOTE: declared family by family, in the order /metrics lists them
        per_worker = functools.partial(_per_worker, registry=r)
        self._add_load_gauges(r)
        self._add_worker_counters(per_worker)
        self._add_fleet_metrics(r)
        self._add_latency_histograms(r, per_worker)
        self._add_tenant_metrics(r)
        self.protocol = ProtocolMetrics(r, model_name, max_model_len)

        # NOTE: the `worker` labels whose series exist (DEPARTED's from the start: no worker may take it)
        self.labels_in_use: set[str] = {DEPARTED}

    def _add_load_gauges(self, r: Registry) -> None:
        """The requests running and waiting, and each worker's KV blocks."""
        self.requests_running = Gauge("pagedserve_requests_running", "Sequences holding KV blocks", registry=r)
        self.requests_waiting = Gauge("pagedserve_requests_waiting", "Sequences waiting to be admitted",
                                      registry=r)
        self.kv_blocks_used = Gauge("pagedserve_kv_blocks_used", "KV blocks held by live requests (ref count > 0)",
                                    ["worker"], registry=r)
        self.kv_blocks_cached = Gauge("pagedserve_kv_blocks_cached",
                                      "KV blocks free but still in the prefix cache (evictable)", ["worker"],
                                      registry=r)
        self.kv_blocks_total = Gauge("pagedserve_kv_blocks_total", "KV blocks in the worker's pool", ["worker"],
                                     registry=r)

    def _add_worker_counters(self, per_worker: functools.partial) -> None:
        """Each worker's prefix-cache, prefill, preemption and speculative-decoding counts."""
        self.prefix_queries = per_worker(Counter, "pagedserve_prefix_cache_queries_tokens", "Prompt tokens looked "
                                         "up in the prefix cache")
        self.prefix_hits = per_worker(Counter, "pagedserve_prefix_cache_hits_tokens", "Prompt tokens found in the "
                                      "prefix cache")
        self.prefill_tokens = per_worker(Counter, "pagedserve_prefill_tokens", "Prompt tokens computed "
                                         "(prefix-cache hits excluded, recomputation after preemption included)")
        self.preemptions = per_worker(Counter, "pagedserve_preemptions", "Sequences preempted (recomputed later)")
        self.spec_drafts = per_worker(Counter, "pagedserve_spec_decode_drafts", "Speculative decoding: sequences "
                                      "that drafted tokens, once per step")
        self.spec_draft_tokens = per_worker(Counter, "pagedserve_spec_decode_draft_tokens", "Speculative decoding: "
                                            "tokens drafted")
        self.spec_accepted_tokens = per_worker(Counter, "pagedserve_spec_decode_accepted_tokens", "Speculative "
                                               "decoding: drafted tokens the worker accepted (acceptance rate: these "
                                               "/ draft tokens)")

    def _add_fleet_metrics(self, r: Registry) -> None:
        """The workers attached and lost, and the requests moved between them."""
        self.workers = Gauge("pagedserve_workers", "Workers attached (leaving ones included)", registry=r)
        self.workers_lost = Counter("pagedserve_workers_lost", "Workers lost: their stream broke, they missed a step "
                                    "deadline, a step failed, or they answered one wrongly", ["reason"], registry=r)
        for kind in LOST_KINDS:  # NOTE: present (0) before the first loss, so that queries on them return data
            self.workers_lost.labels(kind)
        self.migrations = Counter("pagedserve_migrations", "Requests moved to another worker and recomputed there "
                                  "(their worker was lost, or left with them queued)", registry=r)

    def _add_latency_histograms(self, r: Registry, per_worker: functools.partial) -> None:
        """Request latencies, and each worker's step time, idle time and batch size."""
        self.ttft = Histogram("pagedserve_ttft_seconds", "Time to first token", buckets=_LATENCY, registry=r)
        self.itl = Histogram("pagedserve_itl_seconds", "Inter-token latency", buckets=_LATENCY, registry=r)
        self.e2e = Histogram("pagedserve_e2e_seconds", "Request latency, arrival to last token",
                             buckets=_LATENCY, registry=r)
        self.step = per_worker(Histogram, "pagedserve_step_seconds", "Scheduler step: plan, worker forward, "
                               "update", buckets=_LATENCY)
        self.worker_idle = per_worker(
            Histogram, "pagedserve_worker_idle_seconds", "Worker idle between two back-to-back steps: from sending a "
            "result to receiving the next plan (steps after a wait for work are not counted)",
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1))
        self.batch_size = per_worker(Histogram, "pagedserve_batch_size", "Sequences per step",
                                     buckets=(1, 2, 4, 8, 16, 32, 64, 128, 256, 512))

    def _add_tenant_metrics(self, r: Registry) -> None:
        """The fair policy's view of each tenant (its label bounded by TenantLabels)."""
        self.tenant_label = TenantLabels()
        self.tenant_service = Gauge("pagedserve_tenant_service", "The fair policy's counted service of the tenant: "
                                    "prompt tokens + 2 x output tokens computed, fleet-wide (lifted when it turns "
                                    "backlogged: no banked credit)", ["tenant"], registry=r)
        self.tenant_waiting = Gauge("pagedserve_tenant_requests_waiting", "Sequences of the tenant waiting to be "
                                    "admitted on a worker", ["tenant"], registry=r)
        self.tenant_ttft = Histogram("pagedserve_tenant_ttft_seconds", "Time to first token, by tenant",
                                     ["tenant"], buckets=_LATENCY, registry=r)

    # NOTE: when a worker leaves, its gauges go and its counters' and histograms' counts move to DEPARTED's.
    PER_WORKER_GAUGES = ("kv_blocks_used", "kv_blocks_cached", "kv_blocks_total")
    PER_WORKER_SERIES = ("prefix_queries", "prefix_hits", "prefill_tokens", "preemptions", "step", "worker_idle",
                         "batch_size", "spec_drafts", "spec_draft_tokens", "spec_accepted_tokens")

    def worker_attached(self, label: str, num_blocks: int) -> None:
        """Makes the worker's counters and histograms at 0, and its pool's size. NOTE: a series first scraped after
        its first increment shows no increase to rate(), so a worker whose admissions all fell between two scrapes
        would read as idle."""
        self.labels_in_use.add(label)
        self.kv_blocks_total.labels(label).set(num_blocks)
        for name in self.PER_WORKER_SERIES:
            getattr(self, name).labels(label)

    def worker_left(self, label: str) -> None:
        """The worker's series go: its gauges, and its counters and histograms, whose counts DEPARTED's take over
        (made at the first departure). Invariants: a sum over `worker` never drops, and /metrics holds the series
        of the attached workers and DEPARTED's alone, however many workers came and went."""
        self.remove_gauges(label)
        with self.registry.lock:
            for name in self.PER_WORKER_SERIES:
                _fold(getattr(self, name), label)
        self.labels_in_use.discard(label)

    def remove_gauges(self, label: str) -> None:
        for name in self.PER_WORKER_GAUGES:
            try:
                getattr(self, name).remove(label)
            except KeyError:  # never set, or gone already
                pass


def _per_worker(kind: type[Counter] | type[Histogram], name: str, doc: str, registry: Registry, **kw):
    """A counter or histogram by `worker`, whose counts go to DEPARTED's when a worker leaves (Metrics.worker_left)."""
    return kind(name, doc + _DEPARTED_HELP, ["worker"], registry=registry, **kw)


def _fold(metric: Counter | Histogram, label: str) -> None:
    """Adds the counts of worker `label`'s series to DEPARTED's and removes it. NOTE: prometheus_client has no public
    way to read a child's value or to add counts to a histogram's buckets: its children's value cells are used
    (tests/scheduler/test_worker_metrics.py pins the result on the exposition text)."""
    mine, theirs = metric.labels(label), metric.labels(DEPARTED)
    if isinstance(metric, Histogram):
        for cell, count in zip(theirs._buckets, mine._buckets, strict=True):
            cell.inc(count.get())
        theirs._sum.inc(mine._sum.get())
    else:
        theirs.inc(mine._value.get())
    metric.remove(label)
