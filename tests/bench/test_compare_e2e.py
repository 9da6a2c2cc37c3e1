"""`pagedserve bench --compare` end to end: each side is a real `pagedserve up` (scheduler + worker processes)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from PIL import Image

from tests.support.network import CORPUS_MARK
from worker_svc.models import resolve_dtype

# The tiny model: 2 layers x 2 kv heads x 16 head_dim x 4 bytes x 2 (K, V) = 512 bytes per token, 8 KiB a block.
KV_MEMORY = str(80 * 16 * 512)  # 80 blocks
MAX_MODEL_LEN = 256  # a static reservation: 16 blocks, so at most 5 sequences at once

STATIC_LAST = re.compile(r"^waste_paged=(\d\.\d{4}) waste_static=(\d\.\d{4}) concurrency_ratio=(\d+\.\d\d) "
                         r"throughput_ratio=(\d+\.\d\d)$")
PREFIX_LAST = re.compile(r"^prefill_tokens_ratio=(\d\.\d{4}) ttft_ratio=(\d+\.\d\d)$")


def compare(model: str, out: Path, *args: str) -> subprocess.CompletedProcess:
    # NOTE: a fine sampling period: the tiny model's runs last a fraction of a second on a quiet machine.
    cmd = [sys.executable, "-m", "pagedserve_cli.main", "bench", "--model", model, "--kv-memory", KV_MEMORY,
           "--max-model-len", str(MAX_MODEL_LEN), "--threads", "1", "--no-progress", "--kv-sample-period", "0.01",
           "--out", str(out), *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=900)


def test_static_prealloc_reserves_whole_sequences_and_wastes_what_paging_does_not(tiny_served_model, tmp_path):
    out = compare(tiny_served_model, tmp_path, "--compare", "static-prealloc", "--num-requests", "12",
                  "--prompt-len", "16:48", "--output-len", "32:48", "--ignore-eos")
    assert out.returncode == 0, out.stderr[-4000:]
    print(out.stdout)
    m = STATIC_LAST.match(out.stdout.splitlines()[-1])
    assert m, out.stdout.splitlines()[-1]
    doc = json.loads((tmp_path / "compare.json").read_text())
    sides = {s["name"]: s for s in doc["sides"]}
    assert list(sides) == ["paged", "static-max-model-len", "static-request"]
    for s in sides.values():
        assert (s["summary"]["completed"], s["summary"]["failed"]) == (12, 0)
        assert s["usage"]["samples"] >= 1
    # Every sequence holds at most 96 tokens: a 256-slot reservation leaves at least 62% of it empty, while a
    # paged table leaves less than one block per sequence of at least 16 tokens empty (under 50%).
    assert float(m[1]) == round(sides["paged"]["usage"]["waste"], 4) < 0.5
    assert float(m[2]) == round(sides["static-max-model-len"]["usage"]["waste"], 4) > 0.62
    assert sides["static-max-model-len"]["usage"]["peak_running"] <= 5  # 80 blocks / 16 per reservation
    assert sides["paged"]["usage"]["external"] == 0.0
    for name in ("compare.md", "kv_usage.png", "kv_map.png", "workload.jsonl", "paged/results.json",
                 "static-request/throughput.png"):
        assert (tmp_path / name).stat().st_size > 0, name
    with Image.open(tmp_path / "kv_map.gif") as gif:
        assert gif.n_frames >= 1 and gif.size[0] >= 3 * 400  # three maps side by side


def test_no_prefix_cache_computes_the_shared_system_prompt_once_per_request(tiny_served_model, tmp_path):
    # One at a time: request k > 0 finds the 128-token system prompt (max_model_len / 2, 8 full blocks) cached.
    out = compare(tiny_served_model, tmp_path, "--compare", "no-prefix-cache", "--num-requests", "6",
                  "--max-concurrency", "1", "--prompt-len", "8:24", "--output-len", "2:4")
    assert out.returncode == 0, out.stderr[-4000:]
    assert PREFIX_LAST.match(out.stdout.splitlines()[-1]), out.stdout.splitlines()[-1]
    doc = json.loads((tmp_path / "compare.json").read_text())
    assert doc["config"]["workload"] == "shared-prefix"
    on, off = doc["sides"]
    assert (on["name"], off["name"]) == ("prefix-cache", "no-prefix-cache")
    num_prompt = on["summary"]["prompt_tokens"]
    assert off["summary"]["prompt_tokens"] == num_prompt
    assert off["prefill_tokens"] == num_prompt
    assert on["prefill_tokens"] == num_prompt - 5 * 128
    assert doc["last_line"].startswith(f"prefill_tokens_ratio={on['prefill_tokens'] / num_prompt:.4f} ")


def test_spawn_benches_a_private_server_and_stops_it(tiny_served_model, tmp_path):
    out = compare(tiny_served_model, tmp_path, "--spawn", "--num-requests", "4", "--prompt-len", "8:16",
                  "--output-len", "4:4", "--ignore-eos")
    assert out.returncode == 0, out.stderr[-4000:]
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["summary"]["completed"] == 4 and results["summary"]["output_tokens"] == 16
    # its own worker, with --kv-memory, in the dtype `auto` picks on this CPU (a float32 block is 8 KiB)
    auto = resolve_dtype("auto", "cpu", {"torch_dtype": "float32"})
    assert results["summary"]["server"]["kv_blocks_total"] == 80 * 4 // auto.dtype.itemsize
    server = results["config"]["server"]
    assert not [p for p in Path("/proc").glob("[0-9]*/cmdline")  # `up` and its children are gone
                if server.encode() in _read(p)]


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError:  # the process ended while we looked
        return b""


def test_compare_refuses_a_server_of_its_own(tmp_path):
    out = compare("unused", tmp_path, "--compare", "no-prefix-cache", "--server", "127.0.0.1:1")
    assert out.returncode == 2 and "--compare starts its own servers" in out.stderr


KV_INT8_LAST = re.compile(r"^blocks_ratio=(\d+\.\d{4}) concurrency_ratio=(\d+\.\d\d) throughput_ratio=(\d+\.\d\d) "
                          r"ppl_delta_pct=(-?\d+\.\d\d)$")


@CORPUS_MARK  # --ppl-tokens: the perplexity corpus
def test_kv_int8_registers_the_pool_bytes_blocks_of_each_cache_and_scores_both(tiny_served_model, tmp_path):
    # The tiny model's float32 cache takes 512 bytes a token (8 KiB a block: 80 blocks); int8 2 x 2 x 2 x (16 + 4)
    # = 160 (2,560 bytes a block: 256 blocks in the same bytes).
    # NOTE: outputs long enough that each side runs for many KV samples: a run of 0.1 s (8:16 tokens) could end
    # between two samples on a busy machine, leaving its concurrency unmeasured (nan)
    out = compare(tiny_served_model, tmp_path, "--compare", "kv-int8", "--num-requests", "8", "--prompt-len",
                  "16:32", "--output-len", "64:80", "--max-num-seqs", "8", "--ppl-tokens", "200")
    assert out.returncode == 0, out.stderr[-4000:]
    print(out.stdout)
    m = KV_INT8_LAST.match(out.stdout.splitlines()[-1])
    assert m, out.stdout.splitlines()[-1]
    doc = json.loads((tmp_path / "compare.json").read_text())
    base, quant = doc["sides"]
    assert (base["name"], base["flags"]) == ("float32", ["--kv-cache-dtype", "float32"])
    assert (quant["name"], quant["flags"]) == ("int8", ["--kv-cache-dtype", "int8"])
    assert [(w["dtype"], w["num_blocks"]) for w in base["workers"]] == [("float32", 80)]
    assert [(w["dtype"], w["num_blocks"]) for w in quant["workers"]] == [("int8", 256)]
    assert m[1] == f"{256 / 80:.4f}"
    for side in (base, quant):  # the same workload on both, EOS ignored by default
        assert (side["summary"]["completed"], side["summary"]["failed"]) == (8, 0)
        assert side["summary"]["output_tokens"] == doc["sides"][0]["summary"]["output_tokens"]
    assert doc["config"]["ignore_eos"] is True and doc["config"]["max_num_seqs"] == 8
    ppl = doc["perplexity"]
    assert ppl["num_tokens"] == 200 and ppl["float32"] > 1 and ppl["int8"] > 1
    assert m[4] == f"{100 * (ppl['int8'] / ppl['float32'] - 1):.2f}"
    # The capacity table: at 512 MiB (the budget) and at the run's
    assert list(doc["capacity"]) == ["512MiB", "640KiB"]
    assert [(c["dtype"], c["num_blocks"]) for c in doc["capacity"]["640KiB"]] == [
        ("float32", 80), ("bfloat16", 160), ("int8", 256), ("fp8_e4m3", 256)]
    assert "| int8 | 160 | 209,715 | 3.20 | 256 | 3.20 |" in out.stdout


def test_ppl_tokens_belongs_to_kv_int8_only(tmp_path):
    out = compare("unused", tmp_path, "--compare", "no-prefix-cache", "--ppl-tokens", "100")
    assert out.returncode == 2 and "--ppl-tokens: only --compare kv-int8" in out.stderr
