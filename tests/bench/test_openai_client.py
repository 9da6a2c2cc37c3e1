"""The OpenAI-compatible client against a stand-in peer: a small SSE server on loopback with a known stream."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from pagedserve_cli.bench.clients import OpenAIClient
from pagedserve_cli.bench.workloads import BenchRequest

# Five content chunks, one of them empty (a token whose text is not complete yet), the finish, then usage.
TEXTS = ["Hello", ",", "", " wor", "ld"]


class Peer(BaseHTTPRequestHandler):
    bodies: list[dict] = []
    status = 200

    def log_message(self, *args) -> None:
        pass

    def do_GET(self) -> None:
        payload = json.dumps({"object": "list", "data": [{"id": "peer-model", "max_model_len": 4096}]}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def do_POST(self) -> None:
        assert self.path == "/v1/completions"
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        Peer.bodies.append(body)
        if Peer.status != 200:
            self.send_error(Peer.status, "model overloaded")
            return
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.end_headers()  # HTTP/1.0: the body ends when the connection closes

        def send(obj) -> None:
            self.wfile.write(f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode())
            self.wfile.flush()
            time.sleep(0.01)  # so that arrival times are strictly ordered

        n = body["max_tokens"]
        for text in TEXTS:
            send({"id": "c", "object": "text_completion",
                  "choices": [{"index": 0, "text": text, "finish_reason": None}]})
        send({"id": "c", "choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
        send({"id": "c", "choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": n, "total_tokens": 3 + n}})
        send("[DONE]")


@pytest.fixture
def peer():
    Peer.bodies, Peer.status = [], 200
    server = ThreadingHTTPServer(("127.0.0.1", 0), Peer)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/v1"
    server.shutdown()
    server.server_close()


async def one(url: str, req: BenchRequest, ignore_eos: bool):
    client = OpenAIClient(url, temperature=0.0, ignore_eos=ignore_eos)
    info = await client.start()
    try:
        return info, await client.generate(3, req)
    finally:
        await client.close()


def test_streamed_chunks_are_token_events_and_usage_gives_the_total(peer):
    info, rec = asyncio.run(one(peer, BenchRequest(6, (11, 12, 13)), ignore_eos=True))
    assert info == {"max_model_len": 4096, "model": "peer-model"}
    assert rec.error is None and rec.finish_reason == "length"
    assert rec.chunk_tokens == [1, 1, 1, 1]  # the empty chunk is no token event
    assert rec.output_tokens == 6 and rec.prompt_tokens == 3  # usage wins over the count of chunks
    times = [rec.send_time, rec.first_token_time, *rec.chunk_times[1:], rec.end_time]
    assert rec.first_token_time == rec.chunk_times[0]
    assert all(a < b for a, b in zip(times, times[1:]))
    assert Peer.bodies == [{"model": "peer-model", "prompt": [11, 12, 13], "max_tokens": 6, "temperature": 0.0,
                            "stream": True, "stream_options": {"include_usage": True}, "ignore_eos": True}]


def test_text_prompts_and_no_ignore_eos_unless_asked(peer):
    _, rec = asyncio.run(one(peer, BenchRequest(4, prompt="Hi"), ignore_eos=False))
    assert rec.error is None and rec.output_tokens == 4
    assert Peer.bodies[0]["prompt"] == "Hi" and "ignore_eos" not in Peer.bodies[0]


def test_an_http_error_is_recorded_not_raised(peer):
    Peer.status = 503
    _, rec = asyncio.run(one(peer, BenchRequest(4, (1, 2)), ignore_eos=False))
    assert rec.error.startswith("HTTP 503") and rec.output_tokens == 0 and rec.end_time >= rec.send_time


def bench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedserve_cli.main", "bench", "--no-progress", *args],
                          capture_output=True, text=True, timeout=300)  # NOTE: a hang guard only


def test_the_command_against_the_peer_and_its_exit_codes(peer, tmp_path):
    workload = tmp_path / "w.jsonl"
    workload.write_text("".join(json.dumps({"prompt_token_ids": [5, 6, 7], "max_tokens": 5 + i}) + "\n"
                                for i in range(4)))
    out = bench("--openai-url", peer, "--workload", str(workload), "--out", str(tmp_path / "ok"))
    assert out.returncode == 0, out.stderr
    assert "| requests | 4 completed, 0 failed |" in out.stdout
    assert out.stdout.splitlines()[-1].startswith("output_tok_s=")
    assert sorted(b["max_tokens"] for b in Peer.bodies) == [5, 6, 7, 8]

    Peer.status = 500
    failed = bench("--openai-url", peer, "--workload", str(workload), "--out", str(tmp_path / "failed"))
    assert failed.returncode == 1 and "every request failed" in failed.stderr
    assert "0 completed, 4 failed" in (tmp_path / "failed" / "summary.md").read_text()


def test_an_unreachable_server_is_a_nonzero_exit(tmp_path):
    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = bench("--openai-url", f"http://127.0.0.1:{port}/v1", "--out", str(tmp_path))
    assert out.returncode == 1 and "cannot reach the server" in out.stderr
