"""Spec tests for the KV block manager: exact block ids, ref counts, eviction order, copy-on-write."""

import pytest

from scheduler_svc.kv.manager import NO_CHANGE, KVCacheManager

BS = 8


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def new(mgr: KVCacheManager, rid: str, prompt: list[int], extra_key=None):
    """Admits a prompt as the scheduler does: its cached prefix, the query counted, then its blocks."""
    hit = mgr.find_prefix(prompt, extra_key)
    mgr.record_prefix_query(len(prompt), hit.num_tokens)
    return hit, mgr.allocate(rid, len(prompt), prompt, hit, extra_key)


def refs(mgr: KVCacheManager) -> list[int]:
    return list(mgr.pool.ref_cnt)


def test_allocates_fresh_blocks_in_id_order_and_caches_only_full_blocks():
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    hit, alloc = new(mgr, "a", toks(0, 20))
    assert (hit.block_ids, hit.num_tokens) == ([], 0)
    assert list(alloc.new_block_ids) == [0, 1, 2] and list(alloc.copies) == []
    assert mgr.block_table("a") == [0, 1, 2]
    assert refs(mgr)[:4] == [1, 1, 1, 0]
    assert mgr.pool.num_cached_blocks == 2  # block 2 holds 4 of 8 tokens: partial blocks are never cached
    assert sorted(b for _, b in mgr.pool.cached_items()) == [0, 1]


def test_prefix_hit_shares_full_blocks_by_ref_count():
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    new(mgr, "a", toks(0, 20))
    hit, alloc = new(mgr, "b", toks(0, 16) + [100, 101, 102])
    assert (hit.block_ids, hit.num_tokens) == ([0, 1], 16)
    assert list(alloc.new_block_ids) == [3]
    assert mgr.block_table("b") == [0, 1, 3]
    assert refs(mgr)[:4] == [2, 2, 1, 1]
    assert (mgr.prefix_query_tokens, mgr.prefix_hit_tokens) == (39, 16)


def test_hit_never_covers_the_prompts_last_token():
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    new(mgr, "a", toks(0, 16))
    hit = mgr.find_prefix(toks(0, 16))  # both blocks cached, but the last token's logits must be computed
    assert (hit.block_ids, hit.num_tokens) == ([0], 8)
    assert mgr.find_prefix(toks(0, 17)).block_ids == [0, 1]


def test_hit_stops_at_first_miss_even_if_later_blocks_match():
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    new(mgr, "a", toks(0, 25))
    other = [999] + toks(1, 24)  # block 0 differs; block 1 has the same tokens but another parent
    assert mgr.find_prefix(other).block_ids == []


def test_cache_salt_isolates_prefixes():
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    new(mgr, "a", toks(0, 17), extra_key="tenant-1")
    assert mgr.find_prefix(toks(0, 17)).block_ids == []
    assert mgr.find_prefix(toks(0, 17), extra_key="tenant-2").block_ids == []
    assert mgr.find_prefix(toks(0, 17), extra_key="tenant-1").block_ids == [0, 1]


def test_freed_blocks_become_evictable_tail_first_and_are_evicted_lru():
    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    new(mgr, "a", toks(0, 20))  # [0, 1, 2]
    new(mgr, "b", toks(0, 16) + [100, 101, 102])  # [0, 1, 3]
    mgr.free("a")
    assert refs(mgr)[:4] == [1, 1, 0, 1]
    assert mgr.pool.eviction_order() == []  # block 2 was never cached: plain free
    mgr.free("b")
    assert refs(mgr)[:4] == [0, 0, 0, 0]
    assert mgr.pool.eviction_order() == [1, 0]  # a chain's tail is evicted before its head
    assert mgr.pool.num_free_blocks == 10 and mgr.pool.num_cached_free_blocks == 2
    # Uncached free blocks go first (4..9, then 2 and 3 in the order they were freed): no eviction yet.
    _, alloc = new(mgr, "c", toks(500, 64))
    assert list(alloc.new_block_ids) == [4, 5, 6, 7, 8, 9, 2, 3]
    assert mgr.pool.num_evictions == 0
    assert mgr.find_prefix(toks(0, 17)).block_ids == [0, 1]
    # The next block evicts the least recently freed cached block: 1 (the tail), then 0.
    assert list(mgr.allocate("c", 65, toks(500, 65)).new_block_ids) == [1]
    assert mgr.pool.num_evictions == 1
    assert mgr.find_prefix(toks(0, 17)).block_ids == [0]


def test_more_recently_freed_blocks_survive_longer():
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    new(mgr, "x", toks(0, 9))  # [0, 1]: block 0 cached
    new(mgr, "y", toks(100, 9))  # [2, 3]: block 2 cached
    mgr.free("x")
    mgr.free("y")
    assert mgr.pool.eviction_order() == [0, 2]
    new(mgr, "x2", toks(0, 9))  # hit on 0 revives it; 1 is taken from the free list
    assert mgr.block_table("x2") == [0, 1]
    mgr.free("x2")  # 0 is now the most recently freed
    assert mgr.pool.eviction_order() == [2, 0]


def test_hit_revives_a_cached_free_block():
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    new(mgr, "a", toks(0, 17))
    mgr.free("a")
    assert mgr.pool.eviction_order() == [1, 0]
    hit, alloc = new(mgr, "b", toks(0, 16) + [7])
    assert hit.block_ids == [0, 1] and list(alloc.new_block_ids) == [3]
    assert refs(mgr) == [1, 1, 0, 1]
    assert mgr.pool.eviction_order() == []


def test_allocate_counts_revived_cached_blocks_as_taken():
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    new(mgr, "a", toks(0, 16))
    mgr.free("a")  # 0 and 1 cached free; 2 and 3 uncached free
    prompt = toks(0, 16) + toks(50, 16) + [1]
    hit = mgr.find_prefix(prompt)
    assert hit.block_ids == [0, 1]
    assert mgr.allocate("b", 33, prompt, hit) is None  # 2 revived + 3 new > 4
    assert refs(mgr) == [0, 0, 0, 0] and "b" not in mgr  # a refusal changes nothing
    assert mgr.pool.eviction_order() == [1, 0]
    assert list(mgr.allocate("b", 32, prompt, hit).new_block_ids) == [2, 3]  # 2 revived + 2 new = 4 free blocks
    assert mgr.block_table("b") == [0, 1, 2, 3] and refs(mgr) == [1, 1, 1, 1]


def test_exhaustion_is_reported_not_raised():
    mgr = KVCacheManager(num_blocks=2, block_size=BS)
    new(mgr, "a", toks(0, 16))
    assert mgr.allocate("a", 17, toks(0, 17)) is None
    assert mgr.block_table("a") == [0, 1] and mgr.num_tokens("a") == 16


def test_decode_appends_blocks_only_at_block_boundaries():
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    tokens = toks(0, 7)
    new(mgr, "a", tokens)
    tokens.append(7)
    assert mgr.allocate("a", 8, tokens) is NO_CHANGE
    tokens.append(8)
    assert list(mgr.allocate("a", 9, tokens).new_block_ids) == [1]
    assert mgr.block_table("a") == [0, 1]
    assert mgr.find_prefix(toks(0, 9)).block_ids == [0]  # the block filled by decoding was cached


def test_same_content_computed_twice_is_cached_once():
    mgr = KVCacheManager(num_blocks=6, block_size=BS)
    prompt = toks(0, 17)
    hit_a, hit_b = mgr.find_prefix(prompt), mgr.find_prefix(prompt)  # both miss: neither is computed yet
    mgr.allocate("a", 17, prompt, hit_a)
    mgr.allocate("b", 17, prompt, hit_b)
    assert mgr.block_table("a") == [0, 1, 2] and mgr.block_table("b") == [3, 4, 5]
    assert sorted(b for _, b in mgr.pool.cached_items()) == [0, 1]
    mgr.free("b")
    mgr.free("a")
    assert mgr.pool.eviction_order() == [1, 0]  # b's duplicates went back as plain free blocks
    assert mgr.find_prefix(prompt).block_ids == [0, 1]


def test_chunked_prefill_grows_the_table_append_only():
    mgr = KVCacheManager(num_blocks=8, block_size=BS)
    prompt = toks(0, 30)
    hit = mgr.find_prefix(prompt)
    assert list(mgr.allocate("a", 10, prompt, hit).new_block_ids) == [0, 1]
    assert list(mgr.allocate("a", 20, prompt).new_block_ids) == [2]
    assert list(mgr.allocate("a", 30, prompt).new_block_ids) == [3]
    assert mgr.block_table("a") == [0, 1, 2, 3]
    assert mgr.pool.num_cached_blocks == 3


def test_fork_shares_blocks_and_copies_the_partial_block_on_first_write():
    mgr = KVCacheManager(num_blocks=6, block_size=BS)
    prompt = toks(0, 10)  # block 0 full, block 1 holds 2 tokens
    new(mgr, "p", prompt)
    mgr.fork("p", "c1")
    mgr.fork("p", "c2")
    assert refs(mgr)[:2] == [3, 3]
    # The parent writes in place: slot 2 of block 1 is past what the children read.
    assert mgr.allocate("p", 11, prompt + [50]) is NO_CHANGE
    alloc = mgr.allocate("c1", 11, prompt + [51])
    assert list(alloc.copies) == [(1, 2)] and list(alloc.new_block_ids) == []
    assert mgr.block_table("c1") == [0, 2]
    assert refs(mgr)[:3] == [3, 2, 1]
    alloc = mgr.allocate("c2", 11, prompt + [52])
    assert list(alloc.copies) == [(1, 3)]
    assert refs(mgr)[:4] == [3, 1, 1, 1]
    assert mgr.block_table("p") == [0, 1] and mgr.block_table("c2") == [0, 3]


def test_last_sharer_writes_in_place_when_others_are_gone():
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    prompt = toks(0, 10)
    new(mgr, "p", prompt)
    mgr.fork("p", "c")
    mgr.free("p")
    assert refs(mgr)[:2] == [1, 1]
    assert mgr.allocate("c", 11, prompt + [1]) is NO_CHANGE
    assert mgr.block_table("c") == [0, 1]


def test_fork_of_full_blocks_needs_no_copy():
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    prompt = toks(0, 16)
    new(mgr, "p", prompt)
    mgr.fork("p", "c")
    alloc = mgr.allocate("c", 17, prompt + [1])
    assert list(alloc.copies) == [] and list(alloc.new_block_ids) == [2]
    assert refs(mgr)[:3] == [2, 2, 1]


def test_copy_on_write_waits_when_no_block_is_free():
    mgr = KVCacheManager(num_blocks=2, block_size=BS)
    prompt = toks(0, 10)
    new(mgr, "p", prompt)
    mgr.fork("p", "c")
    assert mgr.allocate("c", 11, prompt + [1]) is None
    assert mgr.block_table("c") == [0, 1] and refs(mgr) == [2, 2]


def test_the_pool_accounts_used_cached_free_and_fragmentation():
    """What the metrics export (the pool's counters) and kv-map (figures of the tables GetKVState sends) show."""
    from pagedserve_cli.kv_state import KVSequence, KVSnapshot, figures

    mgr = KVCacheManager(num_blocks=10, block_size=BS)
    new(mgr, "a", toks(0, 20))  # 3 blocks, 4 empty slots
    new(mgr, "b", toks(0, 16) + [1])  # shares 2 blocks, 1 new block with 7 empty slots
    new(mgr, "c", toks(300, 8))
    mgr.free("c")  # 1 cached free block
    pool = mgr.pool
    assert (pool.num_used_blocks, pool.num_cached_free_blocks, pool.num_free_blocks) == (4, 1, 6)
    tables = [KVSequence(rid, i, mgr.block_table(rid), mgr.num_tokens(rid)) for i, rid in enumerate("ab")]
    s = figures(KVSnapshot.build("w", BS, list(pool.ref_cnt), [int(k is not None) for k in pool.block_key], tables))
    assert s["num_used_blocks"] / s["num_blocks"] == pytest.approx(0.4)
    assert (s["num_slots_allocated"], s["num_slots_filled"]) == (32, 32 - 4 - 7)
    assert (mgr.prefix_query_tokens, mgr.prefix_hit_tokens) == (45, 16)


def test_block_size_must_be_a_power_of_two_from_8_to_256():
    for bad in (0, 4, 12, 512):
        with pytest.raises(ValueError, match="block_size"):
            KVCacheManager(num_blocks=4, block_size=bad)
    for good in (8, 16, 32, 64, 128, 256):
        assert KVCacheManager(num_blocks=4, block_size=good).block_size == good


def test_child_copies_a_block_its_parent_completed_and_cached():
    mgr = KVCacheManager(num_blocks=4, block_size=BS)
    prompt = toks(0, 10)
    new(mgr, "p", prompt)
    mgr.fork("p", "c")
    assert mgr.allocate("p", 16, prompt + toks(50, 6)) is NO_CHANGE  # the parent fills block 1: it is cached
    mgr.free("p")
    assert mgr.pool.ref_cnt[1] == 1
    # The child is the last holder, but block 1 now holds the parent's tokens under a prefix-cache key:
    # writing its own token there in place would corrupt what a later prefix hit reads.
    alloc = mgr.allocate("c", 11, prompt + [99])
    assert list(alloc.copies) == [(1, 2)]
    assert mgr.block_table("c") == [0, 2]
    assert mgr.pool.eviction_order() == [1]
    assert mgr.find_prefix(prompt + toks(50, 6) + [1]).block_ids == [0, 1]
