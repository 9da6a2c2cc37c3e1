"""bench/gemm_peak.py's peak: the best point at M >= 256 per dtype and thread count, kept across --merge runs."""

from __future__ import annotations

from bench.gemm_peak import merge, peaks


def row(dtype: str, threads: int, gemm: str, m: int, best: float, median: float | None = None,
        layout: str = "linear") -> dict:
    return {"dtype": dtype, "threads": threads, "gemm": gemm, "m": m, "k": 1, "n": 1, "layout": layout,
            "repeats": 3, "best_gflops_s": best, "median_gflops_s": best if median is None else median}


def test_the_peak_is_the_best_point_at_large_m_only():
    rows = [row("float32", 1, "qkv", 64, 999.0), row("float32", 1, "qkv", 256, 160.0),
            row("float32", 1, "down", 2048, 170.0, 150.0, "mm"), row("float32", 1, "down", 2048, 165.0),
            row("float32", 2, "down", 512, 300.0)]
    assert peaks(rows) == {"float32": {
        "1": {"gflops_s": 170.0, "median_gflops_s": 150.0, "gemm": "down", "m": 2048, "layout": "mm"},
        "2": {"gflops_s": 300.0, "median_gflops_s": 300.0, "gemm": "down", "m": 512, "layout": "linear"}}}


def test_merge_keeps_each_points_best_of_both_runs_of_the_same_setup():
    key = {"cpu_key": "2c-abc", "torch": "2.13.0", "model": "m", "ms": [256], "threads": [1, 2],
           "dtypes": ["float32"]}
    old = {**key, "runs": 2, "results": [row("float32", 1, "qkv", 256, 150.0), row("float32", 2, "qkv", 256, 320.0),
                                         row("float32", 2, "qkv", 256, 500.0, layout="mm")]}
    new = [row("float32", 1, "qkv", 256, 170.0), row("float32", 2, "qkv", 256, 90.0)]
    merged, runs = merge(new, old, key)
    assert [r["best_gflops_s"] for r in merged] == [170.0, 320.0] and runs == 3  # point by point, layout by layout
    assert merge(new, {**old, "torch": "2.12.0"}, key) == (new, 1)  # another torch: another machine, in effect
