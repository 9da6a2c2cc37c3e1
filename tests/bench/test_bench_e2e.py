"""`pagedserve bench` end to end against a real scheduler and worker (tests/service's fixture) on loopback."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

LAST_LINE = re.compile(r"^output_tok_s=(\d+\.\d) ttft_p50_s=(\d+\.\d{4}) itl_p50_s=(\d+\.\d{4})$")
FLOPS_LINE = re.compile(r"^model_gflops_s=(\d+\.\d\d) peak_gflops_s=(\d+\.\d) peak_share=(\d\.\d{4}) "
                        r"per_core_share=(\d+\.\d{4}) "
                        r"cpu_s_server=(\d+\.\d\d) cpu_s_scheduler=(\d+\.\d\d) cpu_s_worker=(\d+\.\d\d) "
                        r"(?:cpu_s_up=(\d+\.\d\d) )?cpu_s_client=(\d+\.\d\d)$")
REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gemm_peak(tiny_served_model, tmp_path_factory) -> Path:
    """bench/gemm_peak.py's JSON for the tiny model's shapes, float32 at one thread (a few seconds)."""
    out = tmp_path_factory.mktemp("gemm-peak") / "gemm_peak.json"
    run = subprocess.run([sys.executable, str(REPO / "bench" / "gemm_peak.py"), "--model", tiny_served_model,
                          "--ms", "1,256", "--threads", "1", "--dtypes", "float32", "--budget-s", "0.02",
                          "--rounds", "1", "--no-cache", "--out", str(out)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-4000:]
    assert re.fullmatch(r"gemm_peak float32_1t=\d+\.\d", run.stdout.splitlines()[-1]), run.stdout
    return out


def bench(service, out: Path, *args: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pagedserve_cli.main", "bench", "--server", service.address,
           "--metrics-url", f"http://{service.metrics}/metrics", "--tokenizer", service.model_dir,
           "--ignore-eos", "--out", str(out), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=300)


def test_every_request_completes_with_exactly_its_output_tokens(service, gemm_peak, tmp_path):
    # NOTE: the peak named: the default one is a per-machine cache that a fresh machine lacks (its share is then nan)
    out = bench(service, tmp_path, "--num-requests", "16", "--prompt-len", "16:64", "--output-len", "4:24",
                "--gemm-peak", str(gemm_peak))
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
    # The worker runs on its own (no `up` above it): found by its connection to the scheduler's worker port
    assert FLOPS_LINE.match(out.stdout.splitlines()[-2]), out.stdout.splitlines()[-2]
    assert s["cpu"]["local"] and {"scheduler", "worker", "client"} <= set(s["cpu"]["by_role"])


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


def test_spawn_reports_the_model_flops_share_of_the_peak_and_each_process_cpu_seconds(tiny_served_model, gemm_peak,
                                                                                      tmp_path):
    """A real `pagedserve up` (--spawn): the FLOP model's token counts, a share of the given peak, CPU seconds of
    up, its scheduler and its worker (found below the listening scheduler's parent) and of the client."""
    cmd = [sys.executable, "-m", "pagedserve_cli.main", "bench", "--spawn", "--model", tiny_served_model,
           "--dtype", "float32", "--threads", "1", "--kv-memory", str(80 * 16 * 512), "--ignore-eos",
           "--num-requests", "12", "--prompt-len", "16:48", "--output-len", "4:16", "--gemm-peak", str(gemm_peak),
           "--no-progress", "--out", str(tmp_path)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-4000:]
    print(out.stdout)
    lines = out.stdout.splitlines()
    assert LAST_LINE.match(lines[-1]), lines[-1]
    m = FLOPS_LINE.match(lines[-2])
    assert m, lines[-2]
    results = json.loads((tmp_path / "results.json").read_text())
    s = results["summary"]
    c, cpu = s["compute"], s["cpu"]
    hits = s["server"]["prefix_hits_tokens"]
    assert c["prefill_tokens"] == s["prompt_tokens"] - hits
    assert c["decode_tokens"] == s["output_tokens"] - s["completed"] == sum(
        r["output_tokens"] - 1 for r in results["requests"])
    assert c["sampled_rows"] == s["output_tokens"]
    assert (c["dtype"], c["dtype_source"], c["peak_threads"]) == ("float32", "the workers' registration", 1)
    peak = json.loads(gemm_peak.read_text())["peak"]["float32"]["1"]["gflops_s"]
    assert c["peak_gflops_s"] == peak and c["model_gflops_s"] > 0 and c["peak_share"] > 0
    assert c["peak_share"] == pytest.approx(c["model_gflops_s"] / peak)
    assert float(m[1]) == pytest.approx(c["model_gflops_s"], abs=0.005)
    roles = [p["role"] for p in cpu["processes"]]
    assert sorted(roles) == ["client", "scheduler", "up", "worker"], cpu["processes"]
    assert cpu["local"] and cpu["by_role"]["scheduler"] > 0 and cpu["by_role"]["worker"] > 0
    assert cpu["by_role"]["client"] > 0 and float(m[6]) > 0 and float(m[7]) > 0  # scheduler, worker
    # one thread's work: the model GFLOP per worker CPU-second over the one-thread peak (the only one measured)
    assert c["worker_cpu_s"] == cpu["by_role"]["worker"]
    assert c["per_core_share"] == pytest.approx(c["gflop"]["total"] / c["worker_cpu_s"] / peak) and float(m[4]) > 0
    assert cpu["server_cpu_s"] == pytest.approx(sum(v for k, v in cpu["by_role"].items() if k != "client"))
    summary = (tmp_path / "summary.md").read_text()
    assert "## Model FLOP/s" in summary and "| worker |" in summary and lines[-2] in summary


def test_tenant_tags_every_request_of_a_run_on_both_apis(service, tmp_path):
    """--tenant sends x-pagedserve-tenant: two runs, two tenants, each request in its tenant's TTFT series."""
    from tests.support.service import metric_value, scrape

    grpc_run = bench(service, tmp_path / "a", "--num-requests", "4", "--prompt-len", "8:16", "--output-len", "2:4",
                     "--tenant", "bench-team-a", "--no-progress")
    assert grpc_run.returncode == 0, grpc_run.stderr
    cmd = [sys.executable, "-m", "pagedserve_cli.main", "bench", "--openai-url", f"http://{service.http}/v1",
           "--metrics-url", "", "--tokenizer", service.model_dir, "--ignore-eos", "--out", str(tmp_path / "b"),
           "--num-requests", "3", "--prompt-len", "8:16", "--output-len", "2:4", "--tenant", "bench team b",
           "--no-progress"]
    http_run = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert http_run.returncode == 0, http_run.stderr
    text = scrape(service.metrics)
    assert metric_value(text, "pagedserve_tenant_ttft_seconds_count", tenant="bench-team-a") == 4
    assert metric_value(text, "pagedserve_tenant_ttft_seconds_count", tenant="bench team b") == 3
    assert json.loads((tmp_path / "a" / "results.json").read_text())["config"]["tenant"] == "bench-team-a"
    bad = bench(service, tmp_path / "c", "--num-requests", "1", "--tenant", "caf\u00e9")
    assert bad.returncode != 0 and "--tenant: at most 128 visible ASCII characters" in bad.stderr
