"""The int8-activation kernel's contract (worker_svc/q8a_gemm.cpp, at its top) computed in numpy: every rounding the
kernel makes, in its order, so that its output is compared bit for bit."""

from __future__ import annotations

import numpy as np

from worker_svc.quant.formats import QuantFormat, decode

ACT_BLOCK = 32  # inputs an activation scale covers


def quantize_activations(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """x float32 [M, K] -> (q int32 [M, K], d float32 [M, K // 32]): d = amax / 127, q = round-half-even(x * (1 / d))
    (0 where d is 0), in float32."""
    m, k = x.shape
    blocks = x.reshape(m, k // ACT_BLOCK, ACT_BLOCK).astype(np.float32)
    d = np.abs(blocks).max(axis=-1) / np.float32(127)
    with np.errstate(divide="ignore"):
        inv = np.where(d != 0, np.float32(1) / d, np.float32(0)).astype(np.float32)
    q = np.clip(np.rint(blocks * inv[..., None]), -127, 127).astype(np.int32)
    return q.reshape(m, k), d.astype(np.float32)


def fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    """float32 a * b + c with one rounding (an FMA), elementwise. The product is exact in float64; the float64 sum's
    error is recovered exactly (TwoSum), and where the sum sits on a float32 tie, the error breaks it."""
    p = a.astype(np.float64) * b.astype(np.float64)
    c64 = c.astype(np.float64)
    s = p + c64
    bp = s - p
    err = (p - (s - bp)) + (c64 - bp)
    r = s.astype(np.float32)
    r64 = r.astype(np.float64)
    other = np.nextafter(r, np.where(s > r64, np.float32(np.inf), np.float32(-np.inf)).astype(np.float32))
    tie = (s != r64) & (s == (r64 + other.astype(np.float64)) / 2) & (err != 0)
    return np.where(tie, np.where(err > 0, np.maximum(r, other), np.minimum(r, other)), r).astype(np.float32)


def q8a_linear(x: np.ndarray, blocks: np.ndarray, fmt: QuantFormat, bias: np.ndarray | None = None) -> np.ndarray:
    """x float32 [M, K] @ W.T (+ bias) as the kernel computes it, W the GGML blocks [N, row_bytes]: float32 [M, N]."""
    w = decode(blocks, fmt)
    m, k = x.shape
    n, g = w.q.shape[0], w.group
    groups = k // g
    qx, dx = quantize_activations(x)
    qa = qx.reshape(m, groups, g).astype(np.int64)
    isum = np.einsum("mgk,ngk->mng", qa, w.q.reshape(n, groups, g).astype(np.int64))  # exact integers
    s = qa.sum(axis=-1)  # [M, groups]
    d = dx[:, np.arange(groups) * g // ACT_BLOCK]  # each group's activation scale, [M, groups]
    minimum = w.add if w.add is not None else None if w.sub is None else np.float32(0) - w.sub  # w = a q + b
    acc = np.zeros((m, n), np.float32)
    for i in range(groups):
        acc = fma32(d[:, i, None] * w.scale[None, :, i], isum[:, :, i].astype(np.float32), acc)
        if minimum is not None:
            acc = fma32(d[:, i, None] * minimum[None, :, i], np.broadcast_to(s[:, i, None], (m, n)).astype(np.float32),
                        acc)
    return acc if bias is None else acc + bias.astype(np.float32)[None, :]
