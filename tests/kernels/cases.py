"""Random paged batches for the kernel tests (host shim and GPU): scattered blocks, NaN everywhere unwritten."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from worker_svc.attention import AttentionMetadata, reference_attention
from worker_svc.attention.quant import quantize, raw

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
    q_lens, s_lens, tables, num_blocks = _layout(rng, kinds, block_size, max_blocks)
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


# Poison for an 8-bit pool's unwritten slots: NaN codes for fp8 (int8 has none: -128, which no write produces),
# NaN scales for every cache type.
POISON_CODE = {torch.int8: -128, torch.float8_e4m3fn: 0x7F, torch.float8_e5m2: 0x7F}


@dataclass(slots=True)
class QuantCase:
    query: torch.Tensor
    kv_layer: torch.Tensor  # the last layer's codes [2, nb, bs, kvh, hd]
    kv_scales: torch.Tensor  # its scales [2, nb, bs, kvh]
    meta: AttentionMetadata
    pool: torch.Tensor  # [layers, 2, nb, bs, kvh, hd] codes
    scales: torch.Tensor  # [layers, 2, nb, bs, kvh] float32


def make_quant_case(rng, backend, kinds, block_size, num_heads, num_kv_heads, head_dim, dtype, cache_dtype,
                    device="cpu", max_blocks=4, num_layers=2, kv_scale=1.0) -> QuantCase:  # fmt: skip
    """make_case for an 8-bit cache (cache_dtype: torch.int8 / float8_e4m3fn / float8_e5m2): K/V in `dtype`
    (kv_scale times N(0, 1)) written through backend.write_kv with the layer's scales; every unwritten slot holds
    a poison code and a NaN scale. Checks that the write stored exactly quant.quantize's codes and scales."""
    q_lens, s_lens, tables, num_blocks = _layout(rng, kinds, block_size, max_blocks)
    shape = (num_layers, 2, num_blocks, block_size, num_kv_heads)
    pool = torch.full((*shape, head_dim), POISON_CODE[cache_dtype], dtype=torch.int16).to(torch.uint8)
    pool = pool.view(cache_dtype).to(device)
    scales = torch.full(shape, float("nan"), dtype=torch.float32, device=device)
    full = AttentionMetadata.build(s_lens, s_lens, tables, block_size, device=device)
    k = (kv_scale * torch.randn(sum(s_lens), num_kv_heads, head_dim, generator=_gen(rng))).to(dtype).to(device)
    v = (kv_scale * torch.randn(sum(s_lens), num_kv_heads, head_dim, generator=_gen(rng))).to(dtype).to(device)
    backend.write_kv(pool[-1], k, v, full.slot_mapping, kv_scales=scales[-1])
    assert_written_as_quantize(pool[-1], scales[-1], k, v, full.slot_mapping)
    meta = AttentionMetadata.build(q_lens, s_lens, tables, block_size, device=device)
    query = torch.randn(sum(q_lens), num_heads, head_dim, generator=_gen(rng)).to(dtype).to(device)
    return QuantCase(query, pool[-1], scales[-1], meta, pool, scales)


def assert_written_as_quantize(kv_layer, kv_scales, key, value, slot_mapping) -> None:
    """The slots' codes and scales are bit-identical to worker_svc/attention/quant.py::quantize of key/value."""
    two, nb, bs, kvh, hd = kv_layer.shape
    codes = raw(kv_layer).reshape(2, nb * bs, kvh, hd).cpu()
    flat_scales = kv_scales.reshape(2, nb * bs, kvh).cpu()
    slots = slot_mapping.cpu()
    for which, x in enumerate((key, value)):
        want_codes, want_scales = quantize(x.cpu(), kv_layer.dtype)
        assert torch.equal(codes[which, slots], raw(want_codes)), "codes differ from quant.quantize"
        assert torch.equal(flat_scales[which, slots], want_scales), "scales differ from quant.quantize"


def _layout(rng, kinds, block_size, max_blocks):
    """(q_lens, seq_lens, block tables, num_blocks) of a random batch; see make_case."""
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
    return q_lens, s_lens, tables, num_blocks


def _gen(rng) -> torch.Generator:
    return torch.Generator().manual_seed(int(rng.integers(2**62)))


def check_forward(backend, query, kv_layer, meta, seed, kv_scales=None):
    """Poisoned output, forward, compare with the float64 reference; returns the relative error.

    An 8-bit cache (kv_scales given) is held to the same bound as a float one: the reference reads the very
    codes x scales the kernel reads, so only the kernel's float32 arithmetic (and its output dtype) differ.
    """
    dtype = query.dtype
    scale = 1.0 / math.sqrt(query.shape[-1])
    out = torch.full_like(query, float("nan"))
    result = backend.forward(query, kv_layer, meta, scale, kv_scales=kv_scales, out=out)
    assert result.data_ptr() == out.data_ptr()
    ref = reference_attention(query, kv_layer, meta, scale, kv_scales=kv_scales)
    out = out.cpu()
    assert torch.isfinite(out).all(), f"seed {seed}: NaN/garbage reached the output"
    rel = (torch.linalg.norm(out.double() - ref) / torch.linalg.norm(ref)).item()
    assert rel < TOL[dtype], f"seed {seed}: relative error {rel}"
    return rel
