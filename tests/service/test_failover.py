"""Real processes on loopback: a scheduler and 3 workers; kill -9, SIGSTOP, late workers, a restarted scheduler."""

from __future__ import annotations

import os
import signal

import pytest

from pagedserve_common.config import SCHEDULING_POLICIES
from tests.support.service import metric_value, scrape
from tests.support.fleet import NEW, PROMPTS, Streams, busiest_worker, fleet_of, kill_busiest
from tests.support.worker import assert_same_greedy, reference_greedy, reference_model


@pytest.fixture(scope="module", params=SCHEDULING_POLICIES)
def policy_fleet(tiny_served_model, request):
    """Under each scheduling policy: a worker's loss, a hang, a late worker, a restarted scheduler and a drain keep
    every stream's greedy tokens whatever the admission order (Streams: three tenants, three priorities)."""
    with fleet_of(tiny_served_model, 3, scheduling_policy=request.param) as f:
        yield f


@pytest.fixture(scope="module")
def reference(tiny_served_model):
    model = reference_model(tiny_served_model)
    return [reference_greedy(model, p, NEW) for p in PROMPTS]


def test_kill_9_of_a_worker_mid_generation_loses_no_stream(policy_fleet, reference):
    ids = policy_fleet.wait_workers(3)
    names = {w.worker_id: w.name for w in policy_fleet.info().workers}
    streams = Streams(policy_fleet, PROMPTS)
    streams.wait_started()
    victim = kill_busiest(policy_fleet, ids)
    streams.join()
    assert streams.errors == []
    for got, ref in zip(streams.tokens, reference):
        assert_same_greedy(got, *ref)
    assert policy_fleet.metric("pagedserve_migrations_total") > 0
    assert len(policy_fleet.wait_workers(2)) == 2
    # Per-worker series carry the name each worker registered with; the lost one's gauges are gone.
    assert all(policy_fleet.metric("pagedserve_step_seconds_count", worker=names[w]) > 0 for w in ids if w != victim)
    assert 'pagedserve_kv_blocks_total{worker="%s"}' % names[victim] not in scrape(policy_fleet.metrics)


def test_a_stopped_worker_loses_its_requests_after_the_step_timeout_then_comes_back(policy_fleet, reference):
    ids = policy_fleet.wait_workers(2)
    streams = Streams(policy_fleet, PROMPTS)
    streams.wait_started()
    victim = busiest_worker(policy_fleet, ids)
    pid = policy_fleet.pid_of(victim)
    os.kill(pid, signal.SIGSTOP)  # hung: its TCP connection stays up, it just never answers
    try:
        streams.join()
    finally:
        os.kill(pid, signal.SIGCONT)
    assert streams.errors == []
    for got, ref in zip(streams.tokens, reference):
        assert_same_greedy(got, *ref)
    # Resumed, it finds its stream ended and registers again, with an empty pool and a new id.
    again = policy_fleet.wait_workers(2)
    assert victim not in again
    assert sorted(int(w.name.rsplit(":", 1)[1]) for w in policy_fleet.info().workers) == \
        sorted(p.pid for p in policy_fleet.workers if p.poll() is None)


def test_a_worker_attached_later_takes_traffic(policy_fleet, reference):
    before = set(policy_fleet.wait_workers(2))
    policy_fleet.add_worker()
    late = sorted(set(policy_fleet.wait_workers(3)) - before)
    assert len(late) == 1
    late_name = policy_fleet.name_of(late[0])
    assert policy_fleet.metric("pagedserve_kv_blocks_total", worker=late_name) > 0  # its series exist, under its name
    assert policy_fleet.metric("pagedserve_step_seconds_count", worker=late_name) == 0
    streams = Streams(policy_fleet, PROMPTS)
    streams.join()
    assert streams.errors == []
    for got, ref in zip(streams.tokens, reference):
        assert_same_greedy(got, *ref)
    assert policy_fleet.metric("pagedserve_step_seconds_count", worker=late_name) > 0


def test_workers_dial_in_again_to_a_restarted_scheduler(policy_fleet, reference):
    policy_fleet.wait_workers(3)
    names = sorted(w.name for w in policy_fleet.info().workers)
    policy_fleet.scheduler.kill()
    policy_fleet.scheduler.wait()
    policy_fleet.scheduler = policy_fleet.start_scheduler()
    assert len(policy_fleet.wait_workers(3)) == 3  # every living worker registered with the new scheduler
    assert sorted(int(w.name.rsplit(":", 1)[1]) for w in policy_fleet.info().workers) == \
        sorted(p.pid for p in policy_fleet.workers if p.poll() is None)
    streams = Streams(policy_fleet, PROMPTS[:3])
    streams.join()
    assert streams.errors == []
    for got, ref in zip(streams.tokens, reference[:3]):
        assert_same_greedy(got, *ref)
    # the new scheduler's per-worker series carry the same names as the old one's: they keep their meaning
    text = scrape(policy_fleet.metrics)
    assert sorted(w.name for w in policy_fleet.info().workers) == names
    assert all(metric_value(text, "pagedserve_kv_blocks_total", worker=n) > 0 for n in names)


def test_sigterm_to_a_worker_hands_its_work_over_and_it_exits_0(policy_fleet, reference):
    ids = policy_fleet.wait_workers(3)
    streams = Streams(policy_fleet, PROMPTS)
    streams.wait_started()
    victim = busiest_worker(policy_fleet, ids)
    proc = next(p for p in policy_fleet.workers if p.pid == policy_fleet.pid_of(victim))
    proc.send_signal(signal.SIGTERM)  # it announces it leaves; its queue moves, its running requests finish
    assert proc.wait(timeout=120) == 0
    streams.join()
    assert streams.errors == []
    for got, ref in zip(streams.tokens, reference):
        assert_same_greedy(got, *ref)
    assert victim not in policy_fleet.wait_workers(2)
