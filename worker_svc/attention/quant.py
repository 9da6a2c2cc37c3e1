"""The 8-bit KV cache's codes and scales in torch: what every backend's write produces and its read undoes."""

from __future__ import annotations

import torch

from pagedserve_common.kv_geometry import QUANT_MAX

# The pool tensor's dtype for each cache dtype: a layer's dtype says which cache it is.
STORAGE = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "int8": torch.int8,
           "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
CACHE_DTYPE = {v: k for k, v in STORAGE.items()}
QUANTIZED = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2)
SCALE_DTYPE = torch.float32
# NOTE: an all-zero row still gets a positive scale: its codes are 0 and dequantise to exactly 0.
MIN_SCALE = 1e-30


def raw(t: torch.Tensor) -> torch.Tensor:
    """A view index ops accept. NOTE: torch has no CPU index_copy_/index_select for float8: those go as bytes."""
    return t.view(torch.uint8) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else t


def quantize(x: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., head_dim] (any float dtype) -> (codes [..., head_dim] of `dtype` (a QUANTIZED one), scales [...]
    float32).

    One scale per row (one token's kv head): scale = absmax / QUANT_MAX, code = x / scale rounded to the nearest
    representable value (int8: round half to even, clamped to +-127; fp8: round to nearest even, saturating at
    +-QUANT_MAX). Dequantised: x ~= code * scale.
    """
    qmax = QUANT_MAX[CACHE_DTYPE[dtype]]
    xf = x.float()
    scales = (xf.abs().amax(dim=-1) / qmax).clamp_min(MIN_SCALE)
    y = xf / scales.unsqueeze(-1)
    if dtype == torch.int8:
        return torch.round(y).clamp_(-127, 127).to(torch.int8), scales
    return y.clamp_(-qmax, qmax).to(dtype), scales


def dequantize(codes: torch.Tensor, scales: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """codes [..., head_dim], scales [...] -> values [..., head_dim] in out_dtype (the product in float32)."""
    return (codes.float() * scales.unsqueeze(-1)).to(out_dtype)
