"""HTTP status codes of the OpenAI-compatible front: the app on uvicorn in this process, scripted workers."""

from __future__ import annotations

import httpx

from pagedserve.v1 import worker_pb2
from scheduler_svc.errors import ErrorCode
from tests.support.inproc import Front, ScriptedWorker, generate, wait_for, with_server


async def complete(client: httpx.AsyncClient, **body) -> httpx.Response:
    return await client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4, **body})


@with_server()
async def test_with_no_worker_health_and_requests_are_503(engine, channel):
    async with Front(engine) as client:
        r = await client.get("/health")
        assert r.status_code == 503
        assert r.json()["error"]["message"] == "no worker is attached yet"
        r = await complete(client)
        assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable_error"
        assert r.json()["error"]["message"] == "no worker is attached yet"


@with_server()
async def test_a_full_queue_is_429_and_draining_is_503(engine, channel):
    worker = ScriptedWorker(channel)  # silent: the first request runs forever, the next two wait
    await wait_for(lambda: engine.workers)
    calls = [generate(channel, f"r{i}") for i in range(3)]
    await wait_for(lambda: len(worker.plans) == 1 and sum(w.scheduler.num_waiting
                                                            for w in engine.workers.values()) == 2)
    async with Front(engine) as client:
        assert (await client.get("/health")).status_code == 200
        r = await complete(client)
        assert r.status_code == 429, r.text
        assert r.json()["error"]["type"] == "rate_limit_error"
        assert r.json()["error"]["message"] == ("the request queue is full: 2 requests are waiting "
                                                "(--max-queued-requests 2); retry later")
        engine.draining = True
        r = await complete(client)
        assert r.status_code == 503 and "draining" in r.json()["error"]["message"]
        assert (await client.get("/health")).status_code == 503
        r = await complete(client, stream=True)  # refused before the stream starts: a plain JSON error
        assert r.status_code == 503 and r.headers["content-type"] == "application/json"
    for call in calls:
        call.cancel()
    assert not engine.unplaced


@with_server(max_num_seqs=4)
async def test_a_stream_that_fails_midway_ends_with_an_error_event_then_done(engine, channel):
    worker = ScriptedWorker(channel)  # answers by hand: one step, then the request hangs until it fails
    await wait_for(lambda: engine.workers)
    async with Front(engine) as client:
        async with client.stream("POST", "/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 100,
                                                                  "stream": True, "ignore_eos": True}) as r:
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            lines = r.aiter_lines()
            await wait_for(lambda: worker.plans)
            result = worker_pb2.StepResult(step_id=worker.plans[0].step_id)
            result.tokens.add(seq_id=worker.plans[0].new_seqs[0].seq_id, token_id=504)  # "The": it has text
            worker.queue.put_nowait(worker_pb2.WorkerMessage(result=result))
            first = await anext(lines)
            assert first.startswith("data: {")
            engine.fail_all(ErrorCode.UNAVAILABLE, "the server shut down")  # e.g. the drain timeout ran out
            rest = [line async for line in lines if line]
    assert rest[-1] == "data: [DONE]"
    assert '"type": "service_unavailable_error"' in rest[-2] and "the server shut down" in rest[-2]
    worker.close()



@with_server()
async def test_a_batch_is_admitted_whole_or_refused_saying_why(engine, channel):
    """--max-queued-requests 2, one request running and one waiting: a batch of 2 prompts (2 requests in the queue)
    is refused whole with 429, one of 3 can never fit (400); neither leaves a prompt queued."""
    worker = ScriptedWorker(channel)  # silent: the first request runs forever
    await wait_for(lambda: engine.workers)
    calls = [generate(channel, f"r{i}") for i in range(2)]
    await wait_for(lambda: len(worker.plans) == 1 and engine.num_queued == 1)
    async with Front(engine) as client:
        r = await complete(client, prompt=[[5, 6], [7, 8]])
        assert r.status_code == 429, r.text
        assert r.json()["error"]["message"] == ("the request queue has room for 1 more requests, and this one has 2 "
                                                "prompts, one request each (--max-queued-requests 2); retry later")
        assert engine.num_queued == 1 and len(engine.streams) == 2
        r = await complete(client, prompt=["a", "b", "c"])
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert r.json()["error"]["message"] == ("prompt has 3 prompts, one request each; the request queue holds at "
                                                "most 2 (--max-queued-requests)")
        assert engine.num_queued == 1 and len(engine.streams) == 2
    for call in calls:
        call.cancel()


@with_server(no_worker_timeout=30, max_num_seqs=512, max_queued_requests=1024)
async def test_sequences_per_request_are_bounded_before_tokenizing(engine, channel):
    """--max-seqs-per-request (256): n alone names n; prompts x n names prompt. Nothing is queued."""
    async with Front(engine) as client:
        r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                            "n": 300})
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        assert r.json()["error"]["message"] == "n is 300; the limit is 256 sequences per request " \
                                               "(--max-seqs-per-request)"
        r = await complete(client, prompt=["x"] * 3, n=300)
        assert r.status_code == 400 and r.json()["error"]["param"] == "n"
        r = await complete(client, prompt=["x"] * 3, n=86)
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
        assert r.json()["error"]["message"] == "prompt has 3 prompts and n is 86: 258 sequences; the limit is 256 " \
                                               "per request (--max-seqs-per-request)"
    assert not engine.streams and not engine.unplaced
