"""cuda/dense_gemm.cu's arithmetic contract (at its top) computed in numpy, every rounding in the kernel's order, so
that its outputs are compared bit for bit; and the float64 error bounds its accuracy tests use."""

from __future__ import annotations

import numpy as np
import torch

from tests.support.q8a_reference import fma32
from tests.support.quant_gemm_reference import butterfly

U32 = 2.0**-24  # float32's unit roundoff
UNIT_ROUNDOFF = {torch.float32: 0.0, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}  # the final rounding to T
F16_HALF_SUBNORMAL = 2.0**-25  # float16's absolute rounding error below its normal range


def gamma(n: int) -> float:
    """n u / (1 - n u): the relative bound of n float32 roundings in a row (Higham's gamma_n)."""
    return n * U32 / (1 - n * U32)


def dense_gemm(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None = None) -> np.ndarray:
    """float32 [M, N] before the rounding into T: acc = fma(x[m, k], w[n, k], acc) from +0.0 over k in order, then
    + bias[n] (one float32 addition)."""
    x, w = x.astype(np.float32), w.astype(np.float32)
    acc = np.zeros((x.shape[0], w.shape[0]), np.float32)
    for k in range(x.shape[1]):
        acc = fma32(x[:, None, k], w[None, :, k], acc)
    return acc if bias is None else (acc + bias.astype(np.float32)[None, :]).astype(np.float32)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, threads: int) -> torch.Tensor:
    """x [M, H] of T -> [M, H] of T: thread t's fma chain over k = t, t + threads, ...; each warp's butterfly; the
    warps added in order; var = sum / H, inv = 1 / sqrt(var + eps), each rounded to float32; then
    round_T(weight * round_T(x * inv)), the products in float32."""
    dtype = x.dtype
    xf = x.float().numpy()
    m, h = xf.shape
    rounds = -(-h // threads)
    padded = np.zeros((m, rounds * threads), np.float32)  # past H: fma(0, 0, s) = s (s is never -0.0 from +0.0)
    padded[:, :h] = xf
    s = np.zeros((m, threads), np.float32)
    for r in range(rounds):
        v = padded[:, r * threads:(r + 1) * threads]
        s = fma32(v, v, s)
    warps = butterfly(s.reshape(m, threads // 32, 32))  # [M, warps]
    total = warps[:, 0]
    for i in range(1, threads // 32):
        total = (total + warps[:, i]).astype(np.float32)
    var = (total / np.float32(h)).astype(np.float32)
    inv = (np.float32(1) / np.sqrt((var + np.float32(eps)).astype(np.float32))).astype(np.float32)
    normed = torch.from_numpy((xf * inv[:, None]).astype(np.float32)).to(dtype).float()
    return (weight.float()[None, :] * normed).to(dtype)


def rms_norm_f64(x: torch.Tensor, weight: torch.Tensor, eps: float) -> np.ndarray:
    """LlamaRMSNorm in float64 on x's and weight's values."""
    xd, wd = x.double().numpy(), weight.double().numpy()
    return wd[None, :] * xd / np.sqrt((xd * xd).mean(-1, keepdims=True) + eps)


def rms_norm_bound(ref: np.ndarray, h: int, dtype: torch.dtype) -> np.ndarray:
    """|kernel - float64| for rms_norm: the mean's sum, division and + eps (gamma_{H+2} relative on var: half of it
    on 1 / sqrt), the square root, the division and x * inv (3 u), and two roundings into T (x * inv, then times the
    weight); first order, with 1 % for the products of the small terms; float16's subnormal floor twice."""
    rel = 0.5 * gamma(h + 2) + 3 * U32 + 2 * UNIT_ROUNDOFF[dtype]
    floor = 2 * F16_HALF_SUBNORMAL * (1 + np.abs(ref)) if dtype == torch.float16 else 0.0
    return 1.01 * rel * np.abs(ref) + floor


def gemm_bound(x: np.ndarray, w: np.ndarray, bias: np.ndarray | None, ref: np.ndarray, dtype: torch.dtype
               ) -> np.ndarray:
    """|kernel - float64| for dense_gemm: gamma_{K+1} (K chained FMAs and the bias's addition) of sum |x w| + |b|,
    then the rounding into T (half an ulp: UNIT_ROUNDOFF of the float32 result; float16's subnormal floor)."""
    k = x.shape[1]
    mass = np.abs(x) @ np.abs(w).T + (0 if bias is None else np.abs(bias)[None, :])
    chain = gamma(k + 1) * mass
    floor = F16_HALF_SUBNORMAL if dtype == torch.float16 else 0.0
    return chain + UNIT_ROUNDOFF[dtype] * (np.abs(ref) + chain) + floor
