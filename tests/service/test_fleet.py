"""Many workers, one service: a lost, hung, failing or leaving worker loses no request (in-process scheduler,
scripted workers over the real Attach stream)."""

from __future__ import annotations

import asyncio

import grpc

from pagedserve.v1 import worker_pb2
from tests.support.inproc import TOKEN, ScriptedWorker, generate, status_of, tokens_of, wait_for, with_server

PROMPT = [5, 6, 7]


def migrations(engine) -> float:
    return engine.metrics.registry.get_sample_value("pagedserve_migrations_total")


async def answer(worker: ScriptedWorker, num_plans: int) -> None:
    """Answers the worker's first `num_plans` plans, one by one, as they come."""
    for i in range(num_plans):
        await wait_for(lambda: len(worker.plans) > i)
        worker.reply(worker.plans[i])


@with_server(max_num_seqs=4)
async def test_a_lost_workers_request_resumes_elsewhere_with_every_streamed_token(engine, channel):
    a = ScriptedWorker(channel)
    await wait_for(lambda: len(engine.workers) == 1)
    b = ScriptedWorker(channel, answer=True)
    await wait_for(lambda: len(engine.workers) == 2)
    call = generate(channel, "r0", PROMPT, max_tokens=6, temperature=0.8)
    await answer(a, 3)  # a prefill and two decodes: 3 tokens streamed
    await wait_for(lambda: len(a.plans) == 4)  # the 4th step is in flight when the worker dies
    first = a.plans[0].new_seqs[0]
    a.close()
    assert await tokens_of(call) == [[TOKEN] * 6]  # no error, nothing duplicated, nothing missing
    moved = b.plans[0].new_seqs[0]
    assert list(moved.token_ids) == PROMPT + [TOKEN] * 3  # recomputed from the prompt and the streamed tokens
    assert moved.num_computed_tokens == 0 and moved.num_scheduled_tokens == 6
    assert moved.seed == first.seed and moved.seq_id != first.seq_id  # same sampling, a fleet-unique sequence
    assert migrations(engine) == 1
    assert list(engine.workers) == ["worker-1"]


@with_server(max_migrations=2)
async def test_failed_steps_move_requests_until_max_migrations_then_internal(engine, channel):
    a = ScriptedWorker(channel)
    await wait_for(lambda: len(engine.workers) == 1)
    call = generate(channel, "r0", PROMPT)
    await wait_for(lambda: a.plans)
    b = ScriptedWorker(channel)
    await wait_for(lambda: len(engine.workers) == 2)
    a.fail_step(a.plans[0], message="CUDA error: an illegal memory access")
    await wait_for(lambda: b.plans)  # moved, counted once against the request
    await a.reader
    assert a.ended and a.error is None  # the failed worker's stream ends; a real one registers again
    b.fail_step(b.plans[0], kind=worker_pb2.StepError.BAD_PLAN, message="block 99 is outside the pool")
    code, details = await status_of(call)
    assert code == grpc.StatusCode.INTERNAL
    assert "r0 was in a step of 2 workers that failed" in details and "block 99" in details
    assert migrations(engine) == 1 and not engine.streams and not engine.workers


# NOTE: the answering worker must beat the deadline on every step of a loaded machine (it takes milliseconds),
# so the deadline is wide; the test waits for the hung worker's first one (1.5 s: a first step's is no longer).
@with_server(step_timeout=1.5)
async def test_a_worker_that_misses_its_step_deadline_is_lost_and_its_request_moves(engine, channel):
    hung = ScriptedWorker(channel)  # never answers: a stopped process, a wedged GPU
    await wait_for(lambda: len(engine.workers) == 1)
    call = generate(channel, "r0", PROMPT)
    await wait_for(lambda: hung.plans)
    ScriptedWorker(channel, answer=True)
    assert await tokens_of(call) == [[TOKEN] * 4]  # after the first step's deadline (1.5 s)
    await hung.reader
    assert hung.ended
    assert engine.metrics.registry.get_sample_value("pagedserve_workers_lost_total", {"reason": "deadline"}) == 1


@with_server(no_worker_timeout=60)
async def test_with_no_worker_requests_wait_and_resume_when_one_attaches(engine, channel):
    a = ScriptedWorker(channel)
    await wait_for(lambda: engine.workers)
    call = generate(channel, "r0", PROMPT)
    await answer(a, 2)
    await wait_for(lambda: len(a.plans) == 3)
    a.close()
    await wait_for(lambda: "r0" in engine.unplaced)  # the only worker is gone: it waits, no error
    assert not engine.workers
    ScriptedWorker(channel, answer=True)
    assert await tokens_of(call) == [[TOKEN] * 4]


@with_server(max_num_seqs=1)
async def test_a_leaving_worker_hands_its_queue_over_and_finishes_its_running_request(engine, channel):
    a = ScriptedWorker(channel)
    await wait_for(lambda: engine.workers)
    running, queued = generate(channel, "r0", PROMPT), generate(channel, "r1", [8, 9])
    await wait_for(lambda: a.plans and engine.workers["worker-0"].scheduler.num_waiting == 1)
    b = ScriptedWorker(channel, answer=True)
    await wait_for(lambda: len(engine.workers) == 2)
    a.leave()
    assert await tokens_of(queued) == [[TOKEN] * 4]  # moved to b at once
    assert list(b.plans[0].new_seqs[0].token_ids) == [8, 9]
    await answer(a, 4)  # r0 finishes where it runs: no recompute
    assert await tokens_of(running) == [[TOKEN] * 4]
    await a.reader
    assert a.ended and list(engine.workers) == ["worker-1"]
    assert migrations(engine) == 1


@with_server(drain_timeout=0.3)
async def test_a_leaving_worker_that_does_not_finish_in_time_has_its_requests_moved(engine, channel):
    a = ScriptedWorker(channel)
    await wait_for(lambda: engine.workers)
    call = generate(channel, "r0", PROMPT, max_tokens=50)
    await answer(a, 1)
    ScriptedWorker(channel, answer=True)
    await wait_for(lambda: len(engine.workers) == 2)
    a.leave()

    async def slow_answers():  # keeps answering, too slowly to finish 50 tokens in 0.3 s
        i = 1
        while not a.ended:
            await wait_for(lambda: len(a.plans) > i or a.ended)
            if a.ended:
                return
            await asyncio.sleep(0.05)
            a.reply(a.plans[i])
            i += 1
    await asyncio.gather(slow_answers(), a.reader)
    assert await tokens_of(call) == [[TOKEN] * 50]
    assert migrations(engine) == 1


@with_server(max_num_seqs=8, max_queued_requests=64)
async def test_sequence_ids_are_unique_across_workers(engine, channel):
    workers = [ScriptedWorker(channel, answer=True) for _ in range(3)]
    await wait_for(lambda: len(engine.workers) == 3)
    calls = [generate(channel, f"r{i}", [10 + i] * (3 + i)) for i in range(12)]
    for call in calls:
        assert await tokens_of(call) == [[TOKEN] * 4]
    ids = [w.seq_ids() for w in workers]
    assert all(ids) and sum(map(len, ids)) == len(set().union(*ids)) == 12


@with_server(routing="kv")
async def test_a_cancelled_request_no_longer_counts_as_pending_on_its_worker(engine, channel):
    # NOTE: kv routing counts a placed prompt as held by its worker until its prefill ran (Router.routed); a request
    # cancelled before that must stop counting, or the router keeps its entry (and its pending chains) forever.
    ScriptedWorker(channel)  # silent: the request never gets past its first step
    await wait_for(lambda: len(engine.workers) == 1)
    call = generate(channel, "r0", list(range(100, 120)))  # one full block of 16, and 4 more
    await wait_for(lambda: "r0" in engine.placement)
    assert "r0" in engine.router._routed
    call.cancel()
    await wait_for(lambda: "r0" not in engine.streams)
    assert "r0" not in engine.router._routed
