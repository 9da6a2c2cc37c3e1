"""NVRTC (what CuPy's RawModule uses on the GPU machines) compiles cuda/paged_attention.cu, cuda/quant_gemm.cu and
cuda/dense_gemm.cu without a device.

Uses libnvrtc through ctypes, found in an nvidia-cuda-nvrtc wheel (site-packages/nvidia/*/lib), the CUDA
toolkit's lib64, or $PAGED_NVRTC_LIB; skipped when none is installed (nvcc's check in test_kernels_host.py
covers the kernels then). Options mirror CupyLauncher's.
"""

from __future__ import annotations

import ctypes
import glob
import os
import site

import pytest

from tests.support.cuda import cuda_home
from worker_svc.attention.cupy_backend import (CUDA_DIR, DENSE_GEMM_SOURCE, KERNEL_SOURCE, QUANT_GEMM_SOURCE,
                                               _cuda_include_options)


def find_nvrtc() -> str | None:
    if os.environ.get("PAGED_NVRTC_LIB"):
        return os.environ["PAGED_NVRTC_LIB"]
    patterns = [f"{sp}/nvidia/*/lib/libnvrtc.so*" for sp in site.getsitepackages()]
    home = cuda_home()
    if home:
        patterns.append(f"{home}/lib64/libnvrtc.so*")
    for pattern in patterns:
        hits = sorted(p for p in glob.glob(pattern) if "builtins" not in p)
        if hits:
            return hits[0]
    return None


@pytest.fixture(scope="module")
def nvrtc():
    path = find_nvrtc()
    if path is None:
        pytest.skip("no libnvrtc (pip install nvidia-cuda-nvrtc, or set PAGED_NVRTC_LIB)")
    return ctypes.CDLL(path)


@pytest.mark.parametrize("source", [KERNEL_SOURCE, QUANT_GEMM_SOURCE, DENSE_GEMM_SOURCE], ids=lambda p: p.name)
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_kernel_nvrtc_compiles(nvrtc, arch, source):
    prog = ctypes.c_void_p()
    src = source.read_bytes()
    assert nvrtc.nvrtcCreateProgram(ctypes.byref(prog), src, source.name.encode(), 0, None, None) == 0
    opts = [f"--gpu-architecture={arch}", "--std=c++17", f"-I{CUDA_DIR}", *_cuda_include_options()]
    argv = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
    rc = nvrtc.nvrtcCompileProgram(prog, len(opts), argv)
    size = ctypes.c_size_t()
    nvrtc.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    nvrtc.nvrtcGetProgramLog(prog, log)
    cubin = ctypes.c_size_t()
    rc_cubin = nvrtc.nvrtcGetCUBINSize(prog, ctypes.byref(cubin)) if rc == 0 else -1
    nvrtc.nvrtcDestroyProgram(ctypes.byref(prog))
    assert rc == 0, log.value.decode(errors="replace")
    assert rc_cubin == 0 and cubin.value > 0
