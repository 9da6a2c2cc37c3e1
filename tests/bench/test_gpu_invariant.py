"""bench/gpu_invariant.py off a GPU: it says why and exits 2; its shapes are the worker's fused matmuls of the default
model and of a Llama-3-8B-like one; its byte and FLOP counts and its summary line (the GPU run itself needs a device:
bench/device_check.sh)."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from pagedserve_cli.bench.flops import ModelShape

BENCH_SCRIPT = "gpu_invariant"
SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "gpu_invariant.py"


def test_without_a_cuda_device_it_says_why_and_exits_2():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is here: the script would run the benchmark")
    run = subprocess.run([sys.executable, str(SCRIPT)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 2, run.stdout + run.stderr
    assert run.stdout.strip() == ("bench/gpu_invariant.py needs a CUDA device (torch.cuda.is_available() is False); "
                                  "nothing to measure.")


def test_the_default_models_shape_is_its_config(bench_script, default_model):
    assert bench_script.MODELS["smollm2-135m"] == ModelShape.from_dir(default_model)


def test_the_points_are_the_fused_matmuls_at_every_m_and_the_lm_head_at_sampled_rows_only(bench_script):
    points = bench_script.matmul_points()
    by_weight: dict[tuple[str, str, int, int], list[int]] = {}
    for p in points:
        by_weight.setdefault((p.model, p.name, p.k, p.n), []).append(p.m)
    every_m, sampled = [1, 8, 32, 128, 512, 2048], [1, 8, 32, 128]
    assert by_weight == {
        ("smollm2-135m", "qkv", 576, 960): every_m, ("smollm2-135m", "o_proj", 576, 576): every_m,
        ("smollm2-135m", "gate_up", 576, 3072): every_m, ("smollm2-135m", "down", 1536, 576): every_m,
        ("smollm2-135m", "lm_head", 576, 49152): sampled,
        ("llama3-8b", "qkv", 4096, 6144): every_m, ("llama3-8b", "o_proj", 4096, 4096): every_m,
        ("llama3-8b", "gate_up", 4096, 28672): every_m, ("llama3-8b", "down", 14336, 4096): every_m,
        ("llama3-8b", "lm_head", 4096, 128256): sampled,
    }
    # a weight's points are consecutive (the bench holds one weight on the device at a time)
    labels = [p.label for p in points]
    assert len(set(labels)) == sum(1 for a, b in zip([None, *labels], labels) if a != b)


def test_traffic_counts_x_and_w_read_once_and_y_written_once(bench_script):
    # Llama gate_up at M = 1, bfloat16: x 4096, W 28672 x 4096, y 28672 values of 2 bytes
    assert bench_script.gemm_bytes(1, 28672, 4096, 2) == 8192 + 234_881_024 + 57_344
    assert bench_script.gemm_flops(1, 28672, 4096) == 234_881_024
    assert bench_script.gemm_flops(2048, 28672, 4096) == 481_036_337_152
    # RMSNorm of 32 rows of 576 float16: x read, y written, the weight once
    assert bench_script.norm_bytes(32, 576, 2) == 36_864 + 36_864 + 1_152


def test_summary_line_is_the_geometric_means_and_nan_where_every_point_failed(bench_script):
    assert bench_script.summary_line([2.0, 8.0], [0.5, 2.0], [3.0]) == (
        "invariant_matmul_ratio_m1=4.000 invariant_matmul_ratio_m2048=1.000 invariant_norm_ratio=3.000")
    assert math.isnan(bench_script.geomean([]))
