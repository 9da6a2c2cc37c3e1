"""What a worker's registration can do to a scheduler (issue 50), with fake workers written from the protos against a
real scheduler process beside a real worker:

- a name out of bounds is refused (INVALID_ARGUMENT naming `name`), so names cannot grow /metrics;
- a worker's series go when it leaves, their counts moving to worker="departed": /metrics stays the size of the
  attached fleet however many workers came and went, and a sum over `worker` never drops;
- a worker claiming a shorter context than the scheduler's is refused (FAILED_PRECONDITION), so it fails no request;
- a worker that attaches and never answers holds the request routed to it for one --step-timeout, its first step's
  included, then the request completes on the real worker."""

from __future__ import annotations

import time

import grpc
import pytest

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc
from tests.support.service import (GreedyStream, Service, assert_idle_and_serving, metric_value, started_service,
                                   wait_until)
from tests.support.fake_worker import FakeWorker, registration
from tests.support.worker import assert_same_greedy, reference_greedy, reference_model

STEP_TIMEOUT = 8.0  # seconds: a hung worker's requests move after this (the real worker's steps take milliseconds)
PROMPTS = ([504, 3575, 282, 4649, 314, 17, 99, 1024], [7, 8, 9, 10, 11])
NEW = 12
ONE_MB = 1 << 20
# The per-worker counters and histograms: what a sum over `worker` must never lose
TOTALS = ("pagedserve_prefix_cache_queries_tokens_total", "pagedserve_prefill_tokens_total",
          "pagedserve_step_seconds_count", "pagedserve_step_seconds_sum", "pagedserve_batch_size_count",
          "pagedserve_batch_size_sum", "pagedserve_worker_idle_seconds_count")


@pytest.fixture(scope="module")
def svc(tiny_served_model):
    """Round-robin routing: of two requests sent while a fake worker is attached, one lands on it."""
    with started_service(tiny_served_model, "--routing", "round-robin", "--step-timeout", str(STEP_TIMEOUT),
                         "--max-workers", "3") as s:
        yield s


@pytest.fixture(scope="module")
def reference(tiny_served_model):
    model = reference_model(tiny_served_model)
    return {tuple(p): reference_greedy(model, p, NEW) for p in PROMPTS}


def worker_names(svc: Service) -> list[str]:
    with svc.channel() as ch:
        info = generate_pb2_grpc.GenerationStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=60)
    return [w.name for w in info.workers]


def has_series(text: str, name: str) -> bool:
    return f'worker="{name}"' in text


def attach(svc: Service, name: str, answering: bool = False) -> FakeWorker:
    fake = FakeWorker(svc.worker_listen, registration(svc.model_dir, name=name), answering=answering)
    wait_until(lambda: name in worker_names(svc))
    return fake


def idle(svc: Service, name: str) -> bool:
    """The worker registered as `name` holds no request and has answered every plan sent (its last one tells it
    which sequences ended)."""
    with svc.channel() as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        wid = next(w.worker_id for w in stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=60).workers
                   if w.name == name)
        answered = svc.metric("pagedserve_step_seconds_count", worker=name)
        state = stub.GetKVState(pb.GetKVStateRequest(worker_id=wid), timeout=60)
    return not state.sequences and not state.num_waiting and answered == state.num_steps


def gone(svc: Service, name: str) -> None:
    """Until the worker is detached and its series are gone from /metrics."""
    wait_until(lambda: name not in worker_names(svc) and not has_series(svc.scrape(), name))


# -- the name ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name, why", [
    ("x" * 8192, "8,192 characters, more than 80"), ("h" * 79 + ":1", "81 characters"),
    ('evil"} 1\nfake_metric{a="', "'\"'"), ("wörker:1", "'ö'"), ("a b:1", "' '")],
    ids=["8kb", "81-chars", "quote-newline", "non-ascii", "space"])
def test_a_name_out_of_bounds_is_refused_naming_name_and_gets_no_plan(svc, name, why):
    fake = FakeWorker(svc.worker_listen, registration(svc.model_dir, name=name))
    try:
        code, details = fake.ended()
    finally:
        fake.close()
    assert code == grpc.StatusCode.INVALID_ARGUMENT, (code, details)
    assert details.startswith("registration: name ") and why in details and "at most 80 characters" in details
    assert len(details) < 300  # the name is quoted short, whatever its length
    assert fake.num_plans == 0 and len(worker_names(svc)) == 1


def test_300_registrations_with_8_kb_names_are_refused_and_leave_metrics_under_1_mb(svc):
    before = len(svc.scrape())
    for batch in range(10):  # 30 at a time: the scheduler refuses each as it reads its registration
        fakes = [FakeWorker(svc.worker_listen, registration(svc.model_dir, name=f"{batch:02d}{i:02d}" + "x" * 8188))
                 for i in range(30)]
        try:
            assert {f.ended()[0] for f in fakes} == {grpc.StatusCode.INVALID_ARGUMENT}
        finally:
            for f in fakes:
                f.close()
    after = svc.scrape()
    assert len(after) < ONE_MB and "xxxxxxxx" not in after
    assert len(after) < before + 4096, (before, len(after))  # what a refusal leaves: nothing (the GC counts move)
    assert len(worker_names(svc)) == 1


# -- a worker's series when it leaves -----------------------------------------------------------------------------
def test_300_attach_detach_cycles_leave_metrics_as_large_as_with_one_worker(svc):
    fake = attach(svc, "cycle:0")
    fake.close()
    gone(svc, "cycle:0")  # NOTE: the first departure makes worker="departed"'s series: the baseline has them
    baseline = len(svc.scrape())
    for i in range(1, 301):
        fake = attach(svc, f"cycle:{i}")
        fake.close()
        gone(svc, f"cycle:{i}")
    text = svc.scrape()
    assert "cycle:" not in text and has_series(text, "departed")
    assert len(text) < baseline + 4096, (baseline, len(text))  # GC counts and timings move a little; no series
    assert metric_value(text, "pagedserve_workers") == 1


@pytest.mark.parametrize("how", ["leaves", "lost"])
def test_a_sum_over_workers_never_drops_when_a_worker_goes_and_departed_takes_its_counts(svc, reference, how):
    name = f"counted:{how}"
    fake = attach(svc, name, answering=True)  # answers each plan with token 5, well-formed
    streams = [GreedyStream(svc, p, NEW) for p in PROMPTS]  # round-robin: one on each worker
    for s in streams:
        s.result()
    wait_until(lambda: idle(svc, name))
    text = svc.scrape()
    assert metric_value(text, "pagedserve_prefill_tokens_total", worker=name) > 0  # it served one of them
    before = {m: metric_value(text, m) for m in TOTALS}
    mine = {m: metric_value(text, m, worker=name) for m in TOTALS}
    departed = {m: metric_value(text, m, worker="departed") for m in TOTALS}
    if how == "leaves":
        fake.leave()  # a deliberate shutdown: the scheduler ends the stream once it holds nothing
        assert fake.ended() == (grpc.StatusCode.OK, "")
    fake.close()  # lost: its stream breaks
    gone(svc, name)
    after = svc.scrape()
    for m in TOTALS:
        assert metric_value(after, m) >= before[m], m
        assert metric_value(after, m, worker="departed") == pytest.approx(departed[m] + mine[m]), m
    assert_idle_and_serving(svc)


# -- what it claims to serve --------------------------------------------------------------------------------------
def test_a_worker_claiming_a_shorter_context_is_refused_and_every_honest_request_succeeds(svc, reference):
    fake = FakeWorker(svc.worker_listen, registration(svc.model_dir, name="short:1", max_model_len=4))
    try:
        code, details = fake.ended()
    finally:
        fake.close()
    assert code == grpc.StatusCode.FAILED_PRECONDITION, (code, details)
    assert "max_model_len 4 is below the scheduler's 512" in details, details
    assert fake.num_plans == 0 and "short:1" not in worker_names(svc)
    # six, as in the attack: 5 of 6 failed
    streams = [GreedyStream(svc, p, NEW) for p in (*PROMPTS, *PROMPTS, *PROMPTS)]
    for s, p in zip(streams, (*PROMPTS, *PROMPTS, *PROMPTS)):
        assert_same_greedy(s.result(), *reference[tuple(p)])


# -- a worker that never answers ----------------------------------------------------------------------------------
def test_a_silent_new_worker_holds_its_request_one_step_timeout_and_it_completes_on_the_real_one(svc, reference):
    lost = svc.metric("pagedserve_workers_lost_total", reason="deadline")
    fake = attach(svc, "silent:1")
    try:
        start = time.monotonic()
        streams = [GreedyStream(svc, p, NEW) for p in PROMPTS]  # round-robin: one lands on the silent worker
        held = fake.next_plan()
        assert [list(n.token_ids) for n in held.new_seqs] in ([PROMPTS[0]], [PROMPTS[1]])
        for s, p in zip(streams, PROMPTS):
            assert_same_greedy(s.result(), *reference[tuple(p)])  # no error: recomputed on the real worker
        took = time.monotonic() - start
        assert fake.ended() == (grpc.StatusCode.OK, "")  # the scheduler closed the silent worker's stream
    finally:
        fake.close()
    # NOTE: its first step's deadline is the plain --step-timeout: 4x (32 s) before, 241 s at the default
    assert STEP_TIMEOUT <= took < 3 * STEP_TIMEOUT, took
    assert svc.metric("pagedserve_workers_lost_total", reason="deadline") == lost + 1
    gone(svc, "silent:1")
    assert_idle_and_serving(svc)
