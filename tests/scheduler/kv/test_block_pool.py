"""Spec tests for the pool's lazy bookkeeping: memory grows with the blocks used, not the pool's size, and the ids
handed out and the eviction order are exactly those of a free queue that starts as 0..N-1."""

import random
import tracemalloc
from collections import OrderedDict, deque

from scheduler_svc.kv.block_pool import BlockPool
from scheduler_svc.kv.run_pool import RunPool

HUGE = 10_000_000


class EagerPool:
    """The pool as it was before laziness, for comparison: a free queue of all N ids, lists of N."""

    def __init__(self, n: int) -> None:
        self.ref_cnt, self.key = [0] * n, [None] * n
        self.free_q, self.evictable = deque(range(n)), OrderedDict()

    def allocate(self, k: int) -> list[int]:
        out = []
        for _ in range(k):
            bid = self.free_q.popleft() if self.free_q else self.evictable.popitem(last=False)[0]
            self.key[bid] = None
            self.ref_cnt[bid] = 1
            out.append(bid)
        return out

    def free(self, ids) -> None:
        for bid in ids:
            self.ref_cnt[bid] -= 1
            if self.ref_cnt[bid] == 0:
                (self.free_q.append(bid) if self.key[bid] is None else self.evictable.__setitem__(bid, None))


def test_a_huge_pool_allocates_nothing_up_front():
    tracemalloc.start()
    try:
        pool = BlockPool(HUGE)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, f"{peak:,} bytes for an unused pool"
    assert (pool.num_free_blocks, pool.num_used_blocks, pool.num_touched_blocks) == (HUGE, 0, 0)
    assert pool.allocate(3) == [0, 1, 2] and pool.num_touched_blocks == 3  # state for the blocks used, no more
    assert (pool.num_free_blocks, pool.num_used_blocks) == (HUGE - 3, 3)


def test_the_per_block_lists_read_as_lists_of_n():
    pool = BlockPool(6)
    pool.allocate(2)
    pool.cache(1, (None, (1, 2)))
    assert pool.ref_cnt == [1, 1, 0, 0, 0, 0] and len(pool.ref_cnt) == 6 and pool.ref_cnt[5] == 0
    assert list(pool.block_key) == [None, (None, (1, 2)), None, None, None, None] and pool.block_key[-1] is None
    assert pool.chain_id[1] == 1 and pool.chain_id[4] == 0
    pool.free([0, 1])
    assert list(pool._free) == [2, 3, 4, 5, 0] and 3 in pool._free and 1 not in pool._free  # 1 is cached free
    assert pool.eviction_order() == [1]


def test_ids_and_eviction_order_equal_a_full_free_queue():
    rng = random.Random(0)
    n = 40
    lazy, eager = BlockPool(n), EagerPool(n)
    held: list[int] = []
    for step in range(2000):
        if rng.random() < 0.5 and lazy.num_free_blocks:
            k = rng.randint(1, min(6, lazy.num_free_blocks))
            got = lazy.allocate(k)
            assert got == eager.allocate(k), step
            for bid in got:
                if rng.random() < 0.4:  # some enter the prefix cache, so that they are evicted later
                    lazy.cache(bid, (None, (step, bid)))
                    eager.key[bid] = (None, (step, bid))
            held += got
        elif held:
            rng.shuffle(held)
            k = rng.randint(1, len(held))
            lazy.free(held[:k])
            eager.free(held[:k])
            del held[:k]
        assert lazy.ref_cnt == eager.ref_cnt and lazy.eviction_order() == list(eager.evictable)
        assert list(lazy._free) == list(eager.free_q)
    assert lazy.num_evictions > 0


def test_a_huge_run_pool_stores_state_up_to_the_last_run_only():
    pool = RunPool(HUGE)
    assert pool.allocate(3) == [0, 1, 2] and pool.allocate_at(10, 2) == [10, 11]
    assert pool.num_touched_blocks == 12 and pool.num_free_blocks == HUGE - 5 and list(pool._free) == []
    assert pool.ref_cnt[10] == 1 and pool.ref_cnt[5] == 0 and pool.ref_cnt[HUGE - 1] == 0
    pool.free([0, 1, 2, 10, 11])
    assert pool.holes() == [(0, HUGE)]
