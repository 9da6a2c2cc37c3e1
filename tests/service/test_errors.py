"""Status codes of the client API, against an in-process server and scripted workers on the real Attach stream."""

from __future__ import annotations

import asyncio

import grpc

from pagedserve.v1 import worker_pb2
from scheduler_svc.engine import Engine, EngineConfig
from tests.service.inproc import ScriptedWorker, generate, status_of, tokenizer, wait_for, with_server


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
    code, details = await status_of(generate(channel, "r9"))
    assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "queued" in details
    code, details = await status_of(generate(channel, "r0"))
    assert code == grpc.StatusCode.ALREADY_EXISTS and "r0" in details
    engine.draining = True
    assert (await status_of(generate(channel, "r10")))[0] == grpc.StatusCode.UNAVAILABLE
    for call in calls:
        call.cancel()


@with_server()
async def test_a_worker_breaking_the_protocol_ends_its_requests_with_internal(engine, channel):
    worker = ScriptedWorker(channel)
    await wait_for(lambda: engine.workers)
    call = generate(channel, "r0")
    await wait_for(lambda: worker.plans)
    worker.queue.put_nowait(worker_pb2.WorkerMessage(result=worker_pb2.StepResult(step_id=99)))
    code, details = await status_of(call)
    assert code == grpc.StatusCode.INTERNAL and "step 99" in details
    await worker.reader  # the scheduler closed the worker's stream
    assert not engine.workers


def test_the_token_budget_defaults_by_the_workers_device():
    """Unset, a CPU worker's steps take 512 tokens (a ~1 s step bounds inter-token latency during long
    prefills there) and a GPU worker's 2048; a configured budget applies to every worker."""
    from scheduler_svc.core.plan import WorkerRegistration

    async def main():
        budgets = {}
        for configured in (None, 96):
            engine = Engine(EngineConfig(model_id="m", max_model_len=128, vocab_size=49152,
                                         max_num_batched_tokens=configured), tokenizer())
            for device in ("cpu", "cuda:0"):
                handle = engine.attach_worker(WorkerRegistration("m", 64, 16, "float32", 128, device))
                budgets[(configured, device)] = handle.scheduler.config.max_num_batched_tokens
                engine.detach(handle)
                await handle.task
        return budgets
    assert asyncio.run(main()) == {(None, "cpu"): 512, (None, "cuda:0"): 2048, (96, "cpu"): 96, (96, "cuda:0"): 96}
