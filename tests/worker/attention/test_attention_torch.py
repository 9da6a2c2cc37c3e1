"""TorchAttentionBackend against the float64 reference on random paged batches; write_kv; metadata building."""

import numpy as np
import pytest
import torch

from tests.support.attention import BACKEND, GQA, MIXED, check, make_batch, random_batches
from worker_svc.attention import AttentionMetadata


@pytest.mark.parametrize("head_dim", [64, 8])
@pytest.mark.parametrize("heads", GQA)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_mixed_batch_float32(block_size, heads, head_dim):
    rng = np.random.default_rng([block_size, *heads, head_dim])
    kinds = list(rng.permutation(MIXED))  # decodes are not necessarily first
    check(*make_batch(rng, kinds, block_size, *heads, head_dim, torch.float32), torch.float32)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", GQA)
@pytest.mark.parametrize("block_size", [8, 32])
def test_mixed_batch_half(block_size, heads, dtype):
    rng = np.random.default_rng([block_size, *heads, 7])
    check(*make_batch(rng, MIXED, block_size, *heads, 64, dtype), dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("heads", GQA)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_all_decode_batch(block_size, heads, dtype):
    rng = np.random.default_rng([block_size, *heads, 11])
    query, pool, meta = make_batch(rng, ["decode"] * 7, block_size, *heads, 64, dtype, reserve_zero=True)
    assert meta.is_all_decode
    check(query, pool, meta, dtype)


@pytest.mark.parametrize("kinds", [["prefill"] * 3, ["chunk"] * 3, ["prefill", "chunk"]])
def test_prefill_only_batches(kinds):
    rng = np.random.default_rng(len(kinds))
    query, pool, meta = make_batch(rng, kinds, 16, 6, 2, 32, torch.float32)
    assert meta.num_decodes == 0
    check(query, pool, meta, torch.float32)


@random_batches(GQA, [torch.float32, torch.float16, torch.bfloat16])
def test_random_batches_match_reference(seed, kinds, block_size, heads, head_dim, dtype):
    rng = np.random.default_rng(seed)
    check(*make_batch(rng, kinds, block_size, *heads, head_dim, dtype), dtype)


def test_nan_past_seq_len_never_reaches_output():
    # Short contexts with long padded tables: most gathered slots (padding -> block 0, tails of last blocks) are NaN.
    rng = np.random.default_rng(5)
    for kinds in (["decode"] * 4, ["decode", "chunk", "decode"]):
        query, pool, meta = make_batch(rng, kinds, 32, 8, 1, 16, torch.float32, reserve_zero=True)
        assert torch.isnan(pool[:, 0]).all()
        check(query, pool, meta, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_writes_exactly_its_slots(dtype):
    rng = np.random.default_rng(3)
    num_blocks, block_size, kvh, hd = 6, 8, 3, 16
    pool = torch.full((2, num_blocks, block_size, kvh, hd), float("nan"), dtype=dtype)
    slots = torch.from_numpy(rng.permutation(num_blocks * block_size)[:17])
    key = torch.from_numpy(rng.standard_normal((17, kvh, hd))).to(dtype)
    value = torch.from_numpy(rng.standard_normal((17, kvh, hd))).to(dtype)
    BACKEND.write_kv(pool, key, value, slots)
    flat = pool.view(2, num_blocks * block_size, kvh, hd)
    assert torch.equal(flat[0, slots], key) and torch.equal(flat[1, slots], value)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert torch.isnan(flat[:, untouched]).all()
    # Slot s is row s % block_size of block s // block_size.
    s = int(slots[0])
    assert torch.equal(pool[0, s // block_size, s % block_size], key[0])


def test_build_hand_example():
    # block_size 4. seq 0: decode at position 5 (block idx 1 -> id 7); seq 1: chunk at positions 4..6
    # (block idx 1 -> id 0); seq 2: full prefill of 5 tokens over ids 2, 5. Seq 0 has one spare block (9).
    meta = AttentionMetadata.build([1, 3, 5], [6, 7, 5], [[3, 7, 9], [1, 0], [2, 5]], block_size=4)
    assert meta.query_start_loc.dtype == torch.int32 and meta.query_start_loc.tolist() == [0, 1, 4, 9]
    assert meta.seq_lens.dtype == torch.int32 and meta.seq_lens.tolist() == [6, 7, 5]
    assert meta.block_tables.dtype == torch.int32
    assert meta.block_tables.tolist() == [[3, 7, 9], [1, 0, 0], [2, 5, 0]]
    assert meta.slot_mapping.dtype == torch.int64
    assert meta.slot_mapping.tolist() == [29, 0, 1, 2, 8, 9, 10, 11, 20]
    assert (meta.max_query_len, meta.max_seq_len, meta.max_decode_seq_len) == (5, 7, 6)
    assert meta.num_decodes == 1 and meta.decode_seqs.tolist() == [0] and not meta.is_all_decode
    assert (meta.num_seqs, meta.num_tokens) == (3, 9)


def test_build_all_decode_and_validation():
    meta = AttentionMetadata.build(np.array([1, 1]), np.array([3, 9]), [[4], [2, 6, 1]], block_size=4)
    assert meta.is_all_decode and meta.slot_mapping.tolist() == [4 * 4 + 2, 1 * 4 + 0]  # position 8 -> index 2 -> id 1
    assert meta.block_tables.tolist() == [[4, 0, 0], [2, 6, 1]]
    with pytest.raises(ValueError):
        AttentionMetadata.build([1, 1], [1], [[0]], block_size=4)
