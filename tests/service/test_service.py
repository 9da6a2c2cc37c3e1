"""The scheduler and a worker as real processes on loopback, driven through the client API."""

from __future__ import annotations

import random
import threading

import grpc
import pytest

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc
from tests.support.service import KV_MEMORY, MAX_BATCHED, wait_until
from tests.support.worker import assert_same_greedy, reference_greedy, reference_model

PROMPTS = [[random.Random(100 + i).randrange(3, 49152) for _ in range(random.Random(i).randint(4, 60))]
           for i in range(32)]
NEW = 20


@pytest.fixture(scope="module")
def reference(service):
    model = reference_model(service.model_dir)
    cache = {}

    def ref(prompt: list[int], new: int = NEW):
        key = (tuple(prompt), new)
        if key not in cache:
            cache[key] = reference_greedy(model, prompt, new)
        return cache[key]
    return ref


def generate(service, prompt_ids=None, prompt=None, timeout=120, **sampling) -> tuple[dict, list]:
    """Streams one request; returns {index: token ids}, and every response message."""
    with service.channel() as ch:
        req = pb.GenerateRequest(sampling=pb.SamplingParams(**sampling))
        if prompt is not None:
            req.prompt = prompt
        else:
            req.prompt_token_ids.extend(prompt_ids)
        msgs = list(generate_pb2_grpc.GenerationStub(ch).Generate(req, timeout=timeout))
    out: dict[int, list[int]] = {}
    for m in msgs:
        out.setdefault(m.index, []).extend(m.token_ids)
    return out, msgs


def test_streamed_greedy_output_matches_transformers(service, reference):
    out, msgs = generate(service, PROMPTS[3], max_tokens=NEW, temperature=0)
    assert_same_greedy(out[0], *reference(PROMPTS[3]))
    assert len(msgs) == len(out[0])  # one message per decoded token: streamed, not batched up
    last = msgs[-1]
    assert last.finish_reason in (pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP)
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(PROMPTS[3]), len(out[0]))
    assert all(m.finish_reason == pb.FINISH_REASON_UNSPECIFIED for m in msgs[:-1])


def test_32_concurrent_streams_with_preemption_all_match(service, reference):
    results: dict[int, dict] = {}
    preempted_before = service.metric("pagedserve_preemptions_total")
    idle_before = service.metric("pagedserve_worker_idle_seconds_count")

    def one(i: int) -> None:
        results[i] = generate(service, PROMPTS[i], max_tokens=NEW, temperature=0)[0]

    threads = [threading.Thread(target=one, args=(i,)) for i in range(32)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert len(results) == 32
    for i in range(32):
        assert_same_greedy(results[i][0], *reference(PROMPTS[i]))
    # 32 prompts of up to 80 tokens cannot all fit in 40 blocks of 16: the pool was exhausted and recovered.
    assert service.metric("pagedserve_preemptions_total") > preempted_before
    assert service.metric("pagedserve_kv_blocks_used") == 0
    assert service.metric("pagedserve_kv_blocks_total") == KV_MEMORY // (16 * 512)
    # Back-to-back steps report how long the worker waited for its next plan: NEW tokens each, so >= NEW steps.
    assert service.metric("pagedserve_worker_idle_seconds_count") - idle_before >= NEW
    assert service.metric("pagedserve_worker_idle_seconds_sum") > 0


def test_chunked_prefill_of_a_prompt_longer_than_the_token_budget(service, reference):
    prompt = [random.Random(7).randrange(3, 49152) for _ in range(3 * MAX_BATCHED + 5)]
    out, _ = generate(service, prompt, max_tokens=NEW, temperature=0)
    assert_same_greedy(out[0], *reference(prompt))


def test_parallel_sampling_n2_shares_the_prompt(service, reference):
    out, msgs = generate(service, PROMPTS[5], max_tokens=NEW, temperature=0, n=2)
    assert set(out) == {0, 1}
    for index in (0, 1):
        assert_same_greedy(out[index], *reference(PROMPTS[5]))
    assert sum(1 for m in msgs if m.finish_reason) == 2


def test_cancel_frees_blocks_within_a_step(service):
    """A cancelled stream's blocks go back to the pool at once, and its remaining ~400 tokens never run.

    NOTE: the worker is paused (SIGSTOP) from before the request until after the cancel, so the request cannot
    finish first on a loaded machine (the tiny model makes 400 tokens in about a second): its first step stays
    in flight, and the state asserted is the scheduler's (GetKVState), polled."""
    with service.channel() as ch:
        with service.worker_paused():
            call = generate_pb2_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
                prompt_token_ids=PROMPTS[0], sampling=pb.SamplingParams(
                    max_tokens=400, temperature=0, ignore_eos=True)))
            wait_until(lambda: len(service.live_request_ids()) == 1)  # admitted: holds blocks, a step in flight
            steps_at_cancel = service.metric("pagedserve_step_seconds_count")
            call.cancel()
            wait_until(lambda: service.live_request_ids() == [])  # dropped, its blocks freed, at once
        wait_until(lambda: service.metric("pagedserve_kv_blocks_used") == 0)  # exported after the next step
    # The step in flight at the cancel ends, then at most one more plan (telling the worker the request is gone):
    # holding the blocks to the end would take ~400 steps.
    assert service.metric("pagedserve_step_seconds_count") - steps_at_cancel <= 2


def test_stop_string_ends_the_text_before_it(service):
    _, msgs = generate(service, prompt="The capital of France is", max_tokens=NEW, temperature=0, ignore_eos=True)
    full = "".join(m.text for m in msgs)
    stop = full[len(full) // 2:len(full) // 2 + 3]
    assert stop and stop.strip()
    _, msgs = generate(service, prompt="The capital of France is", max_tokens=NEW, temperature=0, stop=[stop])
    text = "".join(m.text for m in msgs)
    assert text == full[:full.index(stop)]
    assert msgs[-1].finish_reason == pb.FINISH_REASON_STOP_STRING


@pytest.mark.parametrize("sampling, field", [
    ({"temperature": -1.0}, "temperature"), ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"), ({"top_p": 1.5}, "top_p"), ({"top_p": float("nan")}, "top_p"),
    ({"min_p": float("nan")}, "min_p"), ({"n": 0}, "n"), ({"max_tokens": 0}, "max_tokens"),
    ({"logprobs": 21}, "logprobs")])
def test_bad_sampling_fields_are_invalid_argument_naming_the_field(service, sampling, field):
    with pytest.raises(grpc.RpcError) as e:
        generate(service, PROMPTS[0], **sampling)
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()


def test_bad_prompts_are_rejected_and_the_server_keeps_serving(service, reference):
    for ids, field in (([49152], "prompt_token_ids"), ([1] * 600, "prompt_token_ids")):
        with pytest.raises(grpc.RpcError) as e:
            generate(service, ids, max_tokens=4)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and field in e.value.details()
    with service.channel() as ch, pytest.raises(grpc.RpcError) as e:
        list(generate_pb2_grpc.GenerationStub(ch).Generate(pb.GenerateRequest()))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt" in e.value.details()
    out, _ = generate(service, PROMPTS[1], max_tokens=NEW, temperature=0)
    assert_same_greedy(out[0], *reference(PROMPTS[1]))
    assert service.metric("pagedserve_kv_blocks_used") == 0


def test_model_info_health_and_reflection(service):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    with service.channel() as ch:
        info = generate_pb2_grpc.GenerationStub(ch).GetModelInfo(pb.GetModelInfoRequest())
        assert info.model_id == service.model_dir and info.max_model_len == 512 and info.block_size == 16
        assert [w.num_blocks for w in info.workers] == [40] and info.workers[0].device == "cpu"
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service="pagedserve.v1.Generation"))
        assert status.status == health_pb2.HealthCheckResponse.SERVING
        responses = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        names = {s.name for r in responses for s in r.list_services_response.service}
        assert {"pagedserve.v1.Generation", "grpc.health.v1.Health"} <= names


def test_logprobs_stream_with_each_token(service):
    _, msgs = generate(service, PROMPTS[2], max_tokens=6, temperature=0, logprobs=3)
    for m in msgs:
        assert len(m.logprobs) == len(m.token_ids) == 1
        lp = m.logprobs[0]
        assert lp.sampled.token_id == m.token_ids[0]
        tops = [t.logprob for t in lp.top]
        assert len(tops) == 3 and tops == sorted(tops, reverse=True)
        assert lp.top[0].token_id == m.token_ids[0]  # greedy: the sampled token is the most likely one
        assert abs(lp.sampled.logprob - tops[0]) < 1e-6 and tops[0] <= 0


def test_mixed_cancels_deadlines_and_forks_under_preemption_lose_nothing(service, reference):
    """24 clients at once on a 40-block pool: some cancel mid-stream, some hit their deadline, some fork (n=2).
    Every completed stream matches transformers, and afterwards no block, sequence or queue entry is left."""
    rng = random.Random(11)
    plans = [(i, rng.choice(["complete", "cancel", "deadline", "fork"]), rng.randint(1, 6)) for i in range(24)]
    done: dict[int, dict] = {}
    errors: list[BaseException] = []
    preempted_before = service.metric("pagedserve_preemptions_total")

    def one(i: int, kind: str, k: int) -> None:
        try:
            # A deadline request asks for 400 tokens so that it cannot finish before its deadline of <= 0.3 s.
            req = pb.GenerateRequest(prompt_token_ids=PROMPTS[i], sampling=pb.SamplingParams(
                max_tokens=400 if kind == "deadline" else NEW, ignore_eos=kind == "deadline", temperature=0,
                n=2 if kind == "fork" else 1))
            with service.channel() as ch:
                stub = generate_pb2_grpc.GenerationStub(ch)
                if kind == "cancel":
                    call = stub.Generate(req)
                    for _ in zip(range(k), call):
                        pass
                    call.cancel()
                elif kind == "deadline":
                    with pytest.raises(grpc.RpcError) as e:
                        list(stub.Generate(req, timeout=0.05 * k))
                    assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
                else:
                    out: dict[int, list[int]] = {}
                    for m in stub.Generate(req, timeout=300):
                        out.setdefault(m.index, []).extend(m.token_ids)
                    done[i] = out
        except BaseException as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=one, args=p) for p in plans]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert service.metric("pagedserve_preemptions_total") > preempted_before
    for i, kind, _ in plans:
        if kind in ("complete", "fork"):
            assert sorted(done[i]) == ([0, 1] if kind == "fork" else [0])
            for tokens in done[i].values():
                assert_same_greedy(tokens, *reference(PROMPTS[i]))
    names = ("pagedserve_kv_blocks_used", "pagedserve_requests_running", "pagedserve_requests_waiting")
    wait_until(lambda: not any(service.metric(n) for n in names))  # aborts free at the worker's next step
    out, _ = generate(service, PROMPTS[30], max_tokens=NEW, temperature=0)
    assert_same_greedy(out[0], *reference(PROMPTS[30]))
