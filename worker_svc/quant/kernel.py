"""The quantised-weight matmuls of the CPU kernel library: a GGML-format weight repacked once into 48-column panels,
then out = x @ W.T (+ bias), batch invariant (a row's result depends on that row alone), by one of two kernels:
- float activations (worker_svc/q_gemm.cpp): the weights dequantised in registers, one float32 FMA chain per output:
  the bits of the float32 panel kernel on the dequantised weight;
- int8 activations (worker_svc/q8a_gemm.cpp, --activation-dtype int8): each row quantised to int8 per 32 inputs,
  integer dot products per weight group (VNNI or AVX2), scaled in float32, as llama.cpp's CPU kernels compute."""

from __future__ import annotations

import ctypes

import torch

from worker_svc.cpu_build import load_library

_i64, _ptr, _int = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int


class QuantKernel:
    """The library's ps_q_* functions (int8_activations: its ps_q8a_* ones). A weight is named by its GGML type id
    (worker_svc/quant/formats.py); a weight packed by one kernel is multiplied by that kernel only."""

    def __init__(self, lib: ctypes.CDLL | None = None, int8_activations: bool = False) -> None:
        lib = lib or load_library()
        self.int8_activations = int8_activations
        prefix = "ps_q8a" if int8_activations else "ps_q"
        fn = lambda name: getattr(lib, f"{prefix}_{name}")  # noqa: E731
        self._available, self._size, self._pack = fn("available"), lib.ps_q_packed_size, fn("pack")
        self._available.argtypes, self._available.restype = [], _int
        self._size.argtypes, self._size.restype = [_int, _i64, _i64], _i64
        self._pack.argtypes, self._pack.restype = [_int, _ptr, _i64, _i64, _ptr], _int
        self._linear = {torch.float32: fn("linear_f32"), torch.bfloat16: fn("linear_bf16")}
        for fn in self._linear.values():
            fn.argtypes, fn.restype = [_int, _ptr, _i64, _i64, _ptr, _i64, _ptr, _ptr], _int
        # NOTE: (ggml_type, out_features, in_features, packed bytes) that passed linear's size check: a weight's
        # panels do not change after pack, so its size is checked on its first call, not on every one
        self._sizes_ok: set[tuple[int, int, int, int]] = set()

    def width(self) -> int:
        """512 (float activations: AVX-512; int8: AVX-512 VNNI), 256 (AVX2 + FMA + F16C) or 0: no kernel runs here
        (within the process's CPU path)."""
        return int(self._available())

    def packed_size(self, ggml_type: int, out_features: int, in_features: int) -> int:
        return int(self._size(ggml_type, out_features, in_features))

    def pack(self, ggml_type: int, blocks: torch.Tensor, in_features: int) -> torch.Tensor:
        """blocks: the file's rows of W [N, in_features] (uint8 [N, row bytes], contiguous) -> the panels (uint8)."""
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or not blocks.is_contiguous():
            raise ValueError("quant kernel: the blocks are a contiguous uint8 [out_features, row bytes] tensor")
        size = self.packed_size(ggml_type, blocks.shape[0], in_features)
        if size == 0:
            raise ValueError(f"quant kernel: GGML type {ggml_type} with {in_features} input features is not packed "
                             "here (an unknown type, or not whole blocks)")
        packed = torch.empty(size, dtype=torch.uint8)
        if self._pack(ggml_type, blocks.data_ptr(), blocks.shape[0], in_features, packed.data_ptr()) != 0:
            raise ValueError(f"quant kernel: packing GGML type {ggml_type} failed")
        return packed

    def linear(self, ggml_type: int, x: torch.Tensor, packed: torch.Tensor, out_features: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] (float32 or bfloat16, contiguous) @ W.T (+ bias, x's dtype): [M, out_features] of x's dtype."""
        # NOTE: the lone-stream decode calls this ~120 times a step: checks on plain attributes (is_cpu, not
        # device.type), the packed size checked once per (weight, K) (_sizes_ok)
        fn = self._linear.get(x.dtype)
        if fn is None or x.dim() != 2 or not x.is_contiguous() or not x.is_cpu:
            raise ValueError("quant kernel: x is a contiguous float32 or bfloat16 [M, K] CPU tensor")
        if bias is not None and (bias.dtype != x.dtype or not bias.is_contiguous() or bias.numel() != out_features):
            raise ValueError(f"quant kernel: the bias is a contiguous {x.dtype} tensor of {out_features}")
        m, k = x.shape
        size_key = (ggml_type, out_features, k, packed.numel())
        if size_key not in self._sizes_ok:
            if packed.numel() != self.packed_size(ggml_type, out_features, k):
                raise ValueError(f"quant kernel: x has {k} features, the packed weight {packed.numel()} bytes")
            self._sizes_ok.add(size_key)
        out = torch.empty((m, out_features), dtype=x.dtype)
        rc = fn(ggml_type, x.data_ptr(), m, k, packed.data_ptr(), out_features,
                None if bias is None else bias.data_ptr(), out.data_ptr())
        if rc != 0:
            raise ValueError(f"the quantised matmul refused the call (code {rc}; int8_activations="
                             f"{self.int8_activations})")
        return out


_SHARED: dict[bool, QuantKernel | None] = {}


def shared_kernel(int8_activations: bool = False) -> QuantKernel | None:
    """One QuantKernel (of each kind) for the process where the library loads and that kernel runs on this CPU, else
    None."""
    if int8_activations not in _SHARED:
        try:
            kernel = QuantKernel(int8_activations=int8_activations)
            _SHARED[int8_activations] = kernel if kernel.width() else None
        except (RuntimeError, OSError, AttributeError):
            _SHARED[int8_activations] = None
    return _SHARED[int8_activations]
