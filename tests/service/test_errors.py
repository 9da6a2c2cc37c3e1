"""Status codes of the client API, against an in-process server and scripted workers on the real Attach stream."""

from __future__ import annotations

import asyncio

import grpc

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc, worker_pb2
from scheduler_svc.engine import Engine, EngineConfig
from tests.support.inproc import TOKEN, ScriptedWorker, generate, status_of, tokens_of, wait_for, with_server


@with_server()
async def test_no_worker_attached_is_unavailable_at_once_with_no_worker_timeout_0(engine, channel):
    assert await status_of(generate(channel)) == (grpc.StatusCode.UNAVAILABLE, "no worker is attached yet")


@with_server(no_worker_timeout=0.3)
async def test_with_no_worker_requests_wait_then_end_unavailable(engine, channel):
    call = generate(channel, "r0")
    await wait_for(lambda: "r0" in engine.unplaced)
    assert await status_of(call) == (grpc.StatusCode.UNAVAILABLE, "no worker was attached for 0.3 s")
    assert not engine.unplaced and not engine.streams


@with_server()
async def test_a_worker_for_another_model_is_refused(engine, channel):
    w = ScriptedWorker(channel, model_id="other")
    await w.reader
    assert w.error.code() == grpc.StatusCode.FAILED_PRECONDITION and "model_id" in w.error.details()
    assert not engine.workers


@with_server()
async def test_full_queue_duplicate_ids_and_draining(engine, channel):
    worker = ScriptedWorker(channel)
    await wait_for(lambda: engine.workers)
    calls = [generate(channel, f"r{i}") for i in range(3)]  # 1 runs (max_num_seqs=1), 2 wait
    await wait_for(lambda: len(worker.plans) == 1 and sum(w.scheduler.num_waiting
                                                            for w in engine.workers.values()) == 2)
    assert await status_of(generate(channel, "r9")) == (
        grpc.StatusCode.RESOURCE_EXHAUSTED,
        "the request queue is full: 2 requests are waiting (--max-queued-requests 2); retry later")
    code, details = await status_of(generate(channel, "r0"))
    assert code == grpc.StatusCode.ALREADY_EXISTS and "r0" in details
    engine.draining = True
    assert (await status_of(generate(channel, "r10")))[0] == grpc.StatusCode.UNAVAILABLE
    for call in calls:
        call.cancel()


@with_server(no_worker_timeout=60)
async def test_a_worker_answering_another_step_is_lost_and_its_request_recomputed_elsewhere(engine, channel):
    worker = ScriptedWorker(channel)
    await wait_for(lambda: engine.workers)
    call = generate(channel, "r0")
    await wait_for(lambda: worker.plans)
    worker.queue.put_nowait(worker_pb2.WorkerMessage(result=worker_pb2.StepResult(step_id=99)))
    await worker.reader  # the scheduler closed the worker's stream: not INTERNAL for the request
    assert not engine.workers
    assert engine.metrics.registry.get_sample_value("pagedserve_workers_lost_total", {"reason": "bad_result"}) == 1
    ScriptedWorker(channel, answer=True)
    assert await tokens_of(call) == [[TOKEN] * 4]


@with_server(no_worker_timeout=60, max_migrations=2)
async def test_a_request_every_worker_answers_wrongly_is_charged_and_ends_internal_after_max_migrations(engine,
                                                                                                     channel):
    """A wrong entry of one sequence (here a token outside the vocabulary) charges that sequence's request: workers
    that all fail on it end it with INTERNAL after --max-migrations, instead of passing it around for ever."""
    for attempt in range(2):
        worker = ScriptedWorker(channel)
        await wait_for(lambda: engine.workers)
        if attempt == 0:
            call = generate(channel, "r0")
        await wait_for(lambda: worker.plans)
        plan = worker.plans[-1]
        result = worker_pb2.StepResult(step_id=plan.step_id)
        result.tokens.add(seq_id=plan.new_seqs[0].seq_id, token_id=49152)  # the vocabulary's size: one past it
        worker.queue.put_nowait(worker_pb2.WorkerMessage(result=result))
        await worker.reader
        assert not engine.workers
    code, details = await status_of(call)
    assert code == grpc.StatusCode.INTERNAL and "was in a step of 2 workers that failed" in details
    assert "token_id 49152" in details
    assert engine.metrics.registry.get_sample_value("pagedserve_workers_lost_total", {"reason": "bad_result"}) == 2


def test_the_token_budget_defaults_by_the_workers_device():
    """Unset, a CPU worker's steps take 512 tokens (a ~1 s step bounds inter-token latency during long
    prefills there) and a GPU worker's 2048; a configured budget applies to every worker."""
    from pagedserve_common.kv_geometry import KVGeometry
    from pagedserve_common.registration import WorkerRegistration

    async def main():
        budgets = {}
        for configured in (None, 96):
            engine = Engine(EngineConfig(model_id="m", max_model_len=128, vocab_size=49152,
                                         max_num_batched_tokens=configured))
            for device in ("cpu", "cuda:0"):
                handle = engine.attach_worker(WorkerRegistration("m", 128, device, KVGeometry(1, 1, 8, "float32", 16), 64))
                budgets[(configured, device)] = handle.scheduler.config.max_num_batched_tokens
                engine.detach(handle)
                await handle.task
        return budgets
    assert asyncio.run(main()) == {(None, "cpu"): 512, (None, "cuda:0"): 2048, (96, "cpu"): 96, (96, "cuda:0"): 96}


def request(channel, sampling=None, **fields):
    return generate_pb2_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(
        **fields, sampling=pb.SamplingParams(**(sampling or {}))))


@with_server(no_worker_timeout=30, max_num_seqs=8)
async def test_each_bad_field_is_invalid_argument_naming_it_even_with_no_worker(engine, channel):
    """Refused at once, before anything is queued. The uint32 cases are what a JavaScript client's negative
    numbers arrive as (2^32 - x); n = 2^32 - 1 must not allocate 4 billion samples while it waits for a worker."""
    wrapped = 2**32 - 1
    cases = [
        ({"prompt": "hi", "prompt_token_ids": [5]},
         "set exactly one of prompt, prompt_token_ids and messages (got prompt and prompt_token_ids)"),
        ({"prompt_token_ids": [5], "messages": [pb.ChatMessage(role="user", content="hi")]},
         "set exactly one of prompt, prompt_token_ids and messages (got prompt_token_ids and messages)"),
        ({}, "set exactly one of prompt, prompt_token_ids and messages (got none)"),
        ({"prompt": ""}, "prompt is empty"),
        ({"messages": [pb.ChatMessage(role="", content="hi")]}, "messages[0].role must be a non-empty string"),
        ({"prompt_token_ids": [49152]}, "prompt_token_ids: 49152 is outside the vocabulary (size 49152)"),
        ({"prompt": "hi", "sampling": {"top_k": -5}}, "top_k must be >= 1, or 0 or -1 to keep all tokens; got -5"),
        ({"prompt": "hi", "sampling": {"max_tokens": wrapped}},
         f"max_tokens must be in [1, 128] (max_model_len), got {wrapped} (a negative number sent as uint32?)"),
        ({"prompt": "hi", "sampling": {"n": wrapped}},
         f"n must be in [1, 8] (max_num_seqs: the samples run side by side), got {wrapped} (a negative number "
         "sent as uint32?)"),
        ({"prompt": "hi", "sampling": {"stop_token_ids": [10**9]}},
         "stop_token_ids: 1000000000 is outside the vocabulary (size 49152)"),
        ({"prompt": "hi", "sampling": {"logprobs": wrapped}}, f"logprobs must be in [0, 20], got {wrapped}"),
        ({"prompt": "hi" * 200}, "prompt has 200 tokens after tokenizing; max_model_len 128 leaves room for at most "
                                 "127"),
    ]
    for fields, message in cases:
        sampling = fields.pop("sampling", None)
        assert await status_of(request(channel, sampling, **fields)) == (grpc.StatusCode.INVALID_ARGUMENT, message)
    assert not engine.streams and not engine.unplaced


@with_server(no_worker_timeout=30)
async def test_top_k_minus_1_is_vllms_spelling_of_off(engine, channel):
    worker = ScriptedWorker(channel, answer=True)
    await wait_for(lambda: engine.workers)
    out = await tokens_of(request(channel, {"top_k": -1, "max_tokens": 3, "ignore_eos": True}, prompt="hi"))
    assert out == [[7, 7, 7]]
    assert [p.new_seqs[0].sampling.top_k for p in worker.plans if p.new_seqs] == [0]  # the worker sees 0
    worker.close()


@with_server(no_worker_timeout=30)
async def test_model_info_reports_the_bounds_clients_must_respect(engine, channel):
    info = await generate_pb2_grpc.GenerationStub(channel).GetModelInfo(pb.GetModelInfoRequest())
    assert (info.max_model_len, info.vocab_size, info.max_n) == (128, 49152, 1)


@with_server(no_worker_timeout=30, max_num_seqs=512)
async def test_n_over_max_seqs_per_request_is_refused_before_tokenizing(engine, channel):
    """--max-seqs-per-request (256 by default) bounds n even where --max-num-seqs would let more run side by side."""
    long_prompt = "hi" * 200  # NOTE: never tokenized: its 200 tokens would be refused for max_model_len 128
    assert await status_of(request(channel, {"n": 257}, prompt=long_prompt)) == (
        grpc.StatusCode.INVALID_ARGUMENT, "n is 257; the limit is 256 sequences per request (--max-seqs-per-request)")
    assert not engine.streams and not engine.unplaced
