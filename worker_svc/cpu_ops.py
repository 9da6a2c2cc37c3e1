"""The bfloat16 lean forward's fused elementwise ops (cpu_ops.cpp, in the CPU kernel library): RMSNorm, residual add
+ RMSNorm, SiLU-gated product and rotary, one pass each instead of torch's 5-10 bfloat16 kernels."""

from __future__ import annotations

import ctypes

import torch

from worker_svc.attention.cpu_backend import load_library

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class CpuOps:
    """Each op takes contiguous bfloat16 CPU tensors (rope: rows of heads, any row stride) and returns new ones
    except where it says in place."""

    def __init__(self, lib: ctypes.CDLL | None = None) -> None:
        lib = lib or load_library()
        self._norm, self._add_norm = lib.ps_rms_norm_bf16, lib.ps_add_rms_norm_bf16
        self._silu_mul, self._rope = lib.ps_silu_mul_bf16, lib.ps_rope_bf16
        self._norm.argtypes = [_ptr, _ptr, _f32, _i64, _i64, _ptr]
        self._add_norm.argtypes = [_ptr, _ptr, _ptr, _f32, _i64, _i64, _ptr]
        self._silu_mul.argtypes = [_ptr, _i64, _i64, _ptr]
        self._rope.argtypes = [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64]
        for fn in (self._norm, self._add_norm, self._silu_mul, self._rope):
            fn.restype = None

    @staticmethod
    def _check(*tensors: torch.Tensor) -> None:
        for t in tensors:
            if t.dtype != torch.bfloat16 or t.device.type != "cpu" or not t.is_contiguous():
                raise ValueError("cpu_ops: contiguous bfloat16 CPU tensors only")

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        self._check(x, weight)
        out = torch.empty_like(x)
        self._norm(x.data_ptr(), weight.data_ptr(), eps, x.numel() // x.shape[-1], x.shape[-1], out.data_ptr())
        return out

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x += delta (in place, rounded as torch's bfloat16 add); returns rms_norm(x)."""
        self._check(x, delta, weight)
        out = torch.empty_like(x)
        self._add_norm(x.data_ptr(), delta.data_ptr(), weight.data_ptr(), eps, x.numel() // x.shape[-1],
                       x.shape[-1], out.data_ptr())
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up [T, 2 * inter] = gate | up."""
        self._check(gate_up)
        t, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((t, inter), dtype=gate_up.dtype)
        self._silu_mul(gate_up.data_ptr(), t, inter, out.data_ptr())
        return out

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate-half rotary in place on x [T, heads, hd] (heads contiguous, rows any stride); cos/sin [T, hd]."""
        t, heads, hd = x.shape
        if x.dtype != torch.bfloat16 or x.stride(2) != 1 or x.stride(1) != hd or hd % 2 or hd > 512:
            raise ValueError("cpu_ops.rope_: bfloat16 [T, heads, hd] with contiguous heads, even hd <= 512")
        self._check(cos, sin)
        self._rope(x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), t, heads, hd)
