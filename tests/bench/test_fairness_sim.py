"""bench/fairness.py's simulation: under fair the light tenant no longer waits for the flood, within VTC's bound."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

_PATH = Path(__file__).resolve().parents[2] / "bench" / "fairness.py"
SIZES = dict(num_blocks=2048, max_num_seqs=8, budget=256, flood_prompt=256, flood_output=64, light_prompt=32,
             light_output=8)
BENCH_SCRIPT = "fairness"


@pytest.fixture(scope="module")
def sim(bench_script):
    return bench_script


def test_fair_serves_the_light_tenant_while_the_flood_runs(sim):
    fcfs = sim.simulate("fcfs", 30, 8, 1.0, **SIZES)
    fair = sim.simulate("fair", 30, 8, 1.0, **SIZES)
    for run in (fcfs, fair):  # every request ran to its end
        assert run.num_tokens == 30 * 64 + 8 * 8 and len(run.ttft["A"]) == 30 and len(run.ttft["B"]) == 8
    # fcfs: B's requests wait for the whole flood; fair: for a slot
    assert sim.quantile(fair.ttft["B"], 0.9) * 5 < sim.quantile(fcfs.ttft["B"], 0.9)
    assert sim.max_gap_while_backlogged(fair) <= 2 * fair.max_cost
    assert sim.max_gap_while_backlogged(fcfs) > 2 * fcfs.max_cost  # the measure can fail: fcfs breaks the bound
    assert fair.num_tokens / fair.end_s >= 0.95 * fcfs.num_tokens / fcfs.end_s


def test_its_last_line_is_the_contract():
    out = subprocess.run([sys.executable, str(_PATH), "--flood", "20", "--light", "4", "--flood-prompt", "128",
                          "--flood-output", "16", "--max-num-seqs", "8"], capture_output=True, text=True, check=True)
    last = out.stdout.strip().splitlines()[-1].split()
    assert [kv.split("=")[0] for kv in last] == ["ttft_p90_light_alone_s", "ttft_p90_light_fcfs_s",
                                                 "ttft_p90_light_fair_s", "throughput_ratio_fair_vs_fcfs",
                                                 "max_service_gap_over_bound"]
    assert all(float(kv.split("=")[1]) >= 0 for kv in last)
