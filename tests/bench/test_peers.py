"""bench/peers from a clone: the canonical trace, our side of the trace comparisons, and sched_scale_vs_vllm.sh's
wiring to the peer (a stand-in for vLLM's venv: building the real one takes minutes and gigabytes)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PEERS = REPO / "bench" / "peers"
MEDIAN = re.compile(r"^median_wall_s=\d+\.\d{4}$")


def _env() -> dict[str, str]:
    path = os.pathsep.join([str(REPO), str(REPO / "protos"), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path}


def _trace(path: Path, *args: str) -> bytes:
    subprocess.run([sys.executable, str(PEERS / "trace.py"), str(path), *args], check=True, timeout=60)
    return path.read_bytes()


def test_the_trace_is_the_same_bytes_for_the_same_arguments(tmp_path):
    first = _trace(tmp_path / "a.jsonl", "--requests", "30", "--decode", "4")
    assert first == _trace(tmp_path / "b.jsonl", "--requests", "30", "--decode", "4")
    assert first != _trace(tmp_path / "c.jsonl", "--requests", "30", "--decode", "4", "--seed", "1")
    lines = first.decode().splitlines()
    assert len(lines) == 30 and all(line.startswith('{"prompt":[') and '"decode":[' in line for line in lines)


def test_our_side_of_the_trace_comparisons_runs_on_the_trace(tmp_path):
    trace = tmp_path / "trace.jsonl"
    _trace(trace, "--requests", "20", "--decode", "8")
    for script, args in (("kv_trace.py", ["--runs", "1"]), ("sched_trace.py", ["--runs", "1", "--max-num-seqs", "8"])):
        out = subprocess.run([sys.executable, str(REPO / "bench" / script), str(trace), *args], capture_output=True,
                             text=True, timeout=120, cwd=REPO, env=_env())
        assert out.returncode == 0, out.stdout + out.stderr
        assert MEDIAN.match(out.stdout.splitlines()[-1]), out.stdout


def test_sched_scale_vs_vllm_runs_the_peer_from_bench_peers(tmp_path):
    # A stand-in venv: its python answers the import check, and prints vllm_sched.py's last two lines after
    # checking that it was handed bench/peers/vllm_sched.py and a trace that exists.
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    fake = venv / "bin" / "python"
    fake.write_text(f"""#!/usr/bin/env bash
[ "$1" = -c ] && exit 0
[ "$1" = "{PEERS / 'vllm_sched.py'}" ] && [ -s "$2" ] || {{ echo "unexpected peer call: $*" >&2; exit 3; }}
echo "vllm-0.33 Scheduler(max_num_seqs=$4) runs=['0.02'] steps=10"
echo "median_wall_s=0.0200"
""")
    fake.chmod(0o755)
    out = subprocess.run(["bash", str(REPO / "bench" / "sched_scale_vs_vllm.sh"), str(venv), "20", "8", "4096", "1"],
                         capture_output=True, text=True, timeout=120, cwd=tmp_path,
                         env={**_env(), "PYTHON": sys.executable})
    assert out.returncode == 0, out.stdout + out.stderr
    assert re.fullmatch(r"sched_vs_vllm 8=\d+\.\d\d", out.stdout.splitlines()[-1]), out.stdout
