"""The CPU worker's attention: our C++ kernel (paged_attention_cpu.cpp), built once with g++, called via ctypes."""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import structlog
import torch

from worker_svc.attention.backend import check_shapes
from worker_svc.attention.metadata import AttentionMetadata
from worker_svc.attention.torch_backend import TorchAttentionBackend

log = structlog.get_logger("pagedserve.worker")

SOURCE = Path(__file__).with_name("paged_attention_cpu.cpp")
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC", "-std=c++17")
POOL_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
Q_TILE = 16  # prefill query tokens per work item (x group heads = rows sharing each K/V block read)
# Prefill chunks longer than this go to SDPA (GEMM-shaped work, where ATen's kernel is faster than ours; measured
# 1 thread: q_len 128 about even for a fresh prompt, SDPA 1.7x faster for 128 after a 128-token prefix).
MAX_KERNEL_Q_LEN = 64

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


def _cpu_signature() -> str:
    """What -march=native depends on: a build is reused only on the same kind of CPU."""
    try:
        info = Path("/proc/cpuinfo").read_text()
        lines = [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return platform.machine() + "\n" + "\n".join(lines)


def cache_dir() -> Path:
    return Path(os.environ.get("PAGEDSERVE_CACHE", Path.home() / ".cache" / "pagedserve")) / "kernels"


def build_library(compiler: str = "g++") -> Path:
    """The compiled kernel library, building it on first use (cached by source, flags, compiler and CPU)."""
    cxx = shutil.which(compiler)
    if cxx is None:
        raise RuntimeError(f"{compiler} is not installed")
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([SOURCE.read_text(), *FLAGS, version, _cpu_signature()]).encode())
    out = cache_dir() / f"paged_attention_cpu-{key.hexdigest()[:16]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # NOTE: build beside the target, then rename: workers starting together never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        res = subprocess.run([cxx, *FLAGS, "-o", tmp, str(SOURCE)], capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"building {SOURCE.name} failed:\n{res.stderr[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def load_library() -> ctypes.CDLL:
    lib = ctypes.CDLL(str(build_library()))
    fn = lib.ps_paged_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [_ptr, _i64, _i64, _ptr, ctypes.c_int, _ptr, _ptr, _ptr, _ptr, _i64, _i64, _i64, _i64, _i64,
                   _i64, _i64, ctypes.c_float, _i64, _i64]
    return lib


class CpuAttentionBackend(TorchAttentionBackend):
    """Decodes and prefill chunks of a step in ONE kernel call per layer, reading K/V in place from the pool.

    No gather: each (sequence, kv head, query tile) work item walks its block table and keeps a running max
    and sum per query row (online softmax), so K/V are read once per item and never copied. KV writes and
    copy-on-write copies stay the torch backend's (index_copy_ is already one vectorised op per layer).
    """

    name = "cpu"

    def __init__(self, lib: ctypes.CDLL | None = None) -> None:
        super().__init__()
        self.lib = lib or load_library()
        self._fn = self.lib.ps_paged_attention

    @staticmethod
    def supports(kv_dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
        return kv_dtype in POOL_DTYPES and head_dim <= 256 and block_size <= 256

    def forward(
        self, query: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        num_heads, num_kv_heads, head_dim = check_shapes(query, kv_layer)
        if query.shape[0] != meta.num_tokens:
            raise ValueError(f"query has {query.shape[0]} tokens, metadata {meta.num_tokens}")
        if not kv_layer.is_contiguous() or kv_layer.dtype not in POOL_DTYPES:
            raise ValueError("the CPU kernel needs a contiguous float32 or bfloat16 pool layer")
        q = query if query.dtype == torch.float32 and query.stride(2) == 1 else query.float().contiguous()
        out = torch.empty((q.shape[0], num_heads, head_dim), dtype=torch.float32)
        bt = meta.block_tables
        qsl, lens = np.ascontiguousarray(meta.query_start_loc_host), np.ascontiguousarray(meta.seq_lens_host)
        rc = self._fn(q.data_ptr(), q.stride(0), q.stride(1), kv_layer.data_ptr(), POOL_DTYPES[kv_layer.dtype],
                      out.data_ptr(), qsl.ctypes.data, lens.ctypes.data,
                      bt.data_ptr(), bt.stride(0) if bt.dim() == 2 else 0, meta.num_seqs, num_heads,
                      num_kv_heads, head_dim, kv_layer.shape[1], kv_layer.shape[2], float(scale), Q_TILE,
                      MAX_KERNEL_Q_LEN)
        if rc != 0:
            raise ValueError(f"paged_attention_cpu rejected the shapes (code {rc})")
        if meta.max_query_len > MAX_KERNEL_Q_LEN:
            self._prefills(q, kv_layer, meta, scale, out, min_q_len=MAX_KERNEL_Q_LEN + 1)
        return out if query.dtype == torch.float32 else out.to(query.dtype)
