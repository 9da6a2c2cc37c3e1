"""Spec tests for a worker's series when it leaves (scheduler_svc.metrics.Metrics.worker_left): they go, their
counts move to worker="departed", a sum over `worker` never drops (not even for a scrape racing the move), and the
exposition stays the size of the attached fleet however many workers came and went."""

from __future__ import annotations

import threading

from prometheus_client import generate_latest

from scheduler_svc.fleet import unique_label
from scheduler_svc.metrics import DEPARTED, Metrics

COUNTERS = ("pagedserve_prefix_cache_queries_tokens_total", "pagedserve_prefix_cache_hits_tokens_total",
            "pagedserve_prefill_tokens_total", "pagedserve_preemptions_total", "pagedserve_spec_decode_drafts_total",
            "pagedserve_spec_decode_draft_tokens_total", "pagedserve_spec_decode_accepted_tokens_total")
HISTOGRAMS = ("pagedserve_step_seconds", "pagedserve_worker_idle_seconds", "pagedserve_batch_size")


def text(m: Metrics) -> str:
    return generate_latest(m.registry).decode()


def total(exposition: str, name: str, worker: str | None = None) -> float:
    """The sum of `name`'s samples (over every worker, or `worker`'s)."""
    want = "" if worker is None else f'worker="{worker}"'
    return sum(float(line.rsplit(" ", 1)[1]) for line in exposition.splitlines()
               if line.startswith(name + "{") and want in line)


def served(m: Metrics, label: str, k: int) -> None:
    """Worker `label` attaches and counts a little of everything, `k` scaling it."""
    m.worker_attached(label, 64)
    for i, name in enumerate(m.PER_WORKER_SERIES):
        metric = getattr(m, name).labels(label)
        for _ in range(k):
            metric.observe(0.003 * (i + 1)) if hasattr(metric, "observe") else metric.inc(i + 1)
    m.kv_blocks_used.labels(label).set(3)


def test_a_leaving_workers_series_go_and_departed_holds_their_counts_bucket_by_bucket():
    m = Metrics("m")
    served(m, "a:1", 2)
    served(m, "b:2", 5)
    before = text(m)
    m.worker_left("a:1")
    after = text(m)
    assert 'worker="a:1"' not in after and 'worker="b:2"' in after
    for name in (*COUNTERS, *(h + s for h in HISTOGRAMS for s in ("_bucket", "_count", "_sum"))):
        assert total(after, name) == total(before, name), name
        assert total(after, name, DEPARTED) == total(before, name, "a:1"), name
    assert m.labels_in_use == {DEPARTED, "b:2"}


def test_departures_add_up_in_departed():
    m = Metrics("m")
    for k, label in enumerate(("a:1", "b:2", "c:3"), start=1):
        served(m, label, k)
    expected = total(text(m), "pagedserve_step_seconds_count")
    for label in ("a:1", "b:2", "c:3"):
        m.worker_left(label)
    assert total(text(m), "pagedserve_step_seconds_count", DEPARTED) == expected == 6


def test_the_exposition_stays_the_size_of_the_attached_fleet_however_many_workers_came_and_went():
    m = Metrics("m")
    served(m, "stays:1", 1)
    served(m, "once:0", 1)
    m.worker_left("once:0")  # DEPARTED's series exist from here on
    size = len(text(m).encode())
    for i in range(300):
        served(m, f"w{i}:{i}", 1)
        m.worker_left(f"w{i}:{i}")
    exposition = text(m)
    assert len(exposition.encode()) < size + 600, (size, len(exposition))  # the values' digits grow; no series
    assert 'worker="w' not in exposition


def test_a_sum_over_workers_never_drops_for_a_scrape_racing_the_departures():
    m, sums, stop = Metrics("m"), [], threading.Event()

    def scrape() -> None:
        while not stop.is_set():
            exposition = text(m)
            sums.append(tuple(total(exposition, name) for name in ("pagedserve_prefill_tokens_total",
                                                                   "pagedserve_step_seconds_count")))
    scraper = threading.Thread(target=scrape)
    scraper.start()
    try:
        for i in range(300):
            served(m, f"w:{i}", 1)
            m.worker_left(f"w:{i}")
    finally:
        stop.set()
        scraper.join()
    assert len(sums) > 1 and all(a <= b for a, b in zip(sums, sums[1:])), "a scrape saw a sum drop"


def test_departed_and_a_label_whose_series_remain_are_never_a_new_workers_label():
    m = Metrics("m")
    assert unique_label(DEPARTED, m.labels_in_use) == f"{DEPARTED}#2"
    m.worker_attached("pod:1", 8)
    assert unique_label("pod:1", m.labels_in_use) == "pod:1#2"
    m.worker_left("pod:1")  # its step loop ended: the name is free again
    assert unique_label("pod:1", m.labels_in_use) == "pod:1"
