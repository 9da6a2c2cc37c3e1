"""An 8-bit KV cache's scales travel with its codes in every block operation (copy-on-write, swap out and in, a
prefix hit): bit for bit, and attention over a moved block equals attention over the original exactly. Each check
is also shown to catch a block operation that drops the scales."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pagedserve_common.kv_geometry import QUANTIZED_DTYPES, KVGeometry
from worker_svc.attention import AttentionBackend, AttentionMetadata
from worker_svc.attention.cpu_backend import CpuAttentionBackend
from worker_svc.attention.quant import STORAGE, raw
from worker_svc.kv_pool import KVPool
from worker_svc.worker import make_backend

BLOCK_SIZE, NUM_LAYERS, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM = 8, 2, 4, 2, 16
NUM_BLOCKS, NUM_CPU_BLOCKS = 10, 4
SCALE = 1.0 / math.sqrt(HEAD_DIM)


def cases() -> list:
    """(cache dtype, backend) for every 8-bit cache: the torch backend, and the CPU kernel once it has an instance
    for that cache dtype (until then, skipped)."""
    out = []
    for dtype in QUANTIZED_DTYPES:
        cpu = CpuAttentionBackend.supports(STORAGE[dtype], HEAD_DIM, BLOCK_SIZE)
        out += [pytest.param((dtype, "torch"), id=f"{dtype}-torch"),
                pytest.param((dtype, "cpu"), id=f"{dtype}-cpu",
                             marks=pytest.mark.skipif(not cpu, reason=f"the CPU kernel has no {dtype} path yet"))]
    return out


class Cache:
    """A real KVPool of 8-bit blocks (with swap space) and a backend, every device and CPU slot already written by
    an earlier "stale" sequence (finite codes and scales of another magnitude: what a reused block holds), so a
    scale left behind reads as a plausible but wrong value rather than as garbage."""

    def __init__(self, dtype: str, backend_name: str) -> None:
        geometry = KVGeometry(NUM_LAYERS, NUM_KV_HEADS, HEAD_DIM, dtype, BLOCK_SIZE)
        self.pool = KVPool(geometry, NUM_BLOCKS, num_cpu_blocks=NUM_CPU_BLOCKS)
        self.backend: AttentionBackend = make_backend(backend_name, "cpu", geometry)
        self.rng = np.random.default_rng(list(dtype.encode()))
        self.write(list(range(NUM_BLOCKS)), NUM_BLOCKS * BLOCK_SIZE, magnitude=9.0)
        self.pool.swap_out([(b, b) for b in range(NUM_CPU_BLOCKS)])
        self.write(list(range(NUM_BLOCKS)), NUM_BLOCKS * BLOCK_SIZE, magnitude=5.0)

    def write(self, table: list[int], seq_len: int, start: int = 0, kv=None, magnitude: float = 1.0):
        """Writes positions start .. seq_len - 1 of the sequence at `table`: `kv` (per layer, (key, value)
        [n, kv_heads, head_dim]), else random values; returns what it wrote."""
        shape = (seq_len - start, NUM_KV_HEADS, HEAD_DIM)
        if kv is None:
            kv = [tuple(torch.from_numpy(magnitude * self.rng.standard_normal(shape)).float() for _ in range(2))
                  for _ in range(NUM_LAYERS)]
        slots = AttentionMetadata.build([seq_len - start], [seq_len], [table], BLOCK_SIZE).slot_mapping
        for layer, (key, value) in enumerate(kv):
            codes, scales = self.pool.layer(layer)
            self.backend.write_kv(codes, key, value, slots, scales)
        return kv

    def queries(self, n: int) -> torch.Tensor:
        return torch.from_numpy(self.rng.standard_normal((n, NUM_HEADS, HEAD_DIM))).float()

    def attend(self, query: torch.Tensor, table: list[int], seq_len: int) -> list[torch.Tensor]:
        """Every layer's attention of `query` (the sequence's last len(query) positions) over the pool."""
        meta = AttentionMetadata.build([query.shape[0]], [seq_len], [table], BLOCK_SIZE)
        out = []
        for layer in range(NUM_LAYERS):
            codes, scales = self.pool.layer(layer)
            out.append(self.backend.forward(query, codes, meta, SCALE, scales))
        return out

    def blocks(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Device blocks `ids`: (codes as raw bytes, scales), every layer, K and V; a copy."""
        return raw(self.pool.kv)[:, :, ids].clone(), self.pool.scales[:, :, ids].clone()

    def cpu_blocks(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """CPU swap blocks `ids`, as blocks()."""
        return raw(self.pool.cpu_kv)[:, :, ids].clone(), self.pool.cpu_scales[:, :, ids].clone()


def assert_same_blocks(got: tuple[torch.Tensor, torch.Tensor], want: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Codes and scales equal bit for bit."""
    assert torch.equal(got[0], want[0]), "the codes differ"
    assert torch.equal(got[1].view(torch.int32), want[1].view(torch.int32)), "the scales differ"


def assert_same_attention(got: list[torch.Tensor], want: list[torch.Tensor]) -> None:
    """Exactly equal outputs, every layer (and finite: nothing read past the context)."""
    for layer, (g, w) in enumerate(zip(got, want)):
        assert torch.isfinite(g).all(), f"layer {layer}: not finite"
        assert torch.equal(g, w), f"layer {layer}: attention differs by {float((g - w).abs().max())}"


def assert_all_attention_differs(pairs) -> None:
    """For a mutated block operation: every (got, want) pair fails assert_same_attention."""
    for got, want in pairs:
        with pytest.raises(AssertionError, match="attention differs"):
            assert_same_attention(got, want)


@pytest.fixture(params=cases())
def cache(request) -> Cache:
    return Cache(*request.param)


# -- copy-on-write -----------------------------------------------------------------------------------------------
def copy_on_write(cache: Cache):
    """A 13-token sequence in blocks [2, 5] (5 is its partial last block), forked: block 5 copied to 6, as the
    scheduler plans when the first of two samples writes into their shared partial block. Returns (block 6,
    block 5) and, for a chunk of 4 queries and a decode, (attention over [2, 6], over [2, 5])."""
    cache.write([2, 5], 13)
    cache.pool.copy_blocks([(5, 6)], cache.backend)
    queries = (cache.queries(4), cache.queries(1))
    return (cache.blocks([6]), cache.blocks([5])), [(cache.attend(q, [2, 6], 13), cache.attend(q, [2, 5], 13))
                                                     for q in queries]


def test_copy_on_write_copies_codes_and_scales_and_the_copy_reads_as_the_original(cache):
    blocks, attention = copy_on_write(cache)
    assert_same_blocks(*blocks)
    for got, want in attention:
        assert_same_attention(got, want)


def test_after_copy_on_write_each_sample_writes_only_its_own_block(cache):
    cache.write([2, 5], 13)
    original = cache.blocks([2, 5])
    cache.pool.copy_blocks([(5, 6)], cache.backend)
    cache.write([2, 6], 14, start=13)  # the sample that forked writes its 14th token into the copy
    assert_same_blocks(cache.blocks([2, 5]), original)  # the other sample's blocks: untouched
    cache.write([2, 5], 14, start=13)  # the last holder writes in place
    copy, kept = cache.blocks([6]), cache.blocks([5])
    assert_same_blocks((copy[0][..., :5, :, :], copy[1][..., :5, :]), (kept[0][..., :5, :, :], kept[1][..., :5, :]))
    assert not torch.equal(copy[1][..., 5, :], kept[1][..., 5, :])  # two different 14th tokens
    query = cache.queries(1)
    assert_same_attention(cache.attend(query, [2, 6], 13), cache.attend(query, [2, 5], 13))
    assert_all_attention_differs([(cache.attend(query, [2, 6], 14), cache.attend(query, [2, 5], 14))])


def test_a_copy_on_write_that_drops_the_scales_is_caught(cache, monkeypatch):
    monkeypatch.setattr(KVPool, "copy_blocks", lambda self, copies, backend: backend.copy_blocks(self.kv, copies))
    blocks, attention = copy_on_write(cache)
    with pytest.raises(AssertionError, match="the scales differ"):
        assert_same_blocks(*blocks)
    assert_all_attention_differs(attention)


# -- swap out and in ---------------------------------------------------------------------------------------------
def swap_round_trip(cache: Cache):
    """A 13-token sequence in blocks [2, 5] swapped out to CPU blocks [3, 1], its device blocks then reused by
    another sequence, and swapped back in to other device blocks [7, 0]. Returns the blocks before, in swap space
    and after, and for a chunk of 4 queries and a decode, (attention over [7, 0] after, over [2, 5] before)."""
    cache.write([2, 5], 13)
    before = cache.blocks([2, 5])
    queries = (cache.queries(4), cache.queries(1))
    attention_before = [cache.attend(q, [2, 5], 13) for q in queries]
    cache.pool.swap_out([(2, 3), (5, 1)])
    swapped = cache.cpu_blocks([3, 1])
    cache.write([2, 5], 16, magnitude=3.0)  # the freed device blocks go to another sequence
    cache.pool.swap_in([(3, 7), (1, 0)])
    attention = [(cache.attend(q, [7, 0], 13), want) for q, want in zip(queries, attention_before)]
    return before, swapped, cache.blocks([7, 0]), attention


def test_swap_out_then_in_to_other_blocks_restores_codes_and_scales(cache):
    before, swapped, after, attention = swap_round_trip(cache)
    assert_same_blocks(swapped, before)
    assert_same_blocks(after, before)
    for got, want in attention:
        assert_same_attention(got, want)


@pytest.mark.parametrize("dropped", ["swap_out", "swap_in"])
def test_a_swap_that_drops_the_scales_is_caught(cache, monkeypatch, dropped):
    move = getattr(KVPool, dropped)

    def codes_only(self, pairs):
        saved = self.scales.clone(), self.cpu_scales.clone()
        move(self, pairs)
        self.scales.copy_(saved[0])  # NOTE: undo the scales' move, as if the operation forgot them
        self.cpu_scales.copy_(saved[1])

    monkeypatch.setattr(KVPool, dropped, codes_only)
    before, swapped, after, attention = swap_round_trip(cache)
    if dropped == "swap_out":
        with pytest.raises(AssertionError, match="the scales differ"):
            assert_same_blocks(swapped, before)
    with pytest.raises(AssertionError, match="the scales differ"):
        assert_same_blocks(after, before)
    assert_all_attention_differs(attention)


# -- prefix hits -------------------------------------------------------------------------------------------------
def test_a_prefix_hit_reads_exactly_what_the_first_writer_wrote(cache):
    """Sequence A writes a 16-token prefix into blocks [1, 4] and goes on in block 3; sequence B hits the prefix
    (table [1, 4, 6]) and writes its own 5 tokens into block 6. B reads the prefix exactly as A did, and B's
    attention equals that of a sequence C that wrote the same 21 tokens into fresh blocks [0, 2, 5] itself (no
    hit): per-token scales make a block's bytes final once written, whoever writes after."""
    prefix = cache.write([1, 4, 3], 16)
    query = cache.queries(1)
    a_reads = cache.attend(query, [1, 4, 3], 16)
    written = cache.blocks([1, 4])
    cache.write([1, 4, 3], 20, start=16)  # A goes on after the prefix
    suffix = cache.write([1, 4, 6], 21, start=16)  # B writes after the hit
    assert_same_blocks(cache.blocks([1, 4]), written)
    assert_same_attention(cache.attend(query, [1, 4, 6], 16), a_reads)
    cache.write([0, 2, 5], 16, kv=prefix)
    cache.write([0, 2, 5], 21, start=16, kv=suffix)
    assert_same_blocks(cache.blocks([0, 2]), written)  # the same tokens quantise to the same bytes
    for q in (cache.queries(5), cache.queries(1)):
        assert_same_attention(cache.attend(q, [1, 4, 6], 21), cache.attend(q, [0, 2, 5], 21))
