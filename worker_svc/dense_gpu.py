"""The batch-invariant float matmul and RMSNorm on a GPU: cuda/dense_gemm.cu through CuPy, for the lean forward with
--batch-invariant on (cuBLAS picks its kernel and split-K by the row count, torch's row reductions their
configuration, so a row's bits there depend on its batch). The arithmetic is the contract at the top of the .cu: one
float32 FMA chain over K per output, a fixed-order sum per norm row.

`launcher`: anything with launch(name, grid, block, args) (attention.cupy_backend.Launcher); default a CupyLauncher
that compiles dense_gemm.cu (needs cupy and a GPU). The CPU tests pass the host-shim build's launcher and CPU tensors,
so this module's argument checks and grid sizing run on every test run."""

from __future__ import annotations

import functools
import importlib.util

import numpy as np
import torch

from worker_svc.attention.cupy_backend import DENSE_GEMM_SOURCE, DTYPE_TAGS, CupyLauncher, Launcher, i32, i64, ptr

TILE_ROWS = 64  # DG_BM of dense_gemm.cu: grid.y = ceil(M / TILE_ROWS)
TILE_COLS = 64  # DG_BN: grid.x = ceil(N / TILE_COLS)
GEMM_THREADS = 256  # DG_THREADS
MAX_GRID_X = 2**31 - 1
MAX_GRID_Y = 65535
MAX_INT32 = 2**31 - 1  # M, N, K and H are int arguments
DENSE_DTYPES = tuple(DTYPE_TAGS)  # the kernels' entries: float32, float16, bfloat16


class CupyDenseKernel:
    """dense_gemm.cu's kernels. norm_threads: the RMSNorm's threads a row (a multiple of 32 in 32..1024); its sum's
    order is this count's, so one kernel object gives every row the same order. device: the GPU the default launcher
    compiles for (default: the current one; without a launcher only)."""

    def __init__(self, launcher: Launcher | None = None, norm_threads: int = 256,
                 device: torch.device | str | None = None) -> None:
        if norm_threads % 32 or not 32 <= norm_threads <= 1024:
            raise ValueError(f"dense kernel: norm_threads {norm_threads} is not a multiple of 32 in 32..1024")
        if launcher is None:  # NOTE: CupyLauncher imports cupy when built, not at import
            gpu = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
            launcher = CupyLauncher(gpu, source=DENSE_GEMM_SOURCE)
        self.launcher = launcher
        self.norm_threads = norm_threads

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """x [M, K] @ weight.T (+ bias): [M, N] of x's dtype. weight [N, K] contiguous, bias [N], all of x's dtype and
        device."""
        tag = _tag("x", x, 2)
        _same("weight", weight, x, 2)
        m, k = x.shape
        n = weight.shape[0]
        if weight.shape[1] != k:
            raise ValueError(f"dense kernel: weight is [N, {weight.shape[1]}], x has {k} features")
        if not weight.is_contiguous():
            raise ValueError("dense kernel: weight is not contiguous (the kernel reads [N, K] rows)")
        if bias is not None:
            _same("bias", bias, x, 1)
            if bias.shape[0] != n:
                raise ValueError(f"dense kernel: bias has {bias.shape[0]} values for {n} outputs")
            bias = bias.contiguous()
        if max(m, n, k) > MAX_INT32 or -(-m // TILE_ROWS) > MAX_GRID_Y or -(-n // TILE_COLS) > MAX_GRID_X:
            raise ValueError(f"dense kernel: x [{m}, {k}] @ weight [{n}, {k}] exceeds the grid ({MAX_GRID_Y * TILE_ROWS}"
                             f" rows) or int32 sizes")
        x = _unit_columns(x)
        out = torch.empty((m, n), dtype=x.dtype, device=x.device)
        if m == 0 or n == 0:
            return out
        grid = (-(-n // TILE_COLS), -(-m // TILE_ROWS), 1)
        args = [ptr(weight), ptr(x), i64(x.stride(0)), ptr(bias), ptr(out), i64(out.stride(0)), i32(m), i32(n), i32(k)]
        self.launcher.launch(f"dense_gemm_{tag}", grid, GEMM_THREADS, args)
        return out

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """transformers' LlamaRMSNorm over x's last dim (x [..., H]; weight [H] of x's dtype and device): x's shape and
        dtype."""
        tag = _tag("x", x, None)
        _same("weight", weight, x, 1)
        h = x.shape[-1]
        if h == 0:
            raise ValueError("dense kernel: x rows are empty (H = 0)")
        if weight.shape[0] != h:
            raise ValueError(f"dense kernel: weight has {weight.shape[0]} values, x rows {h}")
        if not eps >= 0:
            raise ValueError(f"dense kernel: eps {eps} is not >= 0")
        rows = _unit_columns(x.reshape(-1, h))
        m = rows.shape[0]
        if m > MAX_GRID_X or h > MAX_INT32:
            raise ValueError(f"dense kernel: {m} rows of {h} exceed the grid or int32 sizes")
        out = torch.empty((m, h), dtype=x.dtype, device=x.device)
        if m:
            args = [ptr(rows), i64(rows.stride(0)), ptr(weight.contiguous()), ptr(out), i64(out.stride(0)), i32(m),
                    i32(h), np.float32(eps)]
            self.launcher.launch(f"rms_norm_{tag}", (m, 1, 1), self.norm_threads, args)
        return out.view(x.shape)


def shared_dense_kernel(device: torch.device) -> CupyDenseKernel:
    """One CupyDenseKernel a GPU for the process (dense_gemm.cu compiled once); needs cupy."""
    return _kernel_of_gpu(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _kernel_of_gpu(index: int) -> CupyDenseKernel:
    return CupyDenseKernel(device=torch.device("cuda", index))


def gpu_dense_kernel(device: torch.device) -> CupyDenseKernel | None:
    """shared_dense_kernel(device) for a CUDA device where CuPy is installed, else None (the caller's matmuls and
    norms are then not batch invariant: torch's)."""
    if device.type != "cuda" or importlib.util.find_spec("cupy") is None:
        return None
    return shared_dense_kernel(device)


def _tag(name: str, t: torch.Tensor, dims: int | None) -> str:
    """The kernel's dtype tag for `t` (float32, float16 or bfloat16, `dims`-D where given), else a ValueError."""
    tag = DTYPE_TAGS.get(t.dtype)
    if tag is None or (dims is not None and t.dim() != dims) or (dims is None and t.dim() < 1):
        shape = f"[{', '.join(['_'] * dims)}]" if dims else "[..., H]"
        raise ValueError(f"dense kernel: {name} is a float32, float16 or bfloat16 {shape} tensor, not {t.dtype} "
                         f"{list(t.shape)}")
    return tag


def _same(name: str, t: torch.Tensor, x: torch.Tensor, dims: int) -> None:
    """`t` is x's dtype and device, `dims`-D, else a ValueError naming it."""
    if t.dtype != x.dtype or t.dim() != dims:
        raise ValueError(f"dense kernel: {name} is a {dims}-D {x.dtype} tensor (x's dtype), not {t.dtype} "
                         f"{list(t.shape)}")
    if t.device != x.device:
        raise ValueError(f"dense kernel: {name} is on {t.device}, x on {x.device}")


def _unit_columns(x: torch.Tensor) -> torch.Tensor:
    """x [M, K] with contiguous columns (the kernels take a row stride only); a copy where they are not."""
    return x if x.stride(1) == 1 or x.shape[1] <= 1 else x.contiguous()
