"""Fixed-size KV blocks: ref counts, the free queue and the prefix cache with LRU eviction."""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Iterable

# A block's prefix-cache key: (parent, token ids as int32 bytes: manager.block_tokens). `parent` is the chain id
# of the previous block of the same prompt, or the root of the chain (None, or ("extra", key) for a cache salt /
# adapter id). Keys compare by value, so the dict lookup itself verifies the tokens: two different contents can
# never share an entry.
BlockKey = tuple[object, bytes]


class BlockPool:
    """N blocks with integer ids 0..N-1.

    Every block is in exactly one state:
      - used: ref_cnt >= 1 (held by at least one request's block table);
      - free and uncached: ref_cnt == 0, no key, in `_free` (handed out first, FIFO);
      - free and cached ("evictable"): ref_cnt == 0, has a key, in `_evictable` (least recently freed first).
    NOTE: a block returns to the free pool only when its ref count reaches 0.
    """

    __slots__ = ("num_blocks", "ref_cnt", "block_key", "chain_id", "_free", "_evictable", "_cached",
                 "_next_chain_id", "num_evictions")

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.block_key: list[BlockKey | None] = [None] * num_blocks
        # NOTE: chain ids are never reused (a counter, not the block id): a child cached under an evicted
        # parent's chain id can then never match a new parent that happens to land in the same block.
        self.chain_id = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[BlockKey, int] = {}
        self._next_chain_id = 1
        self.num_evictions = 0

    # -- accounting ---------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0, cached or not: what an allocation can take."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free) - len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks reachable through the prefix cache, used or free."""
        return len(self._cached)

    def eviction_order(self) -> list[int]:
        """Cached free blocks, next to be evicted first (for inspection and tests)."""
        return list(self._evictable)

    # -- allocation ---------------------------------------------------------------------------------------
    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free) + len(self._evictable)

    def allocate(self, num_blocks: int) -> list[int]:
        """Takes `num_blocks` blocks at ref count 1: uncached ones first, then evicts least recently freed."""
        free, evictable = self._free, self._evictable
        if num_blocks > len(free) + len(evictable):
            raise RuntimeError(f"cannot allocate {num_blocks} blocks: {self.num_free_blocks} free")
        ref_cnt = self.ref_cnt
        out = []
        for _ in range(num_blocks):
            if free:
                bid = free.popleft()
            else:
                bid = evictable.popitem(last=False)[0]
                del self._cached[self.block_key[bid]]
                self.block_key[bid] = None
                self.num_evictions += 1
            ref_cnt[bid] = 1
            out.append(bid)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Takes one more reference on each block (prefix hits, forks); revives cached free blocks."""
        ref_cnt, evictable = self.ref_cnt, self._evictable
        for bid in block_ids:
            if ref_cnt[bid] == 0:
                del evictable[bid]
            ref_cnt[bid] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drops one reference on each block, in the given order (the order in which they become evictable)."""
        ref_cnt, key, evictable, free = self.ref_cnt, self.block_key, self._evictable, self._free
        for bid in block_ids:
            rc = ref_cnt[bid] - 1
            ref_cnt[bid] = rc
            if rc == 0:
                if key[bid] is None:
                    free.append(bid)
                else:
                    evictable[bid] = None
            elif rc < 0:
                raise RuntimeError(f"block {bid} freed more times than it was referenced")

    # -- prefix cache -------------------------------------------------------------------------------------
    def lookup(self, key: BlockKey) -> int | None:
        return self._cached.get(key)

    def cache(self, block_id: int, key: BlockKey) -> int:
        """Registers a full block under `key`; returns the chain id its children are keyed under.

        When another block already holds the same content, that one stays the cached copy (this block stays
        private) and its chain id is returned, so the chain remains findable.
        """
        existing = self._cached.get(key)
        if existing is not None:
            return self.chain_id[existing]
        cid = self._next_chain_id
        self._next_chain_id = cid + 1
        self._cached[key] = block_id
        self.block_key[block_id] = key
        self.chain_id[block_id] = cid
        return cid

    def cached_items(self) -> list[tuple[BlockKey, int]]:
        return list(self._cached.items())
