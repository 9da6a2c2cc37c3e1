"""bench/sched_scale.py: its --quick run's output, and its fake worker driving every request and block home."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from scheduler_svc.core.request import Request
from pagedserve_common.sampling import SamplingParams
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.scheduler import Scheduler

_BENCH = Path(__file__).resolve().parents[2] / "bench"
LAST_LINE = re.compile(r"sched_scale batch_at_10pct=\d+ us_per_seq=\d+\.\d\d workers_fed_at_256=\d+ "
                       r"median_step_ms=(\d+\.\d+) max_step_ms=(\d+\.\d+)")


BENCH_SCRIPT = "sched_scale"


@pytest.fixture(scope="module")
def ss(bench_script):
    return bench_script


def test_quick_run_writes_table_json_plot_and_last_line(tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, str(_BENCH / "sched_scale.py"), "--quick", "--out", str(out)],
                          capture_output=True, text=True, timeout=300)  # NOTE: a hang guard only
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    last = LAST_LINE.fullmatch(lines[-1])
    assert last, lines[-1]
    median_step_ms, max_step_ms = map(float, last.groups())  # every step, collections included
    assert 0 < median_step_ms <= max_step_ms, lines[-1]
    assert lines[0] == f"sched_scale out={out}"
    assert lines[1].split()[:5] == ["axis", "B", "cached", "bs", "mean_ms"]
    data = json.loads((out / "sched_scale.json").read_text())
    got = [(p["axis"], p["batch_size"], p["num_cached_blocks"], p["block_size"]) for p in data["points"]]
    assert got == [("batch", 1, 0, 16), ("batch", 16, 0, 16), ("batch", 256, 0, 16),
                   ("prefix_cache", 16, 50_000, 16), ("block_size", 16, 0, 32)]
    assert all(p["num_steps"] == 20 and p["mean_ms"] > 0 for p in data["points"])
    assert data["points"][3]["num_evictions"] > 0  # every block was cached: each allocation evicts
    assert data["summary"][-1] == lines[-1]
    assert (out / "sched_scale.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _requests(ss, num: int) -> tuple[list[Request], list[list[int]]]:
    wl = ss.make_workload(num, seed=1, num_prefixes=2, prefix_len=64, suffix=(4, 40), decode=(1, 20))
    reqs = [Request(str(i), p, SamplingParams(max_tokens=m, ignore_eos=True))
            for i, (p, m) in enumerate(zip(wl.prompts, wl.max_tokens))]
    return reqs, wl.prompts


@pytest.mark.parametrize("num_blocks", [24, 2000])  # 24: preemptions and evictions; 2000: neither
def test_drive_to_the_end_every_token_and_block_comes_back(ss, num_blocks):
    s = Scheduler(SchedulerConfig(num_blocks=num_blocks, max_model_len=256, max_num_seqs=8, block_size=16))
    ss.fill_cache(s, 20)
    pool = s.kv.pool
    assert pool.num_cached_free_blocks == 20 and pool.num_free_blocks == num_blocks
    reqs, prompts = _requests(ss, 60)
    for r in reqs:
        s.add_request(r)
    rows = ss.drive(s, reqs, 10_000)
    assert not s.has_unfinished_requests() and s.schedule() is None
    assert len(rows) == s.steps and all(row[5] <= 8 for row in rows)  # num_seqs per step
    for r, prompt in zip(reqs, prompts):
        assert list(r.output_token_ids) == [ss.token(r.seq_id, k) for k in range(r.sampling.max_tokens)]
        assert r.prompt_token_ids is prompt and r.all_token_ids == prompt + r.output_token_ids
    assert pool.num_free_blocks == num_blocks and not any(pool.ref_cnt)
    if num_blocks == 24:
        assert s.num_preemptions > 0 and pool.num_evictions > 0
    else:
        assert s.num_preemptions == 0 and pool.num_evictions == 0
    ss.check_and_drain(s, reqs, num_blocks)  # nothing left to abort: still balances


def test_check_and_drain_aborts_the_rest_and_catches_a_wrong_token(ss):
    s = Scheduler(SchedulerConfig(num_blocks=500, max_model_len=256, max_num_seqs=4, block_size=16))
    reqs, _ = _requests(ss, 30)
    for r in reqs:
        s.add_request(r)
    ss.drive(s, reqs, 5)
    assert s.num_running == 4 and s.num_waiting > 0 and s.kv.pool.num_used_blocks > 0
    ss.check_and_drain(s, reqs, 500)
    assert not s.has_unfinished_requests() and s.kv.pool.num_free_blocks == 500

    s = Scheduler(SchedulerConfig(num_blocks=500, max_model_len=256, max_num_seqs=4, block_size=16))
    reqs, _ = _requests(ss, 30)
    for r in reqs:
        s.add_request(r)
    ss.drive(s, reqs, 5)
    r = next(r for r in reqs if r.output_token_ids)
    r.output_token_ids[0] += 1
    with pytest.raises(AssertionError):
        ss.check_and_drain(s, reqs, 500)
