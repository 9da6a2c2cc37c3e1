"""Where the CUDA toolkit is on this machine (the GPU kernel tests build with its nvcc and headers), and what the
kernel tests check of its builds and of the kernels' outputs."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import torch


def cuda_home() -> Path | None:
    """The CUDA toolkit folder (beside nvcc), whose include/ has cuda_fp16.h and cuda_bf16.h."""
    candidates = []
    nvcc = shutil.which("nvcc")
    if nvcc:
        candidates.append(Path(os.path.realpath(nvcc)).parent.parent)
    for env in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(env):
            candidates.append(Path(os.environ[env]))
    candidates += sorted(Path("/usr/local").glob("cuda*"), reverse=True)
    for c in candidates:
        if (c / "include" / "cuda_fp16.h").is_file():
            return c
    return None


def assert_nvcc_entries_without_spills(log: str, entries: set[str]) -> None:
    """nvcc's -Xptxas -v `log` compiled exactly `entries`, none with register spills."""
    compiled = re.findall(r"Compiling entry function '(\w+)' for '(\w+)'", log)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    assert {e for e, _ in compiled} == entries
    assert len(spills) == len(compiled) and all(st == "0" and ld == "0" for st, ld in spills), "register spills"


def bits(t: torch.Tensor) -> torch.Tensor:
    """A float32 / float16 / bfloat16 tensor's bits (int32 / int16 views): torch.equal on them compares bit for bit."""
    return t.view(torch.int32 if t.dtype == torch.float32 else torch.int16)


def skip_without_cupy_gpu() -> None:
    """Skips the calling test or fixture where there is no CUDA device or no CuPy (the GPU kernel tests)."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("cupy")
