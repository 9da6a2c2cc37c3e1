"""The request log against an in-process server and scripted workers: one end line per admitted request whatever
ends it, one line per refused request, and honest words when no worker is there."""

from __future__ import annotations

import asyncio
import re

import grpc
from structlog.testing import capture_logs

from pagedserve.v1 import generate_pb2 as pb
from scheduler_svc.errors import ErrorCode
from tests.support.inproc import Front, ScriptedWorker, generate, status_of, tokens_of, wait_for, with_server

END_EVENTS = ("request finished", "request aborted", "request failed")
END_FIELDS = {"request_id", "worker", "prompt_tokens", "output_tokens", "ttft_s", "e2e_s"}


def ends(logs: list[dict], request_id: str) -> list[dict]:
    return [e for e in logs if e["event"] in END_EVENTS and e.get("request_id") == request_id]


def one_end(logs: list[dict], request_id: str) -> dict:
    lines = ends(logs, request_id)
    assert len(lines) == 1, lines
    assert END_FIELDS <= lines[0].keys(), lines[0]
    return lines[0]


@with_server(max_num_seqs=4)
async def test_a_finished_request_has_one_line_with_its_tokens_reasons_and_timings(engine, channel):
    with capture_logs() as logs:
        ScriptedWorker(channel, answer=True)
        await wait_for(lambda: engine.workers)
        samples = await tokens_of(generate(channel, "fin", ids=(5, 6, 7), max_tokens=4, n=2))
        assert [len(s) for s in samples] == [4, 4]
        await wait_for(lambda: ends(logs, "fin"))
    line = one_end(logs, "fin")
    assert (line["event"], line["worker"], line["prompt_tokens"], line["output_tokens"], line["finish_reason"]) \
        == ("request finished", "worker-0", 3, 8, "length,length")
    assert 0 <= line["ttft_s"] <= line["e2e_s"]
    assert "preemptions" not in line and "migrations" not in line  # only when there were some
    assert {e["log_level"] for e in logs if e["event"] == "request added"} == {"debug"}  # the end line says more
    assert [e["event"] for e in logs].count("worker attached") == 1


@with_server()
async def test_a_cancelled_request_has_one_aborted_line(engine, channel):
    worker = ScriptedWorker(channel)  # silent: the request runs until the client cancels it
    await wait_for(lambda: engine.workers)
    with capture_logs() as logs:
        call = generate(channel, "gone")
        await wait_for(lambda: worker.plans)
        call.cancel()
        await wait_for(lambda: ends(logs, "gone"))
        await asyncio.sleep(0.2)  # anything logged late would be a second line
    line = one_end(logs, "gone")
    assert (line["event"], line["status"], line["worker"], line["output_tokens"], line["ttft_s"]) \
        == ("request aborted", "CANCELLED", "worker-0", 0, None)


@with_server()
async def test_a_moved_request_says_so_once_and_its_end_line_counts_the_migration(engine, channel):
    first = ScriptedWorker(channel)  # silent: it takes the request, then its stream breaks mid-step
    await wait_for(lambda: engine.workers)
    with capture_logs() as logs:
        call = generate(channel, "moved")
        await wait_for(lambda: first.plans)
        ScriptedWorker(channel, answer=True)
        await wait_for(lambda: len(engine.workers) == 2)
        first.close()
        assert await tokens_of(call) == [[7, 7, 7, 7]]
        await wait_for(lambda: ends(logs, "moved"))
    (moved,) = [e for e in logs if e["event"] == "request moved"]
    assert (moved["request_id"], moved["worker"], moved["migrations"]) == ("moved", "worker-1", 1)
    (lost,) = [e for e in logs if e["event"].startswith("worker lost")]
    assert (lost["worker"], lost["migrated"], lost["workers_left"]) == ("worker-0", 1, 1)
    line = one_end(logs, "moved")
    assert (line["event"], line["worker"], line["output_tokens"], line["migrations"]) == \
        ("request finished", "worker-1", 4, 1)


@with_server(no_worker_timeout=0.3)
async def test_a_request_that_no_worker_took_has_one_failed_line(engine, channel):
    with capture_logs() as logs:
        assert await status_of(generate(channel, "alone")) == (grpc.StatusCode.UNAVAILABLE,
                                                              "no worker was attached for 0.3 s")
    line = one_end(logs, "alone")
    assert (line["event"], line["status"], line["worker"], line["log_level"]) == \
        ("request failed", "UNAVAILABLE", None, "warning")
    assert line["message"] == "no worker was attached for 0.3 s"


@with_server()
async def test_requests_ended_at_shutdown_are_failed_not_aborted(engine, channel):
    ScriptedWorker(channel)
    await wait_for(lambda: engine.workers)
    with capture_logs() as logs:
        call = generate(channel, "late")
        await wait_for(lambda: "late" in engine.placement)
        engine.fail_all(ErrorCode.UNAVAILABLE, "the server shut down")  # what the drain timeout does
        assert await status_of(call) == (grpc.StatusCode.UNAVAILABLE, "the server shut down")
    line = one_end(logs, "late")
    assert (line["event"], line["status"], line["worker"]) == ("request failed", "UNAVAILABLE", "worker-0")


@with_server(max_num_seqs=4)
async def test_each_refused_request_has_one_rejected_line_naming_its_field_and_api(engine, channel):
    ScriptedWorker(channel, answer=True)
    await wait_for(lambda: engine.workers)
    with capture_logs() as logs:
        code, _ = await status_of(generate(channel, "bad", temperature=-1))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        async with Front(engine) as client:
            r = await client.post("/v1/completions", json={"prompt": [5, 6], "max_tokens": 2, "temperature": -1})
            assert r.status_code == 400
            r = await client.post("/v1/completions", content=b"{not json", headers={"content-type":
                                                                                   "application/json"})
            assert r.status_code == 400
    refused = [e for e in logs if e["event"] == "request rejected"]
    assert len(refused) == 3, refused
    grpc_line, http_line, body_line = refused
    assert (grpc_line["api"], grpc_line["status"], grpc_line["field"], grpc_line["request_id"]) == \
        ("grpc", "INVALID_ARGUMENT", "temperature", "bad")
    assert (http_line["api"], http_line["status"], http_line["field"]) == ("http", "INVALID_ARGUMENT", "temperature")
    assert "temperature" in http_line["message"]
    assert (body_line["api"], body_line["status"]) == ("http", "INVALID_ARGUMENT") and "JSON" in body_line["message"]
    assert not [e for e in logs if e["event"] in END_EVENTS]  # refused requests were never admitted


@with_server(api_keys=["the-key"])
async def test_grpc_refusals_before_parsing_carry_the_clients_request_id(engine, channel):
    """A request refused for its API key, or for a string that is not UTF-8, still names the request_id the client
    sent (the HTTP ones name theirs)."""
    bad = pb.GenerateRequest(request_id="bad-utf8", prompt="QZQZ").SerializeToString().replace(b"QZ", b"\xff", 1)
    raw = channel.unary_stream("/pagedserve.v1.Generation/Generate")
    with capture_logs() as logs:
        code, _ = await status_of(generate(channel, "no-key"))
        assert code == grpc.StatusCode.UNAUTHENTICATED
        code, _ = await status_of(raw(bad, metadata=(("authorization", "Bearer the-key"),)))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
    refused = [(e["status"], e.get("request_id")) for e in logs if e["event"] == "request rejected"]
    assert refused == [("UNAUTHENTICATED", "no-key"), ("INVALID_ARGUMENT", "bad-utf8")]


# -- honest messages when no worker is there --------------------------------------------------------------------
@with_server()
async def test_after_the_last_worker_left_requests_do_not_hear_none_attached_yet(engine, channel):
    async with Front(engine) as client:
        assert (await client.get("/health")).json()["error"]["message"] == "no worker is attached yet"
        assert await status_of(generate(channel)) == (grpc.StatusCode.UNAVAILABLE, "no worker is attached yet")
        worker = ScriptedWorker(channel, answer=True)
        await wait_for(lambda: engine.workers)
        assert await tokens_of(generate(channel, "served")) == [[7, 7, 7, 7]]
        worker.close()  # the stream ends: the worker is lost, and it was the last one
        await wait_for(lambda: not engine.workers)
        code, details = await status_of(generate(channel))
        assert code == grpc.StatusCode.UNAVAILABLE
        assert re.fullmatch(r"no worker is attached \(the last one left \d+ s ago\)", details), details
        r = await client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 4})
        assert r.status_code == 503 and r.json()["error"]["message"].startswith("no worker is attached (the last")
        health = (await client.get("/health")).json()["error"]["message"]
        assert health.startswith("no worker is attached (the last one left") and "yet" not in health


@with_server()
async def test_with_every_worker_leaving_a_new_request_hears_so(engine, channel):
    worker = ScriptedWorker(channel)  # silent: its one request keeps it leaving (the drain timeout is 30 s)
    await wait_for(lambda: engine.workers)
    running = generate(channel, "r0")
    await wait_for(lambda: worker.plans)
    worker.leave()
    await wait_for(lambda: all(w.leaving for w in engine.workers.values()))
    code, details = await status_of(generate(channel, "r1"))
    assert (code, details) == (grpc.StatusCode.UNAVAILABLE,
                               "no worker takes new requests: every attached worker is leaving")
    running.cancel()
