"""The lean forward's matmuls: each weight laid out once, at load, for the fastest CPU GEMM of its dtype.

Measured on the default model's shapes (`python bench/gemm_layouts.py`, one thread, CPU time; README "Serving
speed"): F.linear hands MKL a transposed [out, in] weight that it repacks on every call, which costs most at the
decode step's 16-64 rows. So on the CPU:
- float32 layer weights are stored transposed, [in, out] contiguous, and run as torch.mm / addmm (1.1-1.6x F.linear
  at 16-64 rows, even at 512); the transformers modules' weights become views of that storage (no second copy).
- bfloat16 weights, and the float32 lm_head (K = hidden is short, N = vocab is long), go through oneDNN with the
  weight reordered once into its blocked layout (`mkldnn._reorder_linear_weight`, then `_linear_pointwise`): 1.8x
  F.linear at 16-64 bfloat16 rows (AMX or AVX512-BF16), 1.3-1.8x for the float32 lm_head. That is a second copy
  of those weights (the modules keep theirs for the transformers path).
Elsewhere (a GPU, a CPU build without oneDNN, a kernel that fails its self-check) F.linear, unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

KINDS = ("linear", "mm", "onednn")


@dataclass(slots=True)
class Linear:
    """y = x @ W.T + b for x [T, in], with W held in the layout `kind` wants."""

    kind: str  # one of KINDS
    weight: torch.Tensor  # linear: [out, in]; mm: [in, out] contiguous; onednn: oneDNN's reordered tensor
    bias: torch.Tensor | None
    out_features: int

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "mm":
            return torch.mm(x, self.weight) if self.bias is None else torch.addmm(self.bias, x, self.weight)
        if self.kind == "onednn":
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def transposed(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] stored as [in, out] contiguous, returned as the [out, in] view of that storage."""
    return weight.t().contiguous().t()


def onednn_available(dtype: torch.dtype) -> bool:
    """Whether oneDNN's prepacked linear runs here and agrees with F.linear (checked once per dtype)."""
    if dtype not in _ONEDNN_OK:
        _ONEDNN_OK[dtype] = _check_onednn(dtype)
    return _ONEDNN_OK[dtype]


_ONEDNN_OK: dict[torch.dtype, bool] = {}


def _check_onednn(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(48, 32, generator=gen).to(dtype)
        b = torch.randn(48, generator=gen).to(dtype)
        x = torch.randn(5, 32, generator=gen).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 5)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    want = F.linear(x.float(), w.float(), b.float())
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    return bool(got.shape == want.shape and torch.allclose(got.float(), want, atol=tol, rtol=tol))


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, *, vocab: bool = False) -> Linear:
    """The fastest layout for `weight` [out, in] on its device; vocab=True for the lm_head (a short K, a long N)."""
    out = int(weight.shape[0])
    weight, bias = weight.detach(), None if bias is None else bias.detach()
    if weight.device.type != "cpu":
        return Linear("linear", weight, bias, out)
    if (weight.dtype == torch.bfloat16 or (vocab and weight.dtype == torch.float32)) and \
            onednn_available(weight.dtype):
        # NOTE: the row count is only a hint for the blocked layout; any row count runs on it.
        return Linear("onednn", torch.ops.mkldnn._reorder_linear_weight(weight, 64), bias, out)
    if weight.dtype == torch.float32 and not vocab:
        # NOTE: a [in, out] contiguous tensor: when `weight` is already the view transposed() made, no copy
        wt = weight.t() if weight.t().is_contiguous() else weight.t().contiguous()
        return Linear("mm", wt, bias, out)
    return Linear("linear", weight, bias, out)
