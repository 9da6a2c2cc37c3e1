"""Spec tests for KV groups (pagedserve_common.kv_geometry.KVGroups) in the KV manager: logical block i owns the table
entries i * num_groups + g, and a sliding group's blocks that no future query can see are freed (exact ids, ref
counts, eviction order), prefix hits need every group's block but the sliding ones out of the window of the hit's
end, and how many blocks a 4096-token sequence of Gemma 3 270M's shape holds."""

import pytest

from pagedserve_common.kv_geometry import KVGeometry
from scheduler_svc.kv.manager import KVCacheManager

BS = 8
# 2 groups: group 0 full attention, group 1 a sliding window of 16 tokens (2 blocks of 8)
TWO = (0, 16)


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def refs(mgr: KVCacheManager, n: int) -> list[int]:
    return list(mgr.pool.ref_cnt)[:n]


def test_one_logical_block_takes_one_block_per_group_and_the_table_interleaves_them():
    mgr = KVCacheManager(num_blocks=16, block_size=BS, group_windows=TWO)
    alloc = mgr.allocate("a", 20, toks(0, 20), num_computed=0)
    assert list(alloc.new_block_ids) == [0, 1, 2, 3, 4, 5]  # logical 0: [0, 1], 1: [2, 3], 2: [4, 5]
    assert mgr.block_table("a") == mgr.held_block_ids("a") == [0, 1, 2, 3, 4, 5]
    assert refs(mgr, 7) == [1, 1, 1, 1, 1, 1, 0]
    assert sorted(b for _, b in mgr.pool.cached_items()) == [0, 1, 2, 3]  # both groups' full blocks


def test_a_sliding_groups_block_is_freed_once_no_query_can_see_it_and_is_evicted_first():
    mgr = KVCacheManager(num_blocks=16, block_size=BS, group_windows=TWO)
    mgr.allocate("a", 24, toks(0, 24), num_computed=0)
    # the query at 24 sees keys 9..24: block 1 (group 1's copy of tokens 0..7) is out of its window
    alloc = mgr.allocate("a", 25, toks(0, 25), num_computed=24)
    assert list(alloc.new_block_ids) == [6, 7]
    assert mgr.block_table("a") == [0, 1, 2, 3, 4, 5, 6, 7]  # the stale entry stays: the worker's table is append-only
    assert mgr.held_block_ids("a") == [0, 2, 3, 4, 5, 6, 7]
    assert refs(mgr, 8) == [1, 0, 1, 1, 1, 1, 1, 1]
    assert mgr.pool.eviction_order() == [1]  # cached, so free but findable until evicted
    mgr.allocate("a", 31, toks(0, 31), num_computed=30)  # the query at 30 sees 15..30: block 3 still (tokens 8..15)
    assert mgr.pool.eviction_order() == [1]
    mgr.allocate("a", 32, toks(0, 32), num_computed=31)  # the query at 31 sees 16..31: block 3 goes
    assert mgr.pool.eviction_order() == [1, 3]
    assert refs(mgr, 8) == [1, 0, 1, 0, 1, 1, 1, 1]
    assert mgr.pool.num_used_blocks == 6


def test_without_num_computed_nothing_is_freed():
    mgr = KVCacheManager(num_blocks=16, block_size=BS, group_windows=TWO)
    mgr.allocate("a", 24, toks(0, 24))
    mgr.allocate("a", 40, toks(0, 40))
    assert mgr.held_block_ids("a") == list(range(10))


def test_freed_blocks_are_reused_by_others_and_free_drops_only_the_live_entries():
    mgr = KVCacheManager(num_blocks=9, block_size=BS, group_windows=TWO)
    mgr.allocate("a", 24, toks(0, 24), num_computed=0)
    mgr.allocate("a", 25, toks(0, 25), num_computed=24)  # frees block 1; holds 0, 2..7
    alloc = mgr.allocate("b", 8, toks(100, 8), num_computed=0)
    assert list(alloc.new_block_ids) == [8, 1]  # the last fresh id, then block 1 evicted from the prefix cache
    assert mgr.pool.num_evictions == 1
    assert 1 in mgr.block_table("a") and 1 not in mgr.held_block_ids("a")
    assert refs(mgr, 9) == [1, 1, 1, 1, 1, 1, 1, 1, 1]
    mgr.free("a")  # a double free of block 1 would raise
    assert refs(mgr, 9) == [0, 1, 0, 0, 0, 0, 0, 0, 1]
    assert mgr.pool.num_free_blocks == 7


def test_a_prefix_hit_needs_every_groups_block_and_never_references_the_ones_out_of_the_window():
    mgr = KVCacheManager(num_blocks=16, block_size=BS, group_windows=TWO)
    prompt = toks(0, 25)
    mgr.allocate("a", 25, prompt, num_computed=0)
    mgr.free("a")
    hit = mgr.find_prefix(prompt)
    assert (hit.block_ids, hit.num_tokens) == ([0, 1, 2, 3, 4, 5], 24)
    # the hit's first query is at 24: it sees 9..24, so block 1 is stale at once and keeps ref count 0
    mgr.allocate("b", 25, prompt, hit, num_computed=24)
    assert mgr.block_table("b") == [0, 1, 2, 3, 4, 5, 8, 9]  # logical 3: fresh ids before a's freed 7, 6
    assert refs(mgr, 10) == [1, 0, 1, 1, 1, 1, 0, 0, 1, 1]
    assert mgr.pool.eviction_order() == [1]
    # the 6 fresh ids, the 2 freed uncached ones, then block 1 (group 1's copy of tokens 0..7) is evicted
    assert mgr.pool.allocate(9)[-1] == 1
    # the hit's first query (at 24) does not see tokens 0..7: the entry is stale, group 0's id stands in for it
    hit = mgr.find_prefix(prompt)
    assert (hit.block_ids, hit.num_tokens) == ([0, 0, 2, 3, 4, 5], 24)


def test_a_prefix_hit_needs_the_sliding_blocks_inside_the_window_of_its_end_only():
    mgr = KVCacheManager(num_blocks=12, block_size=BS, group_windows=TWO)
    prompt = toks(0, 33)
    mgr.allocate("a", 24, prompt, num_computed=0)
    mgr.allocate("a", 33, prompt, num_computed=24)  # the query at 24 sees 9..24: block 1 is freed first
    assert mgr.block_table("a") == list(range(10)) and mgr.pool.eviction_order() == [1]
    mgr.free("a")  # tail first: 9, 8 (tokens 32.., never cached), then the cached 7 .. 2, 0 after block 1
    assert mgr.pool.eviction_order() == [1, 7, 6, 5, 4, 3, 2, 0]
    taken = mgr.pool.allocate(5)
    assert taken == [10, 11, 9, 8, 1]  # the fresh ids, the uncached ones, then block 1 is evicted
    mgr.pool.free(taken)
    # 4 blocks (32 tokens) hit: the query at 32 sees 17..32, so group 1's blocks of tokens 0..15 are not needed
    hit = mgr.find_prefix(prompt)
    assert (hit.block_ids, hit.num_tokens) == ([0, 0, 2, 3, 4, 5, 6, 7], 32)
    mgr.allocate("b", 33, prompt, hit, num_computed=32)
    assert mgr.block_table("b")[:8] == [0, 0, 2, 3, 4, 5, 6, 7]
    held = mgr.held_block_ids("b")
    assert held[:6] == [0, 2, 4, 5, 6, 7] and len(held) == 8  # the stale entries hold no reference
    assert refs(mgr, 8) == [1, 0, 1, 0, 1, 1, 1, 1]
    assert mgr.pool.eviction_order() == [3]  # group 1's copy of tokens 8..15 stays cached, free
    mgr.free("b")
    assert refs(mgr, 8) == [0] * 8


def test_a_sliding_block_missing_inside_the_window_shortens_the_hit():
    mgr = KVCacheManager(num_blocks=12, block_size=BS, group_windows=TWO)
    prompt = toks(0, 33)
    mgr.allocate("a", 24, prompt, num_computed=0)
    mgr.allocate("a", 33, prompt, num_computed=24)
    mgr.free("a")
    assert mgr.pool.allocate(6) == [10, 11, 9, 8, 1, 7]  # block 7: group 1's copy of tokens 24..31
    # 4 blocks would need it (the query at 32 sees 17..32); 3 blocks (the query at 24 sees 9..24) do not
    hit = mgr.find_prefix(prompt)
    assert (hit.block_ids, hit.num_tokens) == ([0, 0, 2, 3, 4, 5], 24)
    assert mgr.cached_prefix_len(prompt) == 24


def test_a_fork_shares_the_live_blocks_and_copies_each_groups_partial_block():
    mgr = KVCacheManager(num_blocks=16, block_size=BS, group_windows=TWO)
    mgr.allocate("a", 20, toks(0, 20), num_computed=0)
    mgr.allocate("a", 21, toks(0, 21), num_computed=20)  # the query at 20 sees 5..20: nothing freed yet
    mgr.allocate("a", 25, toks(0, 25), num_computed=24)  # frees block 1, appends 6, 7
    mgr.fork("a", "c")
    assert refs(mgr, 8) == [2, 0, 2, 2, 2, 2, 2, 2]
    alloc = mgr.allocate("c", 26, toks(0, 26), num_computed=25)
    assert list(alloc.copies) == [(6, 8), (7, 9)] and list(alloc.new_block_ids) == []
    assert mgr.block_table("c") == [0, 1, 2, 3, 4, 5, 8, 9]
    assert refs(mgr, 10) == [2, 0, 2, 2, 2, 2, 1, 1, 1, 1]


def test_one_window_for_all_layers_is_one_group_that_frees_its_own_blocks():
    mgr = KVCacheManager(num_blocks=16, block_size=BS, group_windows=(16,))
    mgr.allocate("a", 32, toks(0, 32), num_computed=0)
    mgr.allocate("a", 33, toks(0, 33), num_computed=32)  # the query at 32 sees 17..32: blocks 0 and 1 go
    assert mgr.held_block_ids("a") == [2, 3, 4]
    assert mgr.pool.eviction_order() == [0, 1]


def test_group_windows_are_checked():
    with pytest.raises(ValueError, match="group_windows"):
        KVCacheManager(num_blocks=4, block_size=BS, group_windows=(0, 16, 32))
    with pytest.raises(ValueError, match="group_windows"):
        KVCacheManager(num_blocks=4, block_size=BS, group_windows=())


# Gemma 3 270M: 18 layers, every 6th full attention, the others a 512-token window
GEMMA3_270M = KVGeometry(18, 1, 256, "bfloat16", 16, tuple(0 if i % 6 == 5 else 512 for i in range(18)))


def test_gemma3_270m_splits_into_one_full_and_five_sliding_groups_of_three_layers():
    groups = GEMMA3_270M.groups
    assert (groups.layers_per_group, groups.windows) == (3, (0, 512, 512, 512, 512, 512))
    assert [groups.layer_slots[i] for i in (5, 11, 17)] == [(0, 0), (0, 1), (0, 2)]
    assert groups.layer_slots[:5] == ((1, 0), (1, 1), (1, 2), (2, 0), (2, 1))
    # a block holds 3 layers: 6 times as many blocks in the same memory
    assert GEMMA3_270M.bytes_per_block * 6 == GEMMA3_270M.bytes_per_token * 16


def test_a_4096_token_gemma3_sequence_holds_416_blocks_not_1536():
    """Prefilled in chunks of 512, then decoding: at 4096 tokens (its step computes position 4095, which sees 3584..4095)
    the full group holds all 256 blocks and each sliding group blocks 224..255 (32): 416 blocks. Without freeing:
    6 x 256 = 1536. No sliding group ever holds more than ceil(512 / 16) + 1 = 33 blocks once decoding."""
    mgr = KVCacheManager(num_blocks=2000, block_size=16, group_windows=GEMMA3_270M.groups.windows)
    tokens = toks(0, 4200)
    for start in range(0, 4095, 512):
        end = min(start + 512, 4095)
        mgr.allocate("a", end, tokens, num_computed=start)
        if start == 3584:  # the last chunk's queries start at 3584: they see from 3073 on, block 192
            assert len(mgr.held_block_ids("a")) == 256 + 5 * (256 - 192)
    mgr.allocate("a", 4096, tokens, num_computed=4095)
    assert len(mgr.held_block_ids("a")) == mgr.pool.num_used_blocks == 416
    assert len(mgr.block_table("a")) == 1536
    held = mgr.held_block_ids("a")
    assert held[:2] == mgr.block_table("a")[:12:6]  # the full group's first blocks, logical 0 and 1
    for n in range(4096, 4200):
        mgr.allocate("a", n + 1, tokens, num_computed=n)
        per_sliding = (len(mgr.held_block_ids("a")) - mgr.num_blocks_for(n + 1)) // 5
        assert per_sliding <= 33
    mgr.free("a")
    assert mgr.pool.num_used_blocks == 0


def test_kv_plan_counts_416_blocks_for_a_4096_token_gemma3_sequence():
    from scheduler_svc.kv.capacity import plan

    kv = plan(GEMMA3_270M, 4096, memory=GEMMA3_270M.bytes_per_block * 4160)
    # decoding at 4096 tokens each sliding group holds at most ceil(512 / 16) + 1 = 33 blocks (the manager test
    # above finds 32 at that very step): 256 + 5 x 33
    assert kv.blocks_per_sequence == 256 + 5 * 33
    assert kv.bytes_per_block == 2 * 3 * 1 * 256 * 2 * 16  # K and V, 3 layers, 1 kv head, 256 dims, bfloat16, 16
    assert (kv.num_blocks, kv.num_sequences) == (4160, 4160 // 421)
    assert kv.num_tokens == 4160 // 6 * 16  # token slots of all 18 layers
