"""The CPU worker's fused ops (in the CPU kernel library, worker_svc/cpu_build.py): the lean forward's RMSNorm, residual add + RMSNorm, SiLU-gated
product and rotary (one pass each instead of torch's 3-10 kernels; bfloat16: cpu_ops.cpp, float32: f32_ops.cpp), the
bfloat16 AMX small-batch matmul (amx_gemm.cpp), the float32 panel matmul (f32_gemm.cpp), and greedy sampling's row
argmax."""

from __future__ import annotations

import ctypes

import torch

from worker_svc.cpu_build import load_library

_i64, _ptr, _f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float


class CpuOps:
    """Each fused op takes contiguous CPU tensors of one dtype, bfloat16 or float32 (rope: rows of heads, any row
    stride), and returns new ones except where it says in place."""

    def __init__(self, lib: ctypes.CDLL | None = None) -> None:
        lib = lib or load_library()
        # the fused ops by dtype: the bfloat16 ones (cpu_ops.cpp) and the float32 ones (f32_ops.cpp)
        self._norm, self._add_norm, self._silu_mul, self._rope = {}, {}, {}, {}
        for dtype, suffix in ((torch.bfloat16, "bf16"), (torch.float32, "f32")):
            self._norm[dtype], self._add_norm[dtype] = getattr(lib, f"ps_rms_norm_{suffix}"), \
                getattr(lib, f"ps_add_rms_norm_{suffix}")
            self._silu_mul[dtype], self._rope[dtype] = getattr(lib, f"ps_silu_mul_{suffix}"), \
                getattr(lib, f"ps_rope_{suffix}")
            self._norm[dtype].argtypes = [_ptr, _ptr, _f32, _i64, _i64, _ptr]
            self._add_norm[dtype].argtypes = [_ptr, _ptr, _ptr, _f32, _i64, _i64, _ptr]
            self._silu_mul[dtype].argtypes = [_ptr, _i64, _i64, _ptr]
            self._rope[dtype].argtypes = [_ptr, _i64, _ptr, _ptr, _i64, _i64, _i64]
            for fn in (self._norm[dtype], self._add_norm[dtype], self._silu_mul[dtype], self._rope[dtype]):
                fn.restype = None
        self._amx_init, self._amx_pack, self._amx_linear = lib.ps_amx_init, lib.ps_amx_pack_bf16, lib.ps_amx_linear_bf16
        self._amx_init.argtypes, self._amx_init.restype = [], ctypes.c_int
        self._amx_pack.argtypes, self._amx_pack.restype = [_ptr, _i64, _i64, _ptr], ctypes.c_int
        self._amx_linear.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr]
        self._amx_linear.restype = ctypes.c_int
        self._f32_ok, self._f32_size = lib.ps_f32_panels_available, lib.ps_f32_packed_size
        self._f32_pack, self._f32_linear = lib.ps_f32_pack_panels, lib.ps_f32_linear
        self._f32_ok.argtypes, self._f32_ok.restype = [], ctypes.c_int
        self._f32_size.argtypes, self._f32_size.restype = [_i64, _i64], _i64
        self._f32_pack.argtypes, self._f32_pack.restype = [_ptr, _i64, _i64, _i64, _i64, _ptr], ctypes.c_int
        self._f32_linear.argtypes = [_ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr]
        self._f32_linear.restype = ctypes.c_int
        self._bf16_pack, self._bf16_linear = lib.ps_bf16_pack_panels, lib.ps_bf16_panel_linear
        self._bf16_pack.argtypes, self._bf16_pack.restype = [_ptr, _i64, _i64, _i64, _i64, _ptr], ctypes.c_int
        self._bf16_linear.argtypes, self._bf16_linear.restype = [_ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr], ctypes.c_int
        self._simd_width = lib.ps_simd_width
        self._simd_width.argtypes, self._simd_width.restype = [], ctypes.c_int
        self._argmax = lib.ps_argmax_rows
        self._argmax.argtypes = [_ptr, ctypes.c_int, _i64, _i64, _i64, _ptr]
        self._argmax.restype = ctypes.c_int

    @staticmethod
    def _check(*tensors: torch.Tensor, dtypes=(torch.bfloat16,)) -> None:
        dtype = tensors[0].dtype  # NOTE: is_cpu, not device.type (a new object each call): ~10 checks a layer
        for t in tensors:
            if t.dtype != dtype or dtype not in dtypes or not t.is_cpu or not t.is_contiguous():
                names = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
                raise ValueError(f"cpu_ops: contiguous {names} CPU tensors only, all of one dtype")

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        self._check(x, weight, dtypes=FUSED_DTYPES)
        out = torch.empty_like(x)
        self._norm[x.dtype](x.data_ptr(), weight.data_ptr(), eps, x.numel() // x.shape[-1], x.shape[-1],
                            out.data_ptr())
        return out

    def add_rms_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x += delta (in place, rounded as torch's add in x's dtype); returns rms_norm(x)."""
        self._check(x, delta, weight, dtypes=FUSED_DTYPES)
        out = torch.empty_like(x)
        self._add_norm[x.dtype](x.data_ptr(), delta.data_ptr(), weight.data_ptr(), eps, x.numel() // x.shape[-1],
                                x.shape[-1], out.data_ptr())
        return out

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up [T, 2 * inter] = gate | up."""
        self._check(gate_up, dtypes=FUSED_DTYPES)
        t, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty((t, inter), dtype=gate_up.dtype)
        self._silu_mul[gate_up.dtype](gate_up.data_ptr(), t, inter, out.data_ptr())
        return out

    def rope_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
        """Rotate-half rotary in place on x [T, heads, hd] (heads contiguous, rows any stride); cos/sin [T, hd]."""
        t, heads, hd = x.shape
        if x.dtype not in FUSED_DTYPES or x.stride(2) != 1 or x.stride(1) != hd or hd % 2 or hd > 512:
            raise ValueError("cpu_ops.rope_: bfloat16 or float32 [T, heads, hd] with contiguous heads, even hd <= 512")
        self._check(cos, sin, dtypes=(x.dtype,))
        self._rope[x.dtype](x.data_ptr(), x.stride(0), cos.data_ptr(), sin.data_ptr(), t, heads, hd)

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

    def simd_width(self) -> int:
        """The build's widest vector path: 512 (AVX-512), 256 (AVX2 + FMA) or 0 (scalar)."""
        return int(self._simd_width())

    def vector_f32(self) -> bool:
        """Whether this build's float32 fused ops are vectorised (AVX2 or AVX-512; a portable x86-64-v2 build's are
        scalar)."""
        return self._simd_width() >= 256

    def f32_panels_available(self) -> bool:
        """Whether this CPU runs the panel matmuls (AVX-512, or AVX2 + FMA) within the process's CPU path."""
        return bool(self._f32_ok())

    def panel_width(self) -> int:
        """The panel kernel that runs here: 512 (AVX-512), 256 (AVX2 + FMA) or 0 (none). Both give the same bits."""
        return int(self._f32_ok())

    def panel_size(self, out_features: int, in_features: int) -> int:
        """The elements f32_pack / bf16_pack make of a [out_features, in_features] weight."""
        return int(self._f32_size(out_features, in_features))

    def f32_pack(self, weight: torch.Tensor) -> torch.Tensor:
        """weight [N, K] float32 (any strides) in the panel kernel's order: a new 1-D tensor (N rounded up to 48
        columns)."""
        return self._pack(weight, torch.float32, self._f32_pack)

    def bf16_pack(self, weight: torch.Tensor) -> torch.Tensor:
        """f32_pack for a bfloat16 weight."""
        return self._pack(weight, torch.bfloat16, self._bf16_pack)

    def _pack(self, weight: torch.Tensor, dtype: torch.dtype, fn) -> torch.Tensor:
        if weight.dtype != dtype or weight.device.type != "cpu" or weight.dim() != 2:
            raise ValueError(f"cpu_ops: the panels take a [N, K] {str(dtype).removeprefix('torch.')} CPU tensor")
        # NOTE: 64-byte aligned (the kernel's loads): torch's CPU allocator aligns to 64 bytes
        packed = torch.empty(self._f32_size(weight.shape[0], weight.shape[1]), dtype=dtype)
        rc = fn(weight.data_ptr(), weight.shape[0], weight.shape[1], weight.stride(0), weight.stride(1),
                packed.data_ptr())
        if rc != 0:
            raise ValueError(f"the panel packing refused the weight (code {rc})")
        return packed

    def f32_linear(self, x: torch.Tensor, packed: torch.Tensor, out_features: int,
                   bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] @ W.T (+ bias) for the W that f32_pack packed: [M, out_features] float32."""
        if x.dtype != torch.float32:
            raise ValueError("cpu_ops.f32_linear: float32 tensors only (panel_linear takes bfloat16 too)")
        return self.panel_linear(x, packed, out_features, bias)

    def panel_linear(self, x: torch.Tensor, packed: torch.Tensor, out_features: int,
                     bias: torch.Tensor | None) -> torch.Tensor:
        """x [M, K] @ W.T (+ bias) for the W that f32_pack or bf16_pack packed: [M, out_features] of x's dtype,
        float32 sums (one FMA chain an output: the same bits at any M)."""
        self._check(x, packed, *(() if bias is None else (bias,)), dtypes=(torch.float32, torch.bfloat16))
        m, k = x.shape
        if packed.numel() != self._f32_size(out_features, k):
            raise ValueError(f"cpu_ops.panel_linear: x has {k} features, the packed weight {packed.numel()} elements")
        out = torch.empty((m, out_features), dtype=x.dtype)
        fn = self._f32_linear if x.dtype == torch.float32 else self._bf16_linear
        rc = fn(x.data_ptr(), m, k, packed.data_ptr(), out_features, None if bias is None else bias.data_ptr(),
                out.data_ptr())
        if rc != 0:
            raise ValueError(f"the panel matmul refused the call (code {rc})")
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
FUSED_DTYPES = (torch.bfloat16, torch.float32)
_SHARED: list[CpuOps | None] = []


def shared_ops() -> CpuOps | None:
    """One CpuOps for the process, or None where the CPU kernel library cannot be built or loaded."""
    if not _SHARED:
        try:
            _SHARED.append(CpuOps())
        except (RuntimeError, OSError, AttributeError):
            _SHARED.append(None)
    return _SHARED[0]
