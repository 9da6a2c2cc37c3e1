"""Logs a person can read, from real processes: `pagedserve up` serves, refuses and loses a few requests, then
stops; its stderr (JSON lines, as under any supervisor, each naming the process that wrote it) has one line per
request and no traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import grpc
import httpx
import pytest

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc
from pagedserve_common.ports import free_port
from tests.support.service import wait_until
from tests.support.processes import stop_all, up

END_EVENTS = ("request finished", "request aborted", "request failed")
NOISE = ("Traceback", "Exception ignored", "Task was destroyed", "it/s]", "%|")  # the last two: progress bars
HUGE_ID = "h" * 100_000


def serve_a_few(listen: str, http: str, log_path) -> str:
    """A served request (2 samples), a refused one, one cancelled after its first token, one with a 100 KB
    request_id, and a served HTTP one, whose request id it returns."""
    with grpc.insecure_channel(listen) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        msgs = list(stub.Generate(pb.GenerateRequest(request_id="logs-ok", prompt="hi", sampling=pb.SamplingParams(
            max_tokens=3, n=2, ignore_eos=True)), timeout=60))
        assert sum(len(m.token_ids) for m in msgs) == 6
        with pytest.raises(grpc.RpcError) as refused:
            list(stub.Generate(pb.GenerateRequest(request_id="logs-bad", prompt="hi", sampling=pb.SamplingParams(
                max_tokens=3, temperature=-1)), timeout=60))
        assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        # NOTE: ~500 tokens take seconds even for the tiny model: the cancel comes long before the end
        call = stub.Generate(pb.GenerateRequest(request_id="logs-cancel", prompt="hi", sampling=pb.SamplingParams(
            max_tokens=500, ignore_eos=True)), timeout=120)
        assert next(call).token_ids
        call.cancel()
        wait_until(lambda: '"request_id": "logs-cancel"' in log_path.read_text())
        with pytest.raises(grpc.RpcError):
            list(stub.Generate(pb.GenerateRequest(request_id=HUGE_ID, prompt="hi"), timeout=60))
    r = httpx.post(f"http://{http}/v1/completions", json={"prompt": "hi", "max_tokens": 3, "ignore_eos": True},
                   timeout=60)
    assert r.status_code == 200, r.text
    return r.json()["id"].removeprefix("cmpl-")


@pytest.mark.parametrize("how,workers", [("Ctrl-C to the process group", 2), ("SIGTERM to up", 1)])
def test_up_logs_one_line_per_request_and_stops_without_a_traceback(tiny_served_model, tmp_path, how, workers):
    listen, http, log_path = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}", tmp_path / "stderr"
    with open(log_path, "w") as err:
        proc = up(tiny_served_model, listen, "--http", http, "--workers", str(workers), stderr=err)
    try:
        assert proc.stdout.readline().startswith(f"pagedserve is up: {listen}")
        http_id = serve_a_few(listen, http, log_path)
        if how == "SIGTERM to up":
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGINT)
        assert proc.wait(timeout=120) == 0
    finally:
        stop_all(proc)

    text = log_path.read_text()
    for noise in NOISE:
        assert noise not in text, text
    assert HUGE_ID[:1000] not in text
    assert max(len(line) for line in text.splitlines()) < 4096  # long values are cut (logs.truncate_long_values)
    events = [json.loads(line) for line in text.splitlines()]  # every line is JSON, up's own too
    names = {"up", "scheduler", *(f"worker-{i}" for i in range(workers))}
    assert {e["process"] for e in events} == names, events  # each says which process wrote it
    assert {e["event"] for e in events if e["process"] == "up"} >= {"draining the scheduler", "stopped"}
    ready = [e for e in events if e["event"] == "worker ready"]
    assert sorted(e["process"] for e in ready) == [f"worker-{i}" for i in range(workers)]
    assert all(e["warm_up_steps"] >= 4 and e["warm_up_s"] >= 0 for e in ready), ready  # warmed before attaching
    assert all(e["attention"] == "cpu" and e["int8_qk"] is False for e in ready), ready  # a float32 cache: no int8 Q.K

    ends: dict[str, list[dict]] = {}
    for e in events:
        if e["event"] in END_EVENTS:
            ends.setdefault(e["request_id"], []).append(e)
    assert sorted(ends) == sorted(["logs-ok", "logs-cancel", http_id]), ends  # the refused ones were never admitted
    assert all(len(lines) == 1 for lines in ends.values()), ends
    (ok,), (cancelled,), (served,) = ends["logs-ok"], ends["logs-cancel"], ends[http_id]
    assert (ok["event"], ok["finish_reason"], ok["output_tokens"]) == ("request finished", "length,length", 6)
    assert ok["worker"].startswith("worker-") and ok["prompt_tokens"] >= 1
    assert 0 <= ok["ttft_s"] <= ok["e2e_s"]
    assert (cancelled["event"], cancelled["status"]) == ("request aborted", "CANCELLED")
    assert 1 <= cancelled["output_tokens"] < 500 and cancelled["ttft_s"] is not None
    assert (served["event"], served["finish_reason"], served["output_tokens"]) == ("request finished", "length", 3)

    refused = {e.get("field"): e for e in events if e["event"] == "request rejected"}
    assert sorted(refused) == ["request_id", "temperature"], refused
    bad = refused["temperature"]
    assert (bad["request_id"], bad["status"], bad["api"]) == ("logs-bad", "INVALID_ARGUMENT", "grpc")
    assert refused["request_id"]["request_id"].endswith(f"…(+{len(HUGE_ID) - 300} chars)")

    assert [e["event"] for e in events].count("worker attached") == workers
    detached = [e for e in events if e["event"] == "worker detached"]
    assert len(detached) == workers and {e["reason"] for e in detached} == {"the scheduler stops"}


def test_a_worker_stopped_while_it_starts_exits_0_without_a_traceback(tiny_served_model, tmp_path):
    """SIGINT (a terminal's Ctrl-C) while torch imports: it used to end in a KeyboardInterrupt traceback."""
    with open(tmp_path / "stderr", "w") as err:
        worker = subprocess.Popen([sys.executable, "-m", "pagedserve_cli.main", "worker", "--scheduler",
                                   f"127.0.0.1:{free_port()}", "--model", tiny_served_model, "--kv-memory", "4MiB"],
                                  stderr=err)
    try:
        # NOTE: torch's library mapped means the import is under way: past the handlers, before any model is loaded
        wait_until(lambda: worker.poll() is not None or "libtorch" in Path(f"/proc/{worker.pid}/maps").read_text(),
                   timeout=120)
        worker.send_signal(signal.SIGINT)
        assert worker.wait(timeout=60) == 0
    finally:
        if worker.poll() is None:
            worker.kill()
    text = (tmp_path / "stderr").read_text()
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text
