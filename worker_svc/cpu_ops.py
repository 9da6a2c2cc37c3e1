"""The CPU worker's fused ops (cpu_ops.cpp, in the CPU kernel library): the bfloat16 lean forward's RMSNorm, residual
add + RMSNorm, SiLU-gated product and rotary (one pass each instead of torch's 5-10 bfloat16 kernels), its AMX
small-batch matmul (amx_gemm.cpp), and greedy sampling's row argmax."""

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
        self._amx_init, self._amx_pack, self._amx_linear = lib.ps_amx_init, lib.ps_amx_pack_bf16, lib.ps_amx_linear_bf16
        self._amx_init.argtypes, self._amx_init.restype = [], ctypes.c_int
        self._amx_pack.argtypes, self._amx_pack.restype = [_ptr, _i64, _i64, _ptr], ctypes.c_int
        self._amx_linear.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr]
        self._amx_linear.restype = ctypes.c_int
        self._argmax = lib.ps_argmax_rows
        self._argmax.argtypes = [_ptr, ctypes.c_int, _i64, _i64, _i64, _ptr]
        self._argmax.restype = ctypes.c_int

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

    def amx_available(self) -> bool:
        """Whether this CPU and kernel let this process run the AMX matmul (AMX-BF16, tile state granted)."""
        return bool(self._amx_init())

    def amx_pack(self, weight: torch.Tensor) -> torch.Tensor:
        """weight [N, K] bfloat16 (N % 16 == 0, K % 32 == 0) in the AMX kernel's tile order: a new [N * K] tensor."""
        self._check(weight)
        if weight.dim() != 2 or weight.shape[0] % 16 or weight.shape[1] % 32:
            raise ValueError(f"cpu_ops.amx_pack: [N, K] with N % 16 == 0 and K % 32 == 0, got {tuple(weight.shape)}")
        packed = torch.empty(weight.numel(), dtype=torch.bfloat16)
        self._amx_pack(weight.data_ptr(), weight.shape[0], weight.shape[1], packed.data_ptr())
        return packed

    def amx_linear(self, x: torch.Tensor, packed: torch.Tensor, out_features: int,
                   bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] @ W.T (+ bias) for the W that amx_pack packed: [M, out_features] bfloat16."""
        self._check(x, packed, *(() if bias is None else (bias,)))
        m, k = x.shape
        if packed.numel() != out_features * k:
            raise ValueError(f"cpu_ops.amx_linear: x has {k} features, the packed weight {packed.numel()} elements")
        out = torch.empty((m, out_features), dtype=torch.bfloat16)
        rc = self._amx_linear(x.data_ptr(), m, k, packed.data_ptr(), out_features,
                              None if bias is None else bias.data_ptr(), out.data_ptr())
        if rc != 0:
            raise ValueError(f"ps_amx_linear_bf16 refused the call (code {rc})")
        return out

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's lowest index of its maximum, as torch.argmax(dim=-1) for rows without NaN: float32 or bfloat16
        [B, V] on the CPU with contiguous rows."""
        if logits.dim() != 2 or logits.dtype not in _ARGMAX_DTYPES or logits.device.type != "cpu" or \
                logits.stride(1) != 1:
            raise ValueError("cpu_ops.argmax: [B, V] float32 or bfloat16 CPU rows")
        out = torch.empty(logits.shape[0], dtype=torch.int64)
        rc = self._argmax(logits.data_ptr(), _ARGMAX_DTYPES[logits.dtype], logits.shape[0], logits.shape[1],
                          logits.stride(0), out.data_ptr())
        if rc != 0:
            raise ValueError(f"ps_argmax_rows refused the logits (code {rc})")
        return out


_ARGMAX_DTYPES = {torch.float32: 0, torch.bfloat16: 1}
_SHARED: list[CpuOps | None] = []


def shared_ops() -> CpuOps | None:
    """One CpuOps for the process, or None where the CPU kernel library cannot be built or loaded."""
    if not _SHARED:
        try:
            _SHARED.append(CpuOps())
        except (RuntimeError, OSError, AttributeError):
            _SHARED.append(None)
    return _SHARED[0]
