"""A fake worker written from the protos, attached to a real scheduler next to a real worker: oversized
registrations are refused, a poisoned result loses the fake worker, and an honest client's request completes on
the real one with exactly the greedy tokens, no INTERNAL, every block back."""

from __future__ import annotations

import urllib.request

import grpc
import pytest

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc, worker_pb2
from tests.support.service import GreedyStream, Service, assert_idle_and_serving, started_service, wait_until
from tests.support.fake_worker import FakeWorker, registration
from tests.support.worker import assert_same_greedy, reference_greedy, reference_model

MAX_WORKERS = 3
PROMPT = [504, 3575, 282, 4649, 314, 17, 99, 1024]
BALLAST = [7, 8, 9, 10, 11]  # keeps the real worker busier than the fake one, so the honest request lands there
NEW = 24


@pytest.fixture(scope="module")
def svc(tiny_served_model):
    with started_service(tiny_served_model, "--routing", "least-loaded", "--max-workers", str(MAX_WORKERS),
                         kv_memory="2MiB") as s:
        yield s


@pytest.fixture(scope="module")
def reference(tiny_served_model):
    model = reference_model(tiny_served_model)
    return {tuple(p): reference_greedy(model, p, NEW) for p in (PROMPT, BALLAST)}


def workers(svc: Service) -> list[str]:
    with svc.channel() as ch:
        info = generate_pb2_grpc.GenerationStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=60)
    return [w.worker_id for w in info.workers]


def health(svc: Service) -> int:
    return urllib.request.urlopen(f"http://{svc.http}/health", timeout=60).status


def assert_still_serving(svc: Service, reference) -> None:
    """Health says so, an honest request gets exactly the greedy tokens, and every block is back."""
    assert health(svc) == 200
    assert_same_greedy(GreedyStream(svc, PROMPT, NEW).result(), *reference[tuple(PROMPT)])
    assert_idle_and_serving(svc)
    assert workers(svc) == ["worker-0"]  # the real worker, never lost


# -- oversized registrations -------------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, words", [
    (dict(num_blocks=2**32 - 1), ("num_blocks 4,294,967,295", "1 .. 4,194,304", "--max-worker-blocks")),
    (dict(num_blocks=10_000_000), ("num_blocks 10,000,000", "1 .. 4,194,304")),
    (dict(num_cpu_blocks=10_000_000), ("num_cpu_blocks 10,000,000", "0 .. 4,194,304")),
    (dict(block_size=0), ("block_size", ">= 1")),
    (dict(block_size=2**31), ("kv_geometry.block_size 2,147,483,648", "power of two from 8 to 256")),
    (dict(block_size=12), ("kv_geometry.block_size 12", "power of two from 8 to 256")),
    (dict(max_model_len=0), ("max_model_len 0", ">= 1")),
    (dict(dtype="int4"), ("kv_geometry.dtype", "int8, fp8_e4m3, fp8_e5m2", "got 'int4'")),
])
def test_an_oversized_registration_is_refused_naming_the_field_and_bound(svc, reference, fields, words):
    fake = FakeWorker(svc.worker_listen, registration(svc.model_dir, **fields))
    code, details = fake.ended()
    fake.close()
    assert code == grpc.StatusCode.INVALID_ARGUMENT and all(w in details for w in words), details
    assert_still_serving(svc, reference)


def test_a_large_honest_pool_attaches_and_its_map_is_refused_by_name(svc, reference):
    fake = FakeWorker(svc.worker_listen, registration(svc.model_dir, num_blocks=4_000_000))
    try:
        wait_until(lambda: len(workers(svc)) == 2)
        big = workers(svc)[1]
        with svc.channel() as ch, pytest.raises(grpc.RpcError) as e:
            generate_pb2_grpc.GenerationStub(ch).GetKVState(pb.GetKVStateRequest(worker_id=big), timeout=60)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "4,000,000 KV blocks" in e.value.details() and "1,048,576" in e.value.details()
    finally:
        fake.close()
    wait_until(lambda: len(workers(svc)) == 1)
    assert_still_serving(svc, reference)


def test_a_full_fleet_refuses_one_more_worker(svc, reference):
    fakes = [FakeWorker(svc.worker_listen, registration(svc.model_dir)) for _ in range(MAX_WORKERS - 1)]
    try:
        wait_until(lambda: len(workers(svc)) == MAX_WORKERS)
        one_more = FakeWorker(svc.worker_listen, registration(svc.model_dir))
        code, details = one_more.ended()
        one_more.close()
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert f"{MAX_WORKERS} workers are attached" in details and "--max-workers" in details, details
    finally:
        for f in fakes:
            f.close()
    wait_until(lambda: len(workers(svc)) == 1)
    assert_still_serving(svc, reference)


# -- poisoned results --------------------------------------------------------------------------------------------
def poisoned(kind: str, plan: worker_pb2.StepPlan) -> worker_pb2.StepResult:
    (seq,) = [n.seq_id for n in plan.new_seqs]
    result = worker_pb2.StepResult(step_id=plan.step_id)
    if kind == "token_id":
        result.tokens.add(seq_id=seq, token_id=2**32 - 1)
    elif kind == "step_id":
        result.step_id += 1
        result.tokens.add(seq_id=seq, token_id=5)
    elif kind == "extra_seq":
        result.tokens.add(seq_id=seq, token_id=5)
        result.tokens.add(seq_id=seq + 1000, token_id=5)
    elif kind == "twice":
        result.tokens.add(seq_id=seq, token_id=5)
        result.tokens.add(seq_id=seq, token_id=6)
    elif kind.startswith("logprob"):
        t = result.tokens.add(seq_id=seq, token_id=5)
        t.logprobs.sampled.token_id, t.logprobs.sampled.logprob = 5, {"logprob_nan": float("nan"),
                                                                      "logprob_positive": 3.0}.get(kind, -0.5)
        if kind == "logprob_token":
            t.logprobs.top.add(token_id=2**32 - 1, logprob=-0.1)
    # "missing_seq": no token at all
    return result


@pytest.mark.parametrize("kind, logprobs", [
    ("token_id", None), ("step_id", None), ("missing_seq", None), ("extra_seq", None), ("twice", None),
    ("logprob_nan", 2), ("logprob_positive", 2), ("logprob_token", 2), ("logprob_unasked", None),
])
def test_a_poisoned_result_loses_the_fake_worker_and_the_request_completes_on_the_real_one(svc, reference, kind,
                                                                                         logprobs):
    lost = svc.metric("pagedserve_workers_lost_total", reason="bad_result")
    sampling = {} if logprobs is None else {"logprobs": logprobs}
    with svc.worker_paused():  # the ballast's first step stays in flight: the real worker is the busier one
        ballast = GreedyStream(svc, BALLAST, NEW)
        wait_until(lambda: len(svc.live_request_ids()) == 1)  # planned on the real worker, its step in flight
        fake = FakeWorker(svc.worker_listen, registration(svc.model_dir))
        try:
            wait_until(lambda: len(workers(svc)) == 2)
            honest = GreedyStream(svc, PROMPT, NEW, **sampling)
            plan = fake.next_plan()
            assert [list(n.token_ids) for n in plan.new_seqs] == [PROMPT]  # the honest request landed on the fake
            fake.send(poisoned(kind, plan))
            assert fake.ended() == (grpc.StatusCode.OK, "")  # the scheduler closed the fake worker's stream
        finally:
            fake.close()
    assert_same_greedy(honest.result(), *reference[tuple(PROMPT)])  # recomputed on the real worker; no INTERNAL
    assert_same_greedy(ballast.result(), *reference[tuple(BALLAST)])
    assert svc.metric("pagedserve_workers_lost_total", reason="bad_result") == lost + 1
    assert_still_serving(svc, reference)
