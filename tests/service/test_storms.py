"""Floods and cancel storms against a real scheduler and worker on loopback: only meaningful statuses, no leaks."""

from __future__ import annotations

import asyncio
import collections
import random

import grpc
import pytest

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc
from pagedserve_cli.bench.local_server import LocalServer
from tests.support.service import EXACT, RPC_TIMEOUT, Service, assert_idle_and_serving

BLOCK_BYTES = 16 * 512  # one tiny-model KV block (tests/support/service.py: KV_MEMORY)
MAX_QUEUED = 500
PREFIX = "You are a terse assistant. Answer in one short line, and never repeat the question back. "


@pytest.fixture(scope="module")
def storm(tiny_served_model, tmp_path_factory):
    """(Service, LocalServer): a queue of MAX_QUEUED, a 96-block pool (preemptions), the scheduler's log in a file."""
    server = LocalServer.start(
        tiny_served_model, tmp_path_factory.mktemp("storms"),
        scheduler_args=("--max-queued-requests", str(MAX_QUEUED), "--max-num-seqs", "64",
                        "--max-num-batched-tokens", "64"),
        worker_args=("--kv-memory", str(96 * BLOCK_BYTES), *EXACT))
    try:
        yield Service(tiny_served_model, server.address, server.metrics, server.procs), server
    finally:
        server.stop()


async def status_of(stub, request: pb.GenerateRequest) -> str:
    try:
        async for _ in stub.Generate(request, timeout=RPC_TIMEOUT):
            pass
        return "OK"
    except grpc.aio.AioRpcError as e:
        return e.code().name


def test_a_flood_ends_each_rpc_ok_or_resource_exhausted(storm):
    service, _ = storm

    async def flood() -> list[str]:
        async with grpc.aio.insecure_channel(service.address) as ch:
            stub = generate_pb2_grpc.GenerationStub(ch)
            return await asyncio.gather(*(status_of(stub, pb.GenerateRequest(
                prompt=f"{PREFIX}Request {i}.", sampling=pb.SamplingParams(max_tokens=4, temperature=0)))
                for i in range(1500)))

    codes = collections.Counter(asyncio.run(flood()))
    print("flood:", dict(codes))
    # NOTE: before the fix, grpc core cancelled a few percent of a burst this size itself (scheduler_svc/server.py)
    assert set(codes) <= {"OK", "RESOURCE_EXHAUSTED"}, f"1,500 requests at once ended: {dict(codes)}"
    assert codes["OK"] >= 1, dict(codes)
    assert_idle_and_serving(service)


async def cancel_at_random(stub, rng: random.Random, i: int) -> tuple[str, str]:
    """(how the client ends it, the status it saw). Cancels before the first token or mid-stream, or sets a
    short deadline, or lets it finish; some requests ask two samples."""
    how = rng.choice(("before_first", "mid_stream", "mid_stream", "deadline", "finish"))
    words = " ".join(rng.choice(("sea", "ship", "north", "grey", "wind", "home")) for _ in range(rng.randint(1, 30)))
    request = pb.GenerateRequest(prompt=f"{PREFIX}{words}", request_id=f"storm-{i}", sampling=pb.SamplingParams(
        max_tokens=rng.randint(8, 40), ignore_eos=True, n=rng.choice((1, 1, 1, 2)), seed=i))
    timeout = rng.uniform(0.05, 2.0) if how == "deadline" else RPC_TIMEOUT
    call = stub.Generate(request, timeout=timeout)
    if how == "before_first":
        await asyncio.sleep(rng.uniform(0, 0.3))
        call.cancel()
        return how, "CANCELLED"
    cancel_after = rng.randint(1, 6) if how == "mid_stream" else 0
    messages = 0
    try:
        async for _ in call:
            messages += 1
            if messages == cancel_after:
                call.cancel()
                return how, "CANCELLED"
        return how, "OK"
    except grpc.aio.AioRpcError as e:
        return how, e.code().name


def test_a_cancel_storm_frees_everything_and_logs_no_error(storm):
    service, server = storm
    rng = random.Random(1234)

    async def storm_of_cancels() -> list[tuple[str, str]]:
        async with grpc.aio.insecure_channel(service.address) as ch:
            stub = generate_pb2_grpc.GenerationStub(ch)
            return await asyncio.gather(*(cancel_at_random(stub, random.Random(rng.getrandbits(64)), i)
                                          for i in range(500)))

    outcomes = collections.Counter(asyncio.run(storm_of_cancels()))
    print("cancel storm:", dict(outcomes))
    allowed = {"before_first": {"CANCELLED"}, "mid_stream": {"CANCELLED", "OK"}, "finish": {"OK"},
               "deadline": {"DEADLINE_EXCEEDED", "OK"}}
    unexpected = {k: n for k, n in outcomes.items() if k[1] not in allowed[k[0]] | {"RESOURCE_EXHAUSTED"}}
    assert not unexpected, f"unexpected statuses {unexpected} among {dict(outcomes)}"
    assert_idle_and_serving(service)
    errors = server.error_lines()
    assert not errors, "the scheduler logged errors:\n" + "\n".join(errors[:20])
