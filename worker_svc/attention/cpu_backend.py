"""The CPU worker's attention: our C++ kernel (paged_attention_cpu.cpp), built once with g++, called via ctypes."""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np
import structlog
import torch

from worker_svc import cpu_features, cpu_path
from worker_svc.attention.backend import check_shapes
from worker_svc.attention.metadata import AttentionMetadata
from worker_svc.attention.torch_backend import TorchAttentionBackend

log = structlog.get_logger("pagedserve.worker")

SOURCE = Path(__file__).with_name("paged_attention_cpu.cpp")
# Built into the same library: the lean forward's fused elementwise ops (bfloat16 and float32), the bfloat16 AMX
# matmuls and the float32 panel matmuls (worker_svc/cpu_ops.py).
OPS_SOURCE = Path(__file__).parents[1] / "cpu_ops.cpp"
AMX_SOURCE = Path(__file__).parents[1] / "amx_gemm.cpp"
F32_SOURCE = Path(__file__).parents[1] / "f32_gemm.cpp"
F32_OPS_SOURCE = Path(__file__).parents[1] / "f32_ops.cpp"
PATH_SOURCE = Path(__file__).parents[1] / "cpu_path.cpp"


def _sources() -> tuple[Path, ...]:
    # NOTE: read at each build: tests swap SOURCE for a broken copy
    return SOURCE, OPS_SOURCE, AMX_SOURCE, F32_SOURCE, F32_OPS_SOURCE, PATH_SOURCE


def _sources_text() -> str:
    return "\0".join(path.read_text() for path in _sources())
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC", "-std=c++17")
# The kernel's dtype codes (paged_attention_cpu.cpp's Dtype): float pools, and 8-bit caches (codes + scales).
POOL_DTYPES = {torch.float32: 0, torch.bfloat16: 1, torch.int8: 2, torch.float8_e4m3fn: 3, torch.float8_e5m2: 4}
Q_TILE = 16  # prefill query tokens per work item (x group heads = rows sharing each K/V block read)
# Prefill chunks longer than this go to SDPA. Measured (1 thread, CPU time, 9/3 heads, head_dim 64) with the 16-key
# block path: the kernel is 1.3-2x SDPA up to 512-token chunks (fresh or after a 128-token prefix), even for a
# 512-token chunk after 1,536 tokens, and SDPA 1.2x faster for a fresh 2,048-token one; the CPU's default budget is
# 512 tokens a step, so by default every chunk stays here.
MAX_KERNEL_Q_LEN = 512
NO_Q_LEN_LIMIT = 2**62  # a batch-invariant backend's: every chunk in the kernel, whatever its length

# `--int8-qk auto`: whether an int8 cache takes the int8 Q.K path where the kernel has one (VNNI). Decided by
# measurement (README "### Kernels"): bench/kv_attention_long.py for speed against dequantise-then-float, and the
# default model's perplexity on 4096 tokens of the corpus (the bound: within 1% of the float32 cache).
INT8_QK_AUTO = True  # measured faster on 7 of 9 points (geometric mean 0.93x) at +0.14% perplexity

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


def cache_dir() -> Path:
    return Path(os.environ.get("PAGEDSERVE_CACHE", Path.home() / ".cache" / "pagedserve")) / "kernels"


# Portable builds for machines without a compiler (the container image), best first, with the /proc/cpuinfo
# flags each needs. NOTE: the kernel branches on AVX-512 f/bw/vl (x86-64-v4) and AVX2 + FMA + F16C (x86-64-v3);
# its int8 Q.K path needs VNNI, which neither level implies: only a native build on such a CPU has it.
_V2 = ("sse4_1", "sse4_2", "ssse3", "popcnt", "cx16")
_V3 = (*_V2, "avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe")
PORTABLE_TARGETS = {
    "x86-64-v4": (*_V3, "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"),
    "x86-64-v3": _V3,
    "x86-64-v2": _V2,
}


def prebuilt_dir() -> Path:
    return Path(os.environ.get("PAGEDSERVE_KERNEL_DIR", Path(__file__).with_name("prebuilt")))


def _compile(cxx: str, flags: tuple[str, ...], out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    # NOTE: build beside the target, then rename: workers starting together never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        res = subprocess.run([cxx, *flags, "-o", tmp, *map(str, _sources())], capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"building {SOURCE.name} failed:\n{res.stderr[-2000:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _portable_flags(target: str) -> tuple[str, ...]:
    return tuple(f"-march={target}" if f == "-march=native" else f for f in FLAGS)


def _prebuilt_name(target: str) -> str:
    key = hashlib.sha256("\0".join([_sources_text(), *_portable_flags(target)]).encode()).hexdigest()[:16]
    return f"paged_attention_cpu-{target}-{key}.so"


def prebuild(out_dir: Path | None = None, compiler: str = "g++") -> list[Path]:
    """Compiles every portable target into `out_dir` (an image build does this, then drops the compiler)."""
    cxx = shutil.which(compiler)
    if cxx is None:
        raise RuntimeError(f"{compiler} is not installed")
    out_dir = out_dir or prebuilt_dir()
    return [_compile(cxx, _portable_flags(t), out_dir / _prebuilt_name(t)) for t in PORTABLE_TARGETS]


def prebuilt_library(cpu_flags: set[str] | None = None) -> Path | None:
    """The best prebuilt library for this source that this CPU can run, if one was built."""
    if cpu_flags is None:
        cpu_flags = cpu_features.cpu_flags()
    for target, needed in PORTABLE_TARGETS.items():
        path = prebuilt_dir() / _prebuilt_name(target)
        if cpu_flags.issuperset(needed) and path.is_file():
            return path
    return None


def build_library(compiler: str = "g++", path: cpu_path.CpuPath | None = None) -> Path:
    """The compiled kernel library for `path` (default: the process's CPU path): built for this CPU, or the path's
    -march, on first use (cached by source, flags, compiler and CPU); without a compiler, the best prebuilt portable
    build.

    NOTE: each path has a file of its own, even where two share the flags (amx, avx512-bf16 and native): a file is
    loaded once per process, and the cap load_library sets lives in it."""
    path = path or cpu_path.current()
    cxx = shutil.which(compiler)
    if cxx is None:
        prebuilt = prebuilt_library()
        if prebuilt is not None:
            return prebuilt
        raise RuntimeError(f"{compiler} is not installed and no prebuilt kernel fits this CPU in {prebuilt_dir()}")
    flags = FLAGS if path.target == "native" else _portable_flags(path.target)
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([_sources_text(), *flags, version, cpu_features.cpu_signature()]).encode())
    digest = key.hexdigest()[:16]
    out = cache_dir() / (f"paged_attention_cpu-{digest}.so" if path.name == "native" else
                         f"paged_attention_cpu-{path.name}-{digest}.so")
    if out.exists():
        return out
    same_build = cache_dir() / f"paged_attention_cpu-{digest}.so"
    if path.target == "native" and same_build.exists():  # the native build's bits under another name (see NOTE)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        shutil.copyfile(same_build, tmp)
        os.replace(tmp, out)
        return out
    return _compile(cxx, flags, out)


def load_library(path: Path | None = None, cpu: cpu_path.CpuPath | None = None) -> ctypes.CDLL:
    """The kernel library at `path` (default: build_library's for `cpu`, the process's CPU path), with its functions'
    signatures declared and its run-time feature checks capped to `cpu`."""
    cpu = cpu or cpu_path.current()
    lib = ctypes.CDLL(str(path or build_library(path=cpu)))
    lib.ps_set_cpu_path_cap.argtypes, lib.ps_set_cpu_path_cap.restype = [ctypes.c_int], None
    lib.ps_set_cpu_path_cap(cpu.cap)
    fn = lib.ps_paged_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [_ptr, _i64, _i64, _ptr, ctypes.c_int, _ptr, ctypes.c_int, _ptr, _ptr, _ptr, _ptr, _i64, _i64,
                   _i64, _i64, _i64, _i64, _i64, ctypes.c_float, _i64, _i64, ctypes.c_int, ctypes.c_int]
    lib.ps_write_kv.restype = ctypes.c_int
    lib.ps_write_kv.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _ptr, _i64, _ptr, _i64]
    lib.ps_dequantize.restype = ctypes.c_int
    lib.ps_dequantize.argtypes = [_ptr, ctypes.c_int, _ptr, _i64, _i64, _ptr]
    return lib


def int8_qk_width(lib: ctypes.CDLL) -> int:
    """The library's int8 Q.K path: 512 (AVX-512 VNNI), 256 (AVX-VNNI) or 0 (built for a CPU without VNNI)."""
    return int(lib.ps_int8_qk_width())


def simd_width(lib: ctypes.CDLL) -> int:
    """The library's float path: 512 (AVX-512), 256 (AVX2 + FMA) or 0 (scalar)."""
    return int(lib.ps_simd_width())


def bf16_dot(lib: ctypes.CDLL) -> bool:
    """Whether a bfloat16 query over a bfloat16 pool takes the bf16 dot products (AVX512-BF16) in this library."""
    return bool(lib.ps_bf16_dot())


def dequantize(lib: ctypes.CDLL, codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """codes [..., D] (an 8-bit dtype) x scales [...] through the kernel's own widening code, as float32 (tests)."""
    codes, scales = codes.contiguous(), scales.contiguous().float()
    out = torch.empty(codes.shape, dtype=torch.float32)
    rc = lib.ps_dequantize(codes.data_ptr(), POOL_DTYPES[codes.dtype], scales.data_ptr(), scales.numel(),
                           codes.shape[-1], out.data_ptr())
    if rc != 0:
        raise ValueError(f"ps_dequantize rejected {codes.dtype} (code {rc})")
    return out


class CpuAttentionBackend(TorchAttentionBackend):
    """Decodes and prefill chunks of a step in ONE kernel call per layer, reading K/V in place from the pool.

    No gather: each (sequence, kv head, query tile) work item walks its block table and keeps a running max
    and sum per query row (online softmax), so K/V are read once per item and never copied. An 8-bit cache's
    blocks are dequantised (codes x scales) into per-thread scratch as they are read; with int8_qk an int8
    cache's Q.K runs in int8 (VNNI). A float pool's KV writes are one kernel call a layer (ps_write_kv); an 8-bit
    cache's (quantise()) and copy-on-write copies stay the torch backend's.
    """

    name = "cpu"

    def __init__(self, lib: ctypes.CDLL | None = None, int8_qk: bool = False, batch_invariant: bool = True) -> None:
        super().__init__()
        self.lib = lib or load_library()
        # Batch invariant (--batch-invariant on): a query row's bits do not depend on the rows beside it, its
        # chunk's length or whether it is a decode: no AMX tiles for 16-row prefill tiles, and no hand-off of long
        # chunks to SDPA.
        self.batch_invariant = batch_invariant
        self._fn = self.lib.ps_paged_attention
        if int8_qk and int8_qk_width(self.lib) == 0:
            raise ValueError("the int8 Q.K path needs a kernel built for a CPU with AVX-512 VNNI or AVX-VNNI")
        self.int8_qk = int8_qk  # int8 caches only: Q.K in int8 with 32-bit accumulation

    def write_kv(
        self, kv_layer: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
        kv_scales: torch.Tensor | None = None,
    ) -> None:
        two, num_blocks, block_size, kvh, hd = kv_layer.shape
        rows_ok = all(x.dtype == kv_layer.dtype and x.dim() == 3 and x.shape[1:] == (kvh, hd) and x.stride(2) == 1
                      and x.stride(1) == hd for x in (key, value))
        if kv_scales is not None or not rows_ok or not kv_layer.is_contiguous() or key.shape[0] != value.shape[0]:
            return super().write_kv(kv_layer, key, value, slot_mapping, kv_scales)
        slots = slot_mapping.to(dtype=torch.int64).contiguous()
        if slots.shape != (key.shape[0],):
            raise ValueError(f"slot_mapping has shape {tuple(slot_mapping.shape)}, key {key.shape[0]} tokens")
        size = kv_layer.element_size()
        rc = self.lib.ps_write_kv(kv_layer.data_ptr(), num_blocks * block_size, kvh * hd * size, key.data_ptr(),
                                  key.stride(0) * size, value.data_ptr(), value.stride(0) * size, slots.data_ptr(),
                                  slots.shape[0])
        if rc != 0:
            raise IndexError(f"slot_mapping holds a slot outside the pool's {num_blocks * block_size}")

    @staticmethod
    def supports(kv_dtype: torch.dtype, head_dim: int, block_size: int) -> bool:
        return kv_dtype in POOL_DTYPES and head_dim <= 256 and block_size <= 256

    def forward(
        self, query: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float,
        kv_scales: torch.Tensor | None = None,
    ) -> torch.Tensor:
        num_heads, num_kv_heads, head_dim = check_shapes(query, kv_layer, kv_scales)
        if query.shape[0] != meta.num_tokens:
            raise ValueError(f"query has {query.shape[0]} tokens, metadata {meta.num_tokens}")
        if not kv_layer.is_contiguous() or kv_layer.dtype not in POOL_DTYPES:
            raise ValueError("the CPU kernel needs a contiguous float32, bfloat16, int8 or float8 pool layer")
        if kv_scales is not None and not kv_scales.is_contiguous():
            raise ValueError("the CPU kernel needs contiguous kv_scales")
        # A bfloat16 model's query goes in as it is and its output comes back in bfloat16 (no conversions); on a
        # bfloat16 pool the kernel then runs Q.K and P.V as bf16 dot products where the CPU has AVX512-BF16.
        io_bf16 = query.dtype == torch.bfloat16 and query.stride(2) == 1
        q = query if io_bf16 or (query.dtype == torch.float32 and query.stride(2) == 1) else query.float().contiguous()
        out = torch.empty((q.shape[0], num_heads, head_dim), dtype=q.dtype)
        bt = meta.block_tables
        qsl, lens = np.ascontiguousarray(meta.query_start_loc_host), np.ascontiguousarray(meta.seq_lens_host)
        int8_qk = self.int8_qk and kv_layer.dtype == torch.int8
        max_q_len = NO_Q_LEN_LIMIT if self.batch_invariant else MAX_KERNEL_Q_LEN
        rc = self._fn(q.data_ptr(), q.stride(0), q.stride(1), kv_layer.data_ptr(), POOL_DTYPES[kv_layer.dtype],
                      None if kv_scales is None else kv_scales.data_ptr(), int(int8_qk),
                      out.data_ptr(), qsl.ctypes.data, lens.ctypes.data,
                      bt.data_ptr(), bt.stride(0) if bt.dim() == 2 else 0, meta.num_seqs, num_heads,
                      num_kv_heads, head_dim, kv_layer.shape[1], kv_layer.shape[2], float(scale), Q_TILE,
                      max_q_len, int(io_bf16), int(self.batch_invariant))
        if rc != 0:
            raise ValueError(f"paged_attention_cpu rejected the shapes (code {rc})")
        if meta.max_query_len > max_q_len:
            self._prefills(q, kv_layer, meta, scale, out, min_q_len=MAX_KERNEL_Q_LEN + 1, kv_scales=kv_scales)
        return out if out.dtype == query.dtype else out.to(query.dtype)


if __name__ == "__main__":  # python -m worker_svc.attention.cpu_backend --prebuild [DIR]
    import sys

    if sys.argv[1:2] != ["--prebuild"]:
        sys.exit("usage: python -m worker_svc.attention.cpu_backend --prebuild [DIR]")
    for built in prebuild(Path(sys.argv[2]) if len(sys.argv) > 2 else None):
        print(built)
