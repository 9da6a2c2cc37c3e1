"""The CPU worker's attention: our C++ kernel (paged_attention_cpu.cpp and its parts in worker_svc/kernels/attention/),
in the CPU kernel library that worker_svc/cpu_build.py builds, called via ctypes."""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import structlog
import torch

from worker_svc import cpu_build, cpu_path
from worker_svc.attention.backend import check_shapes
from worker_svc.attention.metadata import AttentionMetadata
from worker_svc.attention.torch_backend import TorchAttentionBackend

log = structlog.get_logger("pagedserve.worker")

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
# measurement (docs/kv-cache.md "Kernels"): bench/kv_attention_long.py for speed against dequantise-then-float, and the
# default model's perplexity on 4096 tokens of the corpus (the bound: within 1% of the float32 cache).
INT8_QK_AUTO = True  # measured faster on 7 of 9 points (geometric mean 0.93x) at +0.14% perplexity

_i64, _ptr = ctypes.c_int64, ctypes.c_void_p


def load_library(path: Path | None = None, cpu: cpu_path.CpuPath | None = None) -> ctypes.CDLL:
    """The kernel library at `path` (default: cpu_build's for `cpu`, the process's CPU path), with the attention
    functions' signatures declared and its run-time feature checks capped to `cpu`."""
    lib = cpu_build.load_library(path, cpu)
    fn = lib.ps_paged_attention
    fn.restype = ctypes.c_int
    fn.argtypes = [_ptr, _i64, _i64, _ptr, ctypes.c_int, _ptr, ctypes.c_int, _ptr, _ptr, _ptr, _ptr, _i64, _i64,
                   _i64, _i64, _i64, _i64, _i64, ctypes.c_float, _i64, _i64, ctypes.c_int, ctypes.c_int, _i64]
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
        # NOTE: the step's metadata as the kernel takes it, computed on its first layer and reused by the others
        # (every layer of a step shares one read-only AttentionMetadata): (meta, _StepArgs)
        self._step: tuple[AttentionMetadata, _StepArgs] | None = None

    def step_args(self, meta: AttentionMetadata) -> _StepArgs:
        """`meta` as the kernel takes it (also lean_stack.py's), converted on the step's first call."""
        if self._step is not None and self._step[0] is meta:
            return self._step[1]
        qsl, lens = np.ascontiguousarray(meta.query_start_loc_host), np.ascontiguousarray(meta.seq_lens_host)
        bt = meta.block_tables
        slots = meta.slot_mapping.to(dtype=torch.int64).contiguous()
        args = _StepArgs(qsl, lens, slots, qsl.ctypes.data, lens.ctypes.data, bt.data_ptr(),
                         bt.stride(0) if bt.dim() == 2 else 0, meta.num_seqs, meta.num_tokens, meta.max_query_len)
        self._step = (meta, args)
        return args

    def write_kv(
        self, kv_layer: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
        kv_scales: torch.Tensor | None = None,
    ) -> None:
        two, num_blocks, block_size, kvh, hd = kv_layer.shape
        rows_ok = _rows_ok(key, kv_layer.dtype, kvh, hd) and _rows_ok(value, kv_layer.dtype, kvh, hd)
        if kv_scales is not None or not rows_ok or not kv_layer.is_contiguous() or key.shape[0] != value.shape[0]:
            return super().write_kv(kv_layer, key, value, slot_mapping, kv_scales)
        step = self._step
        if step is not None and step[0].slot_mapping is slot_mapping:  # NOTE: the step's, converted once
            slots = step[1].slots
        else:
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
        kv_scales: torch.Tensor | None = None, window: int = 0,
    ) -> torch.Tensor:
        num_heads, num_kv_heads, head_dim = check_shapes(query, kv_layer, kv_scales)
        if window < 0:
            raise ValueError(f"window must be 0 (none) or positive, got {window}")
        step = self.step_args(meta)
        if query.shape[0] != step.num_tokens:
            raise ValueError(f"query has {query.shape[0]} tokens, metadata {step.num_tokens}")
        if not kv_layer.is_contiguous() or kv_layer.dtype not in POOL_DTYPES:
            raise ValueError("the CPU kernel needs a contiguous float32, bfloat16, int8 or float8 pool layer")
        if kv_scales is not None and not kv_scales.is_contiguous():
            raise ValueError("the CPU kernel needs contiguous kv_scales")
        # A bfloat16 model's query goes in as it is and its output comes back in bfloat16 (no conversions); on a
        # bfloat16 pool the kernel then runs Q.K and P.V as bf16 dot products where the CPU has AVX512-BF16.
        io_bf16 = query.dtype == torch.bfloat16 and query.stride(2) == 1
        q = query if io_bf16 or (query.dtype == torch.float32 and query.stride(2) == 1) else query.float().contiguous()
        out = torch.empty((q.shape[0], num_heads, head_dim), dtype=q.dtype)
        int8_qk = self.int8_qk and kv_layer.dtype == torch.int8
        max_q_len = NO_Q_LEN_LIMIT if self.batch_invariant else MAX_KERNEL_Q_LEN
        rc = self._fn(q.data_ptr(), q.stride(0), q.stride(1), kv_layer.data_ptr(), POOL_DTYPES[kv_layer.dtype],
                      None if kv_scales is None else kv_scales.data_ptr(), int(int8_qk),
                      out.data_ptr(), step.qsl_ptr, step.lens_ptr, step.bt_ptr, step.bt_stride, step.num_seqs,
                      num_heads, num_kv_heads, head_dim, kv_layer.shape[1], kv_layer.shape[2], float(scale), Q_TILE,
                      max_q_len, int(io_bf16), int(self.batch_invariant), int(window))
        if rc != 0:
            raise ValueError(f"paged_attention_cpu rejected the shapes (code {rc})")
        if step.max_query_len > max_q_len:
            self._prefills(q, kv_layer, meta, scale, out, min_q_len=MAX_KERNEL_Q_LEN + 1, kv_scales=kv_scales,
                           window=window)
        return out if out.dtype == query.dtype else out.to(query.dtype)


@dataclass(slots=True)
class _StepArgs:
    """One step's metadata as ps_paged_attention and ps_write_kv take it (the arrays keep the pointers alive)."""

    qsl: np.ndarray  # int64 [B+1], contiguous
    lens: np.ndarray  # int64 [B], contiguous
    slots: torch.Tensor  # int64 [T], contiguous: the step's slot_mapping
    qsl_ptr: int
    lens_ptr: int
    bt_ptr: int
    bt_stride: int
    num_seqs: int
    num_tokens: int
    max_query_len: int


def _rows_ok(x: torch.Tensor, dtype: torch.dtype, kvh: int, hd: int) -> bool:
    """Whether x is [T, kvh, hd] of `dtype` with contiguous heads (any row stride): what ps_write_kv copies."""
    return x.dtype == dtype and x.dim() == 3 and x.shape[1] == kvh and x.shape[2] == hd and x.stride(2) == 1 \
        and x.stride(1) == hd


if __name__ == "__main__":  # python -m worker_svc.attention.cpu_backend --prebuild [DIR] (the image's build step)
    import sys

    cpu_build.main(sys.argv[1:])
