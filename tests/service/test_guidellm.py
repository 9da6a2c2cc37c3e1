"""vLLM's benchmark tool, guidellm (`guidellm run`), against a real `pagedserve serve`: every request it sends
completes, the tokens it counts (from the streamed usage: it asks for `stream_options.continuous_usage_stats`) are
the server's, and the server still serves afterwards."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from pagedserve_common.ports import free_port
from tests.support.service import wait_until
from tests.support.processes import stop_all

# NOTE: setup (a slow, busy machine may take minutes to start the server) and guidellm's run count against the
# test's timeout together: STARTUP_TIMEOUT + GUIDELLM_TIMEOUT and some room.
pytestmark = pytest.mark.timeout(1200)

KEY = "guidellm-test-key"
MODEL = "my-model"
STARTUP_TIMEOUT = 300
GUIDELLM_TIMEOUT = 600
REQUESTS, STREAMS, PROMPT_TOKENS, OUTPUT_TOKENS = 8, 4, 32, 16


@dataclass
class Served:
    url: str  # http://HOST:PORT (guidellm's target: it adds v1/... itself)
    model_dir: str
    log: Path  # `serve`'s stderr: its children's JSON log lines
    proc: subprocess.Popen


def first_line(proc: subprocess.Popen, timeout: float) -> str:
    """The first line `proc` writes on stdout ("" when it exits first), waited for `timeout` seconds at most."""
    line: list[str] = []
    reader = threading.Thread(target=lambda: line.append(proc.stdout.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return line[0] if line else f"(nothing after {timeout} s)"


@pytest.fixture(scope="module")
def served(tiny_served_model, tmp_path_factory):
    port = free_port()
    log = tmp_path_factory.mktemp("guidellm-serve") / "stderr"
    with open(log, "w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "pagedserve_cli.main", "serve", tiny_served_model, "--host", "127.0.0.1",
             "--port", str(port), "--served-model-name", MODEL, "--api-key", KEY, "--listen",
             f"127.0.0.1:{free_port()}", "--worker-listen", f"127.0.0.1:{free_port()}", "--metrics", "",
             "--kv-memory", "4MiB", "--threads", "1", "--dtype", "float32"],
            stdout=subprocess.PIPE, stderr=err, text=True, start_new_session=True,
            env={**os.environ, "PAGEDSERVE_LOG_FORMAT": "json"})
    try:
        line = first_line(proc, STARTUP_TIMEOUT)  # NOTE: `up` prints it once serving (or exits: then it is empty)
        assert line.startswith("pagedserve is up"), f"{line!r}: {log.read_text()[-3000:]}"
        yield Served(f"http://127.0.0.1:{port}", tiny_served_model, log, proc)
    finally:
        stop_all(proc)


def guidellm_command(served: Served, report: Path) -> list[str]:
    """`guidellm run` (0.7's command line): the OpenAI HTTP backend (chat completions, streamed) with the API key,
    REQUESTS synthetic prompts over STREAMS concurrent streams, tokenized with the served model's own tokenizer."""
    return [sys.executable, "-m", "guidellm", "run",
            "--backend", f"kind=openai_http,target={served.url},model={MODEL},api_key={KEY}",
            "--profile", f"kind=concurrent,streams={STREAMS}",
            "--constraint", f"kind=max_requests,count={REQUESTS}",
            "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},output_tokens={OUTPUT_TOKENS}",
            "--tokenizer", f"kind=huggingface_auto,model={served.model_dir}",
            "--output", f"kind=json,path={report}",
            "--disable-console-interactive"]


def run_guidellm(command: list[str], cwd: Path) -> str:
    """Runs `command` (in its own session: guidellm spawns worker processes) to its end; fails with its output
    when it exits non-zero or outlives GUIDELLM_TIMEOUT."""
    # NOTE: no Hub here: the tokenizer is a local directory. cwd: guidellm reads a .env there and writes its files.
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    out_path = cwd / "guidellm.out"
    with open(out_path, "w") as out:
        proc = subprocess.Popen(command, cwd=cwd, env=env, stdout=out, stderr=subprocess.STDOUT,
                                start_new_session=True)
    try:
        proc.wait(timeout=GUIDELLM_TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        pytest.fail(f"guidellm still running after {GUIDELLM_TIMEOUT} s: {out_path.read_text()[-4000:]}")
    output = out_path.read_text()
    assert proc.returncode == 0, f"guidellm exited {proc.returncode}: {output[-4000:]}"
    return output


def server_events(log: Path, *names: str) -> list[dict]:
    """The server's JSON log lines whose event is one of `names`."""
    events = []
    for line in log.read_text(errors="replace").splitlines():
        try:
            event = json.loads(line)
        except ValueError:
            continue
        if isinstance(event, dict) and event.get("event") in names:
            events.append(event)
    return events


def server_ends(log: Path) -> dict[str, dict]:
    """The server's request end lines (finished, aborted, failed) by request id."""
    return {e["request_id"]: e for e in server_events(log, "request finished", "request aborted", "request failed")}


def why(requests: dict, log: Path) -> str:
    """What went wrong: guidellm's errors (it keeps the exception, not the response body) and the server's own
    words for what it refused or failed (the field and message of a refusal)."""
    errors = [r["info"].get("error") for r in requests["errored"] + requests["incomplete"]]
    refusals = server_events(log, "request rejected", "request failed", "request aborted")
    return f"guidellm's errors: {errors[:4]}; the server's: {refusals[:4]}"


def test_guidellm_completes_every_request_and_counts_the_servers_tokens(served, tmp_path):
    report_path = tmp_path / "report.json"
    output = run_guidellm(guidellm_command(served, report_path), tmp_path)
    report = json.loads(report_path.read_text())

    (bench,) = report["benchmarks"]
    made, requests = bench["scheduler_metrics"]["requests_made"], bench["requests"]
    assert (made["successful"], made["errored"], made["incomplete"]) == (REQUESTS, 0, 0), \
        f"{made}: {why(requests, served.log)}\n{output[-3000:]}"
    assert (len(requests["successful"]), requests["errored"], requests["incomplete"]) == (REQUESTS, [], []), \
        why(requests, served.log)

    sent = json.loads(requests["successful"][0]["request_args"])["body"]
    # what guidellm asks for: the usage in every streamed chunk (the counts it records are the last chunk's), and
    # exactly OUTPUT_TOKENS tokens (max_completion_tokens with ignore_eos)
    assert sent["stream"] is True
    assert sent["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
    assert (sent["model"], sent["max_completion_tokens"], sent["ignore_eos"]) == (MODEL, OUTPUT_TOKENS, True)

    # each request as the server saw it: the stream's id is chatcmpl-<the request id the server logs>
    ids = [r["response_id"] for r in requests["successful"]]
    assert len(set(ids)) == REQUESTS and all(i.startswith("chatcmpl-") for i in ids), ids
    wait_until(lambda: {i.removeprefix("chatcmpl-") for i in ids} <= server_ends(served.log).keys(), timeout=60)
    ends = server_ends(served.log)
    for r in requests["successful"]:
        end = ends[r["response_id"].removeprefix("chatcmpl-")]
        assert end["event"] == "request finished", end
        assert r["output_tokens"] > 0 and r["output"], r
        assert (r["prompt_tokens"], r["output_tokens"]) == (end["prompt_tokens"], end["output_tokens"]), (r, end)
        assert r["output_tokens"] == OUTPUT_TOKENS and end["finish_reason"] == "length", end

    # and the server kept serving
    assert served.proc.poll() is None
    after = httpx.post(f"{served.url}/v1/chat/completions", headers={"authorization": f"Bearer {KEY}"}, timeout=300,
                       json={"model": MODEL, "messages": [{"role": "user", "content": "Still there?"}],
                             "max_tokens": 4, "ignore_eos": True})
    assert after.status_code == 200, after.text
    assert after.json()["usage"]["completion_tokens"] == 4
