"""Helpers for attention backend tests: random paged batches over a NaN-poisoned pool, the comparison with the
float64 reference, and the hypothesis strategy of random batches (tests/worker/attention/)."""

from __future__ import annotations

import math

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from worker_svc.attention import AttentionMetadata, TorchAttentionBackend, reference_attention

BACKEND = TorchAttentionBackend()
TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
GQA = [(4, 4), (6, 2), (8, 1)]  # (num_heads, num_kv_heads): ratios 1, 3, 8
MIXED = ["decode", "chunk", "decode", "prefill", "chunk", "decode"]


def make_batch(rng, kinds, block_size, num_heads, num_kv_heads, head_dim, dtype, reserve_zero=None):
    """A NaN-poisoned pool holding each sequence's context at scattered blocks, plus a packed query.

    kinds: per sequence "decode" (q_len 1), "chunk" (q_len > 1 after a cached prefix) or "prefill" (q_len == seq_len).
    Even-indexed sequences get a context that is a multiple of block_size, odd ones a partial last block.
    """
    q_lens, s_lens = [], []
    for i, kind in enumerate(kinds):
        s = int(rng.integers(1, 5)) * block_size - (0 if i % 2 == 0 else int(rng.integers(1, block_size)))
        s = max(s, 3)
        q = {"decode": 1, "chunk": int(rng.integers(2, s)), "prefill": s}[kind]
        q_lens.append(q)
        s_lens.append(s)
    needed = [-(-s // block_size) for s in s_lens]
    num_blocks = sum(needed) + 4
    if reserve_zero is None:
        reserve_zero = bool(rng.integers(2))
    # Scattered, non-contiguous ids; with block 0 left unused the padding entries (0) point at NaN.
    ids = rng.permutation(np.arange(1 if reserve_zero else 0, num_blocks)).tolist()
    spare, tables, at = ids[sum(needed) :], [], 0
    for n in needed:
        extra = int(rng.integers(2))  # sometimes a preallocated block past the context: must be ignored
        tables.append(ids[at : at + n] + spare[:extra])
        at += n
    pool = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    # Populate every context position (cached prefix and this step's tokens) through write_kv.
    full = AttentionMetadata.build(s_lens, s_lens, tables, block_size)
    k = torch.from_numpy(rng.standard_normal((sum(s_lens), num_kv_heads, head_dim))).to(dtype)
    v = torch.from_numpy(rng.standard_normal((sum(s_lens), num_kv_heads, head_dim))).to(dtype)
    BACKEND.write_kv(pool, k, v, full.slot_mapping)
    meta = AttentionMetadata.build(q_lens, s_lens, tables, block_size)
    query = torch.from_numpy(rng.standard_normal((sum(q_lens), num_heads, head_dim))).to(dtype)
    return query, pool, meta


def check(query, pool, meta, dtype, backend=BACKEND, window=0):
    scale = 1.0 / math.sqrt(query.shape[-1])
    out = backend.forward(query, pool, meta, scale) if window == 0 else \
        backend.forward(query, pool, meta, scale, window=window)
    ref = reference_attention(query, pool, meta, scale, window=window)
    assert out.shape == query.shape and out.dtype == query.dtype
    assert torch.isfinite(out).all(), "garbage past seq_len leaked into the output"
    rel = (torch.linalg.norm(out.double() - ref) / torch.linalg.norm(ref)).item()
    assert rel < TOL[dtype], rel


def windowed_batch(rng, kinds, block_size, num_heads, num_kv_heads, head_dim, dtype, window):
    """make_batch with contexts several windows long, and every block that lies wholly before the first key the
    sequence's queries may see (position seq_len - q_len - window + 1) set to NaN: a backend that reads one leaks
    NaN into its output. Returns (query, pool, meta, poisoned block count)."""
    q_lens, s_lens = [], []
    for kind in kinds:
        s = int(rng.integers(window + 2 * block_size, 4 * window + 4 * block_size))
        # a chunk starts at least a block past the window's length, so its first blocks are unseen too
        q_lens.append({"decode": 1, "chunk": int(rng.integers(2, s - window - block_size)), "prefill": s}[kind])
        s_lens.append(s)
    tables, num_blocks = scattered_tables(rng, s_lens, block_size)
    pool = torch.full((2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype)
    full = AttentionMetadata.build(s_lens, s_lens, tables, block_size)
    k = torch.from_numpy(rng.standard_normal((sum(s_lens), num_kv_heads, head_dim))).to(dtype)
    v = torch.from_numpy(rng.standard_normal((sum(s_lens), num_kv_heads, head_dim))).to(dtype)
    BACKEND.write_kv(pool, k, v, full.slot_mapping)
    poisoned = 0
    for q, s, table in zip(q_lens, s_lens, tables):
        first_block = max(0, s - q - window + 1) // block_size
        pool[:, table[:first_block]] = float("nan")
        poisoned += first_block
    meta = AttentionMetadata.build(q_lens, s_lens, tables, block_size)
    query = torch.from_numpy(rng.standard_normal((sum(q_lens), num_heads, head_dim))).to(dtype)
    return query, pool, meta, poisoned


def random_batches(heads, dtypes):
    """The hypothesis test of random batches: 25 examples of (seed, kinds, block_size, heads, head_dim, dtype),
    heads drawn from `heads` and dtype from `dtypes`."""
    return lambda test: settings(max_examples=25, deadline=None)(given(
        seed=st.integers(0, 2**32 - 1),
        kinds=st.lists(st.sampled_from(["decode", "chunk", "prefill"]), min_size=1, max_size=6),
        block_size=st.sampled_from([8, 16, 32]),
        heads=st.sampled_from(heads),
        head_dim=st.sampled_from([8, 16, 64]),
        dtype=st.sampled_from(dtypes),
    )(test))


def scattered_tables(rng, seq_lens: list[int], block_size: int) -> tuple[list[list[int]], int]:
    """Block tables for sequences of `seq_lens` keys over shuffled block ids 1..n (block 0 never used), and the
    pool's block count n + 1."""
    needed = [-(-s // block_size) for s in seq_lens]
    ids = rng.permutation(np.arange(1, sum(needed) + 1)).tolist()
    tables, at = [], 0
    for n in needed:
        tables.append(ids[at:at + n])
        at += n
    return tables, sum(needed) + 1
