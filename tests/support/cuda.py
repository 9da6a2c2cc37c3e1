"""Where the CUDA toolkit is on this machine (the GPU kernel tests build with its nvcc and headers)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path


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
