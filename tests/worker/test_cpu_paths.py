"""The kernel and exactness tests once per lesser CPU path this machine can run (the suite itself runs the best,
native): each path's run is the same test modules in a pytest process of its own, started as `pagedserve worker
--cpu-path` starts a worker (worker_svc/cpu_path.apply: the attention kernel built for the path's -march, the
run-time checks capped, oneDNN and ATen capped before torch loads). So an AVX2-only machine's, an AMD part's
(AVX512-BF16 without AMX) and an AVX-512 machine's without BF16 or VNNI paths are tested here, not first on a
user's machine.

Left out of the per-path runs: the tests that compile their own libraries (broken copies, the portable builds): they
pick their builds by name, so the path changes nothing in them, and each build is half a minute."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from worker_svc import cpu_path
from worker_svc.cpu_features import cpu_flags

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parents[2]
MODULES = ["tests/worker/attention/test_attention_cpu.py", "tests/worker/attention/test_attention_cpu_quant.py",
           "tests/worker/test_cpu_ops.py", "tests/worker/test_f32_gemm.py", "tests/worker/test_amx_gemm.py",
           "tests/worker/test_linear.py", "tests/worker/test_tokens_match_transformers.py",
           "tests/worker/test_smollm2.py"]
OWN_BUILDS = "not broken and not prebuil and not portable and not build and not every_build"
# The paths below the best this CPU has (the suite's own run is that one).
LESSER = cpu_path.supported(cpu_flags())[2:]


@pytest.mark.parametrize("path", LESSER)
def test_kernel_and_exactness_tests_pass_on_the_path(path):
    env = {k: v for k, v in os.environ.items() if k not in ("ONEDNN_MAX_CPU_ISA", "ATEN_CPU_CAPABILITY")}
    cpu_path.apply(path, env)
    out = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", OWN_BUILDS,
                          *MODULES], cwd=ROOT, env=env, capture_output=True, text=True, timeout=1500)
    summary = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    assert out.returncode == 0, f"{path}: {summary}\n{out.stdout[-6000:]}\n{out.stderr[-2000:]}"
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) > 0, summary
