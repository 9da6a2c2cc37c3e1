"""bench/peers from a clone: the canonical trace, our side of the trace comparisons, sched_scale_vs_vllm.sh's
wiring to the peer (a stand-in for vLLM's venv: building the real one takes minutes and gigabytes), and
vs_llamacpp.py's pin, last line and set-up (nothing built, nothing downloaded)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PEERS = REPO / "bench" / "peers"
MEDIAN = re.compile(r"^median_wall_s=\d+\.\d{4}$")
BENCH_SCRIPT = "vs_llamacpp"  # conftest's bench_script


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


def test_vs_llamacpp_documents_the_pin_that_setup_llamacpp_builds(bench_script):
    setup = (PEERS / "setup_llamacpp.sh").read_text()
    version = re.search(r"^version=(\S+)$", setup, re.M).group(1)
    sha256 = re.search(r"^sha256=([0-9a-f]{64})$", setup, re.M).group(1)
    assert bench_script.PIN == f"llama-cpp-python=={version}"
    assert bench_script.PIN_SHA256 == sha256
    doc = bench_script.__doc__
    assert bench_script.PIN in doc and sha256 in doc
    assert "GGML_NATIVE=ON" in setup and "set -eu" in setup


def test_vs_llamacpp_last_line_round_trips_and_nothing_else_parses(bench_script):
    line = bench_script.last_line(0.51234, 1.5, 2.25, 1.75, -0.456)
    assert line == ("single_stream_ratio=0.512 concurrent8_ratio=1.500 concurrent64_ratio=2.250 rss_ratio=1.750 "
                    "ppl_delta_pct=-0.46")
    assert bench_script.parse_last_line(line) == {"single_stream_ratio": 0.512, "concurrent8_ratio": 1.5,
                                                  "concurrent64_ratio": 2.25, "rss_ratio": 1.75,
                                                  "ppl_delta_pct": -0.46}
    for other in ("ratio_vs_vllm=1.00", line.replace("rss_ratio", "rss"), line + " extra=1"):
        with pytest.raises(ValueError):
            bench_script.parse_last_line(other)


def test_vs_llamacpp_help_and_its_peer_dir(tmp_path, monkeypatch, bench_script):
    out = subprocess.run([sys.executable, str(REPO / "bench" / "vs_llamacpp.py"), "--help"], capture_output=True,
                         text=True, timeout=120, cwd=tmp_path, env=_env())
    assert out.returncode == 0, out.stderr
    assert "--gguf" in out.stdout and "single_stream_ratio=X concurrent8_ratio=Y" in out.stdout
    monkeypatch.delenv("LLAMACPP_DIR", raising=False)
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    assert bench_script.llamacpp_dir() == tmp_path / "peers" / "llamacpp"  # bench/peers/defaults.sh's default
    monkeypatch.setenv("LLAMACPP_DIR", str(tmp_path / "mine"))
    assert bench_script.llamacpp_dir() == tmp_path / "mine"


def test_setup_llamacpp_leaves_a_build_that_runs_as_it_is(tmp_path):
    # Stand-in binaries that answer --version: the script must return at once, downloading and building nothing.
    (tmp_path / "bin").mkdir()
    for name in ("llama-server", "llama-perplexity"):
        fake = tmp_path / "bin" / name
        fake.write_text('#!/usr/bin/env bash\n[ "$1" = --version ] && echo "version: 1 (stand-in)"\n')
        fake.chmod(0o755)
    out = subprocess.run(["bash", str(PEERS / "setup_llamacpp.sh"), str(tmp_path)], capture_output=True, text=True,
                         timeout=60, env={**os.environ, "PATH": os.environ["PATH"], "PYTHON": "/nonexistent"})
    assert out.returncode == 0, out.stdout + out.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin"]
