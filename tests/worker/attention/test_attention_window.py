"""Sliding-window attention (window > 0: the query at position p sees keys p - window < q <= p): the float64
reference against transformers' own sliding mask, and the torch backend against the reference on paged batches
whose blocks wholly before the window are NaN (so reading one shows)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.support.attention import BACKEND, GQA, check, make_batch, windowed_batch
from worker_svc.attention import AttentionMetadata, reference_attention

KINDS = [["decode"] * 5, ["prefill", "chunk"], ["decode", "chunk", "prefill", "decode", "chunk"]]


@pytest.mark.parametrize("window", [1, 5, 16, 40])
def test_reference_window_is_transformers_sliding_mask(window):
    """The reference's window is transformers' (masking_utils.sliding_window_causal_mask_function, what Gemma 3's
    sliding layers attend through): dense eager attention under that mask, prefill and a chunk after a prefix."""
    from transformers.masking_utils import sliding_window_causal_mask_function

    rng = np.random.default_rng(window)
    s, heads, kv_heads, hd, bs = 50, 4, 2, 16, 8
    keys = torch.from_numpy(rng.standard_normal((s, kv_heads, hd)))
    values = torch.from_numpy(rng.standard_normal((s, kv_heads, hd)))
    tables = [list(rng.permutation(7))]
    pool = torch.zeros(2, 7, bs, kv_heads, hd, dtype=torch.float64)
    BACKEND.write_kv(pool, keys, values, AttentionMetadata.build([s], [s], tables, bs).slot_mapping)
    allowed = sliding_window_causal_mask_function(window)
    for q_len in (s, 13):
        query = torch.from_numpy(rng.standard_normal((q_len, heads, hd)))
        meta = AttentionMetadata.build([q_len], [s], tables, bs)
        ours = reference_attention(query, pool, meta, 0.25, window=window)
        qpos, kpos = torch.arange(s - q_len, s)[:, None], torch.arange(s)[None, :]
        mask = allowed(torch.tensor(0), torch.tensor(0), qpos, kpos).expand(q_len, s)
        k = keys.repeat_interleave(heads // kv_heads, 1)  # [s, heads, hd]
        v = values.repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("qhd,khd->hqk", query, k) * 0.25
        probs = scores.masked_fill(~mask, -math.inf).softmax(-1)
        assert torch.allclose(ours, torch.einsum("hqk,khd->qhd", probs, v), atol=1e-12)
        assert mask.sum(-1).max() == min(window, s)  # the window's last `window` keys, the query's own included


def test_a_window_no_shorter_than_the_context_is_no_window():
    rng = np.random.default_rng(3)
    query, pool, meta = make_batch(rng, ["decode", "chunk", "prefill"], 8, 4, 2, 16, torch.float64)
    for window in (meta.max_seq_len, 10_000):
        assert torch.equal(reference_attention(query, pool, meta, 0.25, window=window),
                           reference_attention(query, pool, meta, 0.25))
        assert torch.equal(BACKEND.forward(query, pool, meta, 0.25, window=window), BACKEND.forward(query, pool, meta, 0.25))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("heads", GQA)
@pytest.mark.parametrize("kinds", KINDS)
@pytest.mark.parametrize("block_size,window", [(8, 5), (16, 16), (16, 40), (32, 17)])
def test_torch_backend_windowed_batches_match_reference_and_never_read_before_the_window(
        block_size, window, kinds, heads, dtype):
    rng = np.random.default_rng([block_size, window, len(kinds), *heads])
    query, pool, meta, poisoned = windowed_batch(rng, kinds, block_size, *heads, 32, dtype, window)
    assert poisoned > 0
    check(query, pool, meta, dtype, window=window)


def test_a_negative_window_is_refused():
    rng = np.random.default_rng(0)
    query, pool, meta, _ = windowed_batch(rng, ["decode"], 8, 4, 2, 16, torch.float32, 5)
    with pytest.raises(ValueError, match="window must be 0"):
        BACKEND.forward(query, pool, meta, 0.25, window=-1)
