"""Slow, obviously-correct float64 paged attention, the yardstick every backend (CPU or CUDA) is checked against."""

from __future__ import annotations

import numpy as np
import torch

from worker_svc.attention.metadata import AttentionMetadata


def reference_attention(
    query: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float,
    kv_scales: torch.Tensor | None = None, window: int = 0,
) -> torch.Tensor:
    """query [T, H, hd], kv_layer [2, num_blocks, block_size, kvh, hd] -> float64 [T, H, hd] on the CPU.

    window > 0: sliding-window attention, a query at position p sees the keys at positions p - window < q <= p (the
    last `window` positions, its own included: transformers' sliding_window_overlay); 0: all of 0..p.

    An 8-bit pool (kv_scales [2, num_blocks, block_size, kvh]) is read as codes x scales, in float64.
    NOTE: deliberately shares no code with any backend: plain numpy, token by token through the block tables.
    """
    # float64 via torch first: numpy has no bfloat16 or float8.
    q_all = query.detach().to("cpu", torch.float64).numpy()
    pool = kv_layer.detach().to("cpu", torch.float64).numpy()
    if kv_scales is not None:
        pool = pool * kv_scales.detach().to("cpu", torch.float64).numpy()[..., None]
    qsl = meta.query_start_loc.to("cpu").numpy().astype(np.int64)
    seq_lens = meta.seq_lens.to("cpu").numpy().astype(np.int64)
    tables = meta.block_tables.to("cpu").numpy().astype(np.int64)
    block_size, num_kv_heads = pool.shape[2], pool.shape[3]
    num_heads = q_all.shape[1]
    group = num_heads // num_kv_heads
    out = np.zeros(q_all.shape, dtype=np.float64)

    for i in range(len(seq_lens)):
        start, end, s = qsl[i], qsl[i + 1], seq_lens[i]
        q_len = end - start
        keys = np.full((s, num_kv_heads, pool.shape[4]), np.nan)  # NaN: a position read outside its window shows
        values = np.full_like(keys, np.nan)
        first = max(0, s - q_len - window + 1) if window > 0 else 0  # the first key any of the chunk's queries sees
        for p in range(first, s):
            block, offset = tables[i, p // block_size], p % block_size
            keys[p] = pool[0, block, offset]
            values[p] = pool[1, block, offset]
        for j in range(q_len):
            pos = s - q_len + j  # this query token's position; it sees keys lo..pos
            lo = max(0, pos - window + 1) if window > 0 else 0
            for h in range(num_heads):
                kvh = h // group
                scores = keys[lo: pos + 1, kvh] @ q_all[start + j, h] * scale
                weights = np.exp(scores - scores.max())
                weights /= weights.sum()
                out[start + j, h] = weights @ values[lo: pos + 1, kvh]
    return torch.from_numpy(out)
