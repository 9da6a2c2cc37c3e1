"""Same answer whatever else runs (--batch-invariant on, the default): the default model's greedy tokens for eight
prompts are identical alone, beside eight random concurrent requests (half of them sampled), with chunked prefill
and forced preemptions, and after a migration to another worker, in float32, bfloat16 and with an int8 KV cache, on
every CPU path this machine can run (worker_svc/cpu_path.py: each in a process of its own, capped before torch
loads, as `pagedserve worker --cpu-path` does)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.invariance import RESULT
from worker_svc import cpu_path
from worker_svc.cpu_features import cpu_flags

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
# The named paths this CPU runs (native is the best of them); off x86, native alone.
CPU_PATHS = [p for p in cpu_path.supported(cpu_flags()) if p != "native"] or ["native"]
CONFIGS = {"float32": ("float32", "auto"), "bfloat16": ("bfloat16", "auto"), "int8-kv": ("float32", "int8")}


def _run(model_dir: str, path: str, dtype: str, kv_cache_dtype: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")}
    cpu_path.apply(path, env)
    out = subprocess.run([sys.executable, "-m", "tests.support.invariance", "--model-dir", model_dir,
                          "--dtype", dtype, "--kv-cache-dtype", kv_cache_dtype],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=540)
    assert out.returncode == 0, out.stderr[-3000:]
    line = next(ln for ln in out.stdout.splitlines() if ln.startswith(RESULT))
    return json.loads(line.removeprefix(RESULT))


@pytest.mark.parametrize("config", list(CONFIGS))
@pytest.mark.parametrize("path", CPU_PATHS)
def test_greedy_tokens_do_not_depend_on_the_batch(smollm2_dir, path, config):
    got = _run(smollm2_dir, path, *CONFIGS[config])
    assert got["cpu_path"] == path
    assert got["batch_invariant"], got["reason"]
    assert got["preemptions"] > 0  # the crowded case really recomputed some sequences
    alone = got["cases"]["alone"]
    assert all(len(t) == 10 for t in alone), alone
    for case, tokens in got["cases"].items():
        differing = [i for i, (a, b) in enumerate(zip(tokens, alone)) if a != b]
        assert not differing, f"{case}: prompts {differing} differ from alone: {tokens} vs {alone}"
