"""`pagedserve bench` end to end against a real scheduler and worker (tests/service's fixture) on loopback."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

LAST_LINE = re.compile(r"^output_tok_s=(\d+\.\d) ttft_p50_s=(\d+\.\d{4}) itl_p50_s=(\d+\.\d{4})$")


def bench(service, out: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pagedserve_cli.main", "bench", "--server", service.address,
           "--metrics-url", f"http://{service.metrics}/metrics", "--tokenizer", service.model_dir,
           "--ignore-eos", "--out", str(out), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_every_request_completes_with_exactly_its_output_tokens(service, tmp_path):
    out = bench(service, tmp_path, "--num-requests", "16", "--prompt-len", "16:64", "--output-len", "4:24")
    assert out.returncode == 0, out.stderr
    print(out.stdout)  # the sample the report quotes (pytest -s)
    assert "bench:" in out.stderr  # the progress bar
    assert LAST_LINE.match(out.stdout.splitlines()[-1]), out.stdout.splitlines()[-1]
    results = json.loads((tmp_path / "results.json").read_text())
    workload = [json.loads(line) for line in (tmp_path / "workload.jsonl").read_text().splitlines()]
    assert len(results["requests"]) == len(workload) == 16
    for rec, req in zip(results["requests"], workload):
        assert rec["error"] is None and rec["finish_reason"] == "length"
        assert rec["output_tokens"] == sum(rec["chunk_tokens"]) == rec["max_tokens"] == req["max_tokens"]
        assert rec["prompt_tokens"] == len(req["prompt_token_ids"])
        assert 16 <= rec["prompt_tokens"] <= 64 and 4 <= rec["max_tokens"] <= 24
        assert rec["send_time"] <= rec["first_token_time"] <= rec["chunk_times"][-1] <= rec["end_time"]
    s = results["summary"]
    assert (s["completed"], s["failed"]) == (16, 0)
    assert s["output_tokens"] == sum(r["max_tokens"] for r in workload)
    assert s["server"] is not None and s["server"]["kv_blocks_total"] == 40
    assert s["server"]["samples"] >= 2 and s["server"]["preemptions"] >= 0
    assert results["config"]["max_model_len"] == 512  # the tiny model's limit, seen through GetModelInfo
    for name in ("summary.md", "throughput.png", "ttft.png", "itl.png", "kv_map.png", "kv_usage.png", "kv_map.gif"):
        assert (tmp_path / name).stat().st_size > 0, name  # the pool's pictures: the server answers GetKVState
    for name in ("throughput.png", "ttft.png", "itl.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "| requests | 16 completed, 0 failed |" in (tmp_path / "summary.md").read_text()


def test_shared_prefix_hits_the_prefix_cache(service, tmp_path):
    # One at a time, so that each request finds the system prompt the one before it left in the cache.
    out = bench(service, tmp_path, "--workload", "shared-prefix", "--num-requests", "3", "--max-concurrency", "1",
                "--prompt-len", "8:16", "--output-len", "2:4", "--no-progress")
    assert out.returncode == 0, out.stderr
    s = json.loads((tmp_path / "results.json").read_text())["summary"]
    assert s["completed"] == 3 and s["server"]["prefix_hit_rate"] > 0
    assert "prefix cache hit rate" in out.stdout


def test_openai_url_benchmarks_our_own_http_front(service, tmp_path):
    """The same harness over our OpenAI-compatible front: every request completes with its exact output length."""
    cmd = [sys.executable, "-m", "pagedserve_cli.main", "bench", "--openai-url", f"http://{service.http}/v1",
           "--metrics-url", f"http://{service.metrics}/metrics", "--tokenizer", service.model_dir, "--ignore-eos",
           "--out", str(tmp_path), "--num-requests", "8", "--prompt-len", "16:48", "--output-len", "4:16"]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert LAST_LINE.match(out.stdout.splitlines()[-1]), out.stdout.splitlines()[-1]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["config"]["served_model"] == service.model_dir  # the first model /v1/models lists
    assert results["config"]["max_model_len"] == 512
    workload = [json.loads(line) for line in (tmp_path / "workload.jsonl").read_text().splitlines()]
    for rec, req in zip(results["requests"], workload, strict=True):
        assert rec["error"] is None and rec["finish_reason"] == "length"
        assert rec["output_tokens"] == rec["max_tokens"] == req["max_tokens"]  # from the usage chunk
        assert rec["prompt_tokens"] == len(req["prompt_token_ids"])
    assert (results["summary"]["completed"], results["summary"]["failed"]) == (8, 0)
