"""Random paged batches for the kernel tests (host shim and GPU): scattered blocks, NaN everywhere unwritten."""

from __future__ import annotations

import math

import numpy as np
import torch

from worker_svc.attention import AttentionMetadata, reference_attention

TOL = {torch.float32: 1e-5, torch.float16: 1e-2, torch.bfloat16: 1e-2}
GQA = [(4, 4), (6, 2), (8, 1)]  # (num_heads, num_kv_heads): ratios 1, 3, 8


def make_case(rng, backend, kinds, block_size, num_heads, num_kv_heads, head_dim, dtype, device="cpu",
              max_blocks=4, num_layers=2):  # fmt: skip
    """Returns (query, kv_layer, meta, pool) with the context written through backend.write_kv.

    kinds: per sequence "decode" (q_len 1), "chunk" (q_len > 1 after a cached prefix) or "prefill".
    Even-indexed sequences get a context that is a multiple of block_size, odd ones a partial last block.
    The pool is the whole [layers, 2, nb, bs, kvh, hd] tensor, NaN-filled; kv_layer is its LAST layer's view
    (nonzero offset). Block 0 is never used, so the block tables' padding entries point at NaN.
    """
    q_lens, s_lens = [], []
    for i, kind in enumerate(kinds):
        s = int(rng.integers(1, max_blocks + 1)) * block_size - (0 if i % 2 == 0 else int(rng.integers(1, block_size)))
        s = max(s, 3)
        q_lens.append({"decode": 1, "chunk": int(rng.integers(2, s)), "prefill": s}[kind])
        s_lens.append(s)
    needed = [-(-s // block_size) for s in s_lens]
    num_blocks = sum(needed) + 4
    ids = rng.permutation(np.arange(1, num_blocks)).tolist()
    spare, tables, at = ids[sum(needed):], [], 0
    for n in needed:
        tables.append(ids[at:at + n] + spare[: int(rng.integers(2))])  # sometimes a preallocated extra block
        at += n
    pool = torch.full((num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim), float("nan"), dtype=dtype,
                      device=device)  # fmt: skip
    kv_layer = pool[-1]
    full = AttentionMetadata.build(s_lens, s_lens, tables, block_size, device=device)
    k = torch.randn(sum(s_lens), num_kv_heads, head_dim, generator=_gen(rng)).to(dtype).to(device)
    v = torch.randn(sum(s_lens), num_kv_heads, head_dim, generator=_gen(rng)).to(dtype).to(device)
    backend.write_kv(kv_layer, k, v, full.slot_mapping)
    meta = AttentionMetadata.build(q_lens, s_lens, tables, block_size, device=device)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=_gen(rng)).to(dtype).to(device)
    return query, kv_layer, meta, pool


def _gen(rng) -> torch.Generator:
    return torch.Generator().manual_seed(int(rng.integers(2**62)))


def check_forward(backend, query, kv_layer, meta, seed):
    """Poisoned output, forward, compare with the float64 reference; returns the relative error."""
    dtype = query.dtype
    scale = 1.0 / math.sqrt(query.shape[-1])
    out = torch.full_like(query, float("nan"))
    result = backend.forward(query, kv_layer, meta, scale, out=out)
    assert result.data_ptr() == out.data_ptr()
    ref = reference_attention(query, kv_layer, meta, scale)
    out = out.cpu()
    assert torch.isfinite(out).all(), f"seed {seed}: NaN/garbage reached the output"
    rel = (torch.linalg.norm(out.double() - ref) / torch.linalg.norm(ref)).item()
    assert rel < TOL[dtype], f"seed {seed}: relative error {rel}"
    return rel
