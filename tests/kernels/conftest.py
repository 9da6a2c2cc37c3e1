"""Builds cuda/paged_attention.cu, cuda/quant_gemm.cu and cuda/dense_gemm.cu for the host (cuda/host_shim.h) once per
session; nvcc device builds of each too.

HostLauncher runs the kernels by name with the argument list CupyAttentionBackend builds for CuPy, so the CPU
tests exercise the backend's planning code as well as the kernel logic.
"""

from __future__ import annotations

import ctypes
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import pytest

from tests.support.cuda import cuda_home
from worker_svc.attention.cupy_backend import CUDA_DIR, DENSE_GEMM_SOURCE, KERNEL_SOURCE, QUANT_GEMM_SOURCE

ARCHS = ("sm_80", "sm_90")
QUANT_PREFIX = "quant_"  # build keys of quant_gemm.cu's cubins: quant_sm_80, quant_sm_90
DENSE_PREFIX = "dense_"  # build keys of dense_gemm.cu's cubins: dense_sm_80, dense_sm_90


def nvcc_path() -> str | None:
    home = cuda_home()
    if home and (home / "bin" / "nvcc").is_file():
        return str(home / "bin" / "nvcc")
    return shutil.which("nvcc")


def nvcc_command(arch: str, out: Path, source: Path = KERNEL_SOURCE) -> list[str]:
    return [nvcc_path() or "nvcc", "-std=c++17", f"-arch={arch}", "-cubin", "-Xptxas", "-v", f"-I{CUDA_DIR}",
            str(source), "-o", str(out)]  # fmt: skip


class Builds:
    """g++ host library and nvcc cubins, started in parallel at session start."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="paged_kernels_"))
        self.home = cuda_home()
        self.procs: dict[str, subprocess.Popen] = {}
        self.results: dict[str, tuple[int, str]] = {}
        if self.home is None:
            return
        self.lib_path = self.dir / "libpaged_host.so"
        self.procs["host"] = subprocess.Popen(
            ["g++", "-std=c++20", "-O2", "-U_FORTIFY_SOURCE", "-shared", "-fPIC", "-pthread", f"-I{self.home / 'include'}",
             f"-I{CUDA_DIR}", str(CUDA_DIR / "host_driver.cpp"), "-o", str(self.lib_path)],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        )  # fmt: skip
        if nvcc_path():
            for arch in ARCHS:
                for key, source in ((arch, KERNEL_SOURCE), (QUANT_PREFIX + arch, QUANT_GEMM_SOURCE),
                                    (DENSE_PREFIX + arch, DENSE_GEMM_SOURCE)):
                    self.procs[key] = subprocess.Popen(
                        nvcc_command(arch, self.dir / f"{key}.cubin", source),
                        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                    )  # fmt: skip

    def result(self, key: str) -> tuple[int, str]:
        if key not in self.results:
            if key not in self.procs:
                pytest.skip(f"no CUDA toolkit found for the {key} build")
            out, _ = self.procs[key].communicate(timeout=600)
            self.results[key] = (self.procs[key].returncode, out)
        return self.results[key]

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


@pytest.fixture(scope="session")
def builds():
    b = Builds()
    yield b
    b.close()


_CTYPES = {np.uint64: ctypes.c_uint64, np.int64: ctypes.c_int64, np.int32: ctypes.c_int32, np.float32: ctypes.c_float}


class HostLauncher:
    """Launcher for CupyAttentionBackend that runs the host-shim build (CPU tensors, raw pointers)."""

    num_sms = 4

    def __init__(self, lib: ctypes.CDLL) -> None:
        self.lib = lib
        self.launches: list[tuple[str, tuple[int, int, int], int]] = []

    def launch(self, name, grid, block, args) -> None:
        values = [_CTYPES[type(a)](a.item()) for a in args]
        argv = (ctypes.c_void_p * len(values))(*[ctypes.cast(ctypes.pointer(v), ctypes.c_void_p) for v in values])
        cfg = (ctypes.c_uint * 4)(*grid, block)
        fn = getattr(self.lib, f"host_{name}")
        fn.restype = ctypes.c_int
        self.launches.append((name, tuple(grid), block))
        if min(grid) <= 0:
            return
        assert fn(cfg, argv) == 0, f"host launch of {name} failed"


@pytest.fixture(scope="session")
def host_lib(builds) -> ctypes.CDLL:
    rc, out = builds.result("host")
    assert rc == 0, out
    return ctypes.CDLL(str(builds.lib_path))


@pytest.fixture
def launcher(host_lib) -> HostLauncher:
    return HostLauncher(host_lib)
