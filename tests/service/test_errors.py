"""Status codes of the client API, against an in-process server and a worker that attaches but never answers."""

from __future__ import annotations

import asyncio
import functools

import grpc
import pytest

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc, worker_pb2, worker_pb2_grpc
from scheduler_svc.engine import Engine, EngineConfig
from scheduler_svc.servicers import GenerationServicer, WorkerControlServicer
from scheduler_svc.text.tokenizer import Tokenizer
from tests.service.conftest import free_port
from worker_svc.model_store import resolve_model


@functools.cache
def tokenizer() -> Tokenizer:
    return Tokenizer.from_model_dir(resolve_model("smollm2-135m-instruct"))


def with_server(test):
    """Runs an async test against a real gRPC server in this process: test(engine, channel)."""

    def run():
        async def main():
            engine = Engine(EngineConfig(model_id="m", max_model_len=128, vocab_size=49152, max_num_seqs=1,
                                         max_queued_requests=2), tokenizer())
            server, address = grpc.aio.server(), f"127.0.0.1:{free_port()}"
            generate_pb2_grpc.add_GenerationServicer_to_server(GenerationServicer(engine), server)
            worker_pb2_grpc.add_WorkerControlServicer_to_server(WorkerControlServicer(engine), server)
            server.add_insecure_port(address)
            await server.start()
            try:
                async with grpc.aio.insecure_channel(address) as channel:
                    await asyncio.wait_for(test(engine, channel), 30)
            finally:
                await server.stop(0)
        asyncio.run(main())
    run.__name__, run.__doc__ = test.__name__, test.__doc__  # NOTE: not functools.wraps: pytest would read
    return run                                                 # the wrapped signature as fixtures


class SilentWorker:
    """Registers over the real Attach stream, then never answers a plan."""

    def __init__(self, channel, model_id: str = "m") -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.queue.put_nowait(worker_pb2.WorkerMessage(registration=worker_pb2.WorkerRegistration(
            model_id=model_id, num_blocks=64, block_size=16, dtype="float32", max_model_len=128, device="cpu")))
        self.call = worker_pb2_grpc.WorkerControlStub(channel).Attach(self._messages())
        self.plans: list = []
        self.error: grpc.RpcError | None = None
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _messages(self):
        while (msg := await self.queue.get()) is not None:
            yield msg

    async def _read(self) -> None:
        try:
            async for plan in self.call:
                self.plans.append(plan)
        except grpc.RpcError as e:
            self.error = e

    def close(self) -> None:
        self.call.cancel()


async def wait_for(cond) -> None:
    while not cond():
        await asyncio.sleep(0.01)


def generate(channel, request_id: str = "", ids=(5, 6, 7)):
    return generate_pb2_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(
        request_id=request_id, prompt_token_ids=pb.TokenIds(ids=ids), sampling=pb.SamplingParams(max_tokens=4)))


async def status_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        await call.read()
    return e.value.code(), e.value.details()


@with_server
async def test_no_worker_attached_is_unavailable(engine, channel):
    assert await status_of(generate(channel)) == (grpc.StatusCode.UNAVAILABLE, "no worker is attached yet")


@with_server
async def test_a_worker_for_another_model_is_refused(engine, channel):
    w = SilentWorker(channel, model_id="other")
    await w.reader
    assert w.error.code() == grpc.StatusCode.FAILED_PRECONDITION and "model_id" in w.error.details()
    assert not engine.workers


@with_server
async def test_full_queue_duplicate_ids_draining_and_a_lost_worker(engine, channel):
    worker = SilentWorker(channel)
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
    worker.close()  # the worker goes away: its requests end with UNAVAILABLE, not silently
    for call in calls:
        code, details = await status_of(call)
        assert code == grpc.StatusCode.UNAVAILABLE and "went away" in details


@with_server
async def test_a_worker_breaking_the_protocol_ends_its_requests_with_internal(engine, channel):
    worker = SilentWorker(channel)
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
                engine.detach_worker(handle)
                handle.task.cancel()
        return budgets
    assert asyncio.run(main()) == {(None, "cpu"): 512, (None, "cuda:0"): 2048, (96, "cpu"): 96, (96, "cuda:0"): 96}
