"""cuda/quant_gemm.cu's arithmetic contract (at its top) computed in numpy: every rounding the kernel makes, in its
order, so that its output is compared bit for bit."""

from __future__ import annotations

import numpy as np

from tests.support.q8a_reference import fma32
from worker_svc.quant.formats import QuantFormat, dequantize

GROUP = 32  # inputs a group: a lane's unit of K
LANES = 32


def lane_partials(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """float32 [M, N, 32]: lane l's chain acc = fma(w[n, k], x[m, k], acc) from +0.0 over its groups g = l, l + 32, ...
    in increasing g, k in order inside a group."""
    m, k = x.shape
    n = w.shape[0]
    groups = k // GROUP
    rounds = -(-groups // LANES)
    xg = np.zeros((m, rounds * LANES, GROUP), np.float32)  # absent groups: x = 0, w = 0 -> fma(0, 0, acc) = acc
    wg = np.zeros((n, rounds * LANES, GROUP), np.float32)
    xg[:, :groups] = x.reshape(m, groups, GROUP)
    wg[:, :groups] = w.reshape(n, groups, GROUP)
    xg, wg = xg.reshape(m, rounds, LANES, GROUP), wg.reshape(n, rounds, LANES, GROUP)
    acc = np.zeros((m, n, LANES), np.float32)
    for r in range(rounds):
        for j in range(GROUP):
            acc = fma32(wg[None, :, r, :, j], xg[:, None, r, :, j], acc)
    return acc


def butterfly(partials: np.ndarray) -> np.ndarray:
    """[..., 32] -> [...]: v[l] += v[l ^ s] for s = 16, 8, 4, 2, 1 (common.cuh's warp_sum); lane 0's value."""
    lanes = np.arange(LANES)
    v = partials.astype(np.float32)
    for s in (16, 8, 4, 2, 1):
        v = (v + v[..., lanes ^ s]).astype(np.float32)
    assert (v == v[..., :1]).all() | np.isnan(v).any()  # every lane holds the same sum
    return v[..., 0]


def quant_gemm(x: np.ndarray, blocks: np.ndarray, fmt: QuantFormat, bias: np.ndarray | None = None) -> np.ndarray:
    """x float32 [M, K] (an activation dtype's values, widened) @ W.T (+ bias, float32) as the kernel computes it before
    its final rounding into the activation dtype: float32 [M, N]."""
    w = dequantize(blocks, fmt)  # float32, the contract's step 1 (formats.py's order)
    y = butterfly(lane_partials(x.astype(np.float32), w))
    return y if bias is None else (y + bias.astype(np.float32)[None, :]).astype(np.float32)
