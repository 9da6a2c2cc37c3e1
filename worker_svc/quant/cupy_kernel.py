"""The quantised-weight matmul on a GPU: cuda/quant_gemm.cu through CuPy, with QuantKernel's API (pack, packed_size,
linear), so that a QuantLinear (worker_svc/quant/linear.py) runs on either.

The weight stays as the GGUF file stores it: `pack` only moves the blocks (uint8 [N, row bytes]) to the device, no
repacking; the kernel dequantises each group of 32 weights in registers and keeps one float32 FMA chain per lane,
then a fixed butterfly (the contract at the top of quant_gemm.cu): batch invariant, though not the CPU kernel's bits
(q_gemm.cpp runs one chain over the whole of K). Activations float32, float16 or bfloat16; the output in x's dtype.

`launcher`: anything with launch(name, grid, block, args) (attention.cupy_backend.Launcher); default a CupyLauncher
that compiles quant_gemm.cu (needs cupy and a GPU). The CPU tests pass the host-shim build's launcher and CPU tensors,
so this module's argument lists and grid sizing run on every test run."""

from __future__ import annotations

import torch

from worker_svc.attention.cupy_backend import QUANT_GEMM_SOURCE, DTYPE_TAGS, Launcher, i32, i64, ptr
from worker_svc.quant.formats import FORMATS_BY_GGML_TYPE

ROWS = 8  # QG_ROWS of quant_gemm.cu: rows a warp carries (grid.y = ceil(M / ROWS))
MAX_GRID_Y = 65535
VECTOR_BYTES = 16  # the device's x loads: every row 16-byte aligned


class CupyQuantKernel:
    """quant_gemm.cu's kernels, by GGML type id (worker_svc/quant/formats.py). warps: output columns a CTA (1..8)."""

    def __init__(self, launcher: Launcher | None = None, warps: int = 4, device: torch.device | str | None = None
                 ) -> None:
        """device: where pack puts the weights (default: the GPU the default launcher compiles for, else where the
        blocks are)."""
        if not 1 <= warps <= 8:
            raise ValueError(f"quant gemm: warps {warps} is not in 1..8 (the kernel's launch bounds: 256 threads)")
        if launcher is None:
            from worker_svc.attention.cupy_backend import CupyLauncher

            device = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
            launcher = CupyLauncher(device, source=QUANT_GEMM_SOURCE)
        self.launcher = launcher
        self.warps = warps
        self.device = None if device is None else torch.device(device)

    def packed_size(self, ggml_type: int, out_features: int, in_features: int) -> int:
        """Bytes of the weight on the device: the file's blocks as they are; 0 for an unknown type or a row that is
        not whole blocks (as QuantKernel.packed_size)."""
        fmt = FORMATS_BY_GGML_TYPE.get(ggml_type)
        if fmt is None or out_features <= 0 or in_features <= 0 or in_features % fmt.block_size:
            return 0
        return out_features * fmt.row_bytes(in_features)

    def pack(self, ggml_type: int, blocks: torch.Tensor, in_features: int) -> torch.Tensor:
        """blocks: the file's rows of W [N, in_features] (uint8 [N, row bytes], contiguous) -> the same bytes on the
        kernel's device (where they are if it has none), contiguous."""
        if blocks.dtype != torch.uint8 or blocks.dim() != 2 or not blocks.is_contiguous():
            raise ValueError("quant gemm: the blocks are a contiguous uint8 [out_features, row bytes] tensor")
        if self.packed_size(ggml_type, blocks.shape[0], in_features) != blocks.numel():
            raise ValueError(f"quant gemm: GGML type {ggml_type} with {in_features} input features does not make "
                             f"{blocks.shape[1]} bytes a row (an unknown type, or not whole blocks)")
        return blocks.to(self.device if self.device is not None else blocks.device).contiguous()

    def linear(self, ggml_type: int, x: torch.Tensor, packed: torch.Tensor, out_features: int,
               bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] (float32, float16 or bfloat16) @ W.T (+ bias, x's dtype): [M, out_features] of x's dtype, on x's
        device (packed's)."""
        tag = DTYPE_TAGS.get(x.dtype)
        if tag is None or x.dim() != 2:
            raise ValueError(f"quant gemm: x is a float32, float16 or bfloat16 [M, K] tensor, not {x.dtype} "
                             f"{list(x.shape)}")
        if x.device != packed.device:
            raise ValueError(f"quant gemm: x is on {x.device}, the weight on {packed.device}")
        if bias is not None and (bias.dtype != x.dtype or bias.numel() != out_features or bias.device != x.device):
            raise ValueError(f"quant gemm: the bias is a {x.dtype} tensor of {out_features} on {x.device}")
        m, k = x.shape
        if packed.numel() != self.packed_size(ggml_type, out_features, k):
            raise ValueError(f"quant gemm: x has {k} features, the weight {packed.numel()} bytes for {out_features} "
                             f"outputs of GGML type {ggml_type}")
        if -(-m // ROWS) > MAX_GRID_Y:
            raise ValueError(f"quant gemm: {m} rows exceed the grid's {MAX_GRID_Y * ROWS}")
        x = _aligned_rows(x)
        bias = None if bias is None else bias.contiguous()
        out = torch.empty((m, out_features), dtype=x.dtype, device=x.device)
        if m == 0:
            return out
        fmt = FORMATS_BY_GGML_TYPE[ggml_type]
        grid = (-(-out_features // self.warps), -(-m // ROWS), 1)
        args = [ptr(packed), ptr(x), i64(x.stride(0)), ptr(bias), ptr(out), i64(out.stride(0)), i32(m),
                i32(out_features), i32(k)]
        self.launcher.launch(f"quant_gemm_{fmt.name}_{tag}", grid, 32 * self.warps, args)
        return out


_SHARED: dict[int, CupyQuantKernel] = {}


def shared_gpu_kernel(device: torch.device) -> CupyQuantKernel:
    """One CupyQuantKernel a GPU for the process (quant_gemm.cu compiled once); needs cupy."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SHARED:
        _SHARED[index] = CupyQuantKernel(device=torch.device("cuda", index))
    return _SHARED[index]


def _aligned_rows(x: torch.Tensor) -> torch.Tensor:
    """x with unit column stride and every row starting on a 16-byte boundary (a copy where it is not so)."""
    row_bytes = x.stride(0) * x.element_size()
    if x.stride(1) == 1 and x.data_ptr() % VECTOR_BYTES == 0 and row_bytes % VECTOR_BYTES == 0:
        return x
    return x.clone(memory_format=torch.contiguous_format)  # a fresh allocation: aligned
