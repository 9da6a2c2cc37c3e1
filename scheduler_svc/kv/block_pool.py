"""Fixed-size KV blocks: ref counts, the free queue and the prefix cache with LRU eviction."""

from __future__ import annotations

import itertools
from collections import OrderedDict, deque
from collections.abc import Collection, Iterable, Iterator, Sequence

# A block's prefix-cache key: (parent, token ids as int32 bytes: manager.block_tokens). `parent` is the chain id
# of the previous block of the same prompt, or the root of the chain (None, or ("extra", key) for a cache salt /
# adapter id). Keys compare by value, so the dict lookup itself verifies the tokens: two different contents can
# never share an entry.
BlockKey = tuple[object, bytes]


class Padded(Sequence):
    """A read-only list of `length` items: those of `items` (a list that may grow), then `fill` for the rest.
    NOTE: how the pool shows its per-block lists: storage grows with the ids ever handed out, not the pool size."""

    __slots__ = ("_items", "_length", "_fill")

    def __init__(self, items: list, length: int, fill: object) -> None:
        self._items, self._length, self._fill = items, length, fill

    def __len__(self) -> int:
        return self._length

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(self._length))]
        if i < 0:
            i += self._length
        if not 0 <= i < self._length:
            raise IndexError(f"block {i} is not in a pool of {self._length}")
        items = self._items
        return items[i] if i < len(items) else self._fill

    def __iter__(self) -> Iterator:
        return itertools.chain(self._items, itertools.repeat(self._fill, self._length - len(self._items)))

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Sequence) or isinstance(other, (str, bytes)):
            return NotImplemented
        return len(other) == self._length and all(a == b for a, b in zip(self, other))

    def __repr__(self) -> str:
        return f"Padded({list(self)!r})"


class FreeQueue(Collection):
    """The free uncached blocks in the order they are handed out: the never-used ids (next_fresh .. N-1, in order),
    then those freed since, first freed first. NOTE: a view (for inspection and tests); the pool keeps only the
    counter and the freed ones."""

    __slots__ = ("_pool",)

    def __init__(self, pool: BlockPool) -> None:
        self._pool = pool

    def __len__(self) -> int:
        p = self._pool
        return p.num_blocks - p._next_fresh + len(p._freed)

    def __iter__(self) -> Iterator[int]:
        p = self._pool
        return itertools.chain(range(p._next_fresh, p.num_blocks), p._freed)

    def __contains__(self, bid: object) -> bool:
        p = self._pool
        return (isinstance(bid, int) and p._next_fresh <= bid < p.num_blocks) or bid in p._freed


class BlockPool:
    """N blocks with integer ids 0..N-1.

    Every block is in exactly one state:
      - used: ref_cnt >= 1 (held by at least one request's block table);
      - free and uncached: ref_cnt == 0, no key, in the free queue (handed out first, FIFO);
      - free and cached ("evictable"): ref_cnt == 0, has a key, in `_evictable` (least recently freed first).
    NOTE: a block returns to the free pool only when its ref count reaches 0.
    NOTE: memory grows with the blocks ever used, not with N: a worker may register millions. The free queue
    starts as 0..N-1 and freed blocks join its tail, so its never-used ids are always its head, in order: they
    come from a counter (`_next_fresh`) and only freed ones are queued (`_freed`); the per-block lists (`_refs`,
    `_keys`, `_chains`) cover ids below the counter, and read as 0 / None / 0 beyond it (`ref_cnt`, ...).
    """

    __slots__ = ("num_blocks", "_refs", "_keys", "_chains", "_next_fresh", "_freed", "_evictable", "_cached",
                 "_next_chain_id", "num_evictions")

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self._refs: list[int] = []
        self._keys: list[BlockKey | None] = []
        # NOTE: chain ids are never reused (a counter, not the block id): a child cached under an evicted
        # parent's chain id can then never match a new parent that happens to land in the same block.
        self._chains: list[int] = []
        self._next_fresh = 0  # ids from here on were never handed out
        self._freed: deque[int] = deque()
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[BlockKey, int] = {}
        self._next_chain_id = 1
        self.num_evictions = 0

    # -- per-block state, as lists of N (read-only views) -------------------------------------------------
    @property
    def ref_cnt(self) -> Padded:
        return Padded(self._refs, self.num_blocks, 0)

    @property
    def block_key(self) -> Padded:
        return Padded(self._keys, self.num_blocks, None)

    @property
    def chain_id(self) -> Padded:
        return Padded(self._chains, self.num_blocks, 0)

    @property
    def _free(self) -> FreeQueue:
        return FreeQueue(self)

    @property
    def num_touched_blocks(self) -> int:
        """Blocks with stored state: ids below this were handed out at least once (or grown into)."""
        return len(self._refs)

    def stored_state(self) -> tuple[list[int], list[BlockKey | None]]:
        """The ref counts and keys of blocks 0 .. num_touched_blocks - 1 (the others: 0 and None), read-only: a
        snapshot's cost then grows with the blocks ever used, not with N (scheduler_svc.core.kv_snapshot)."""
        return self._refs, self._keys

    def _grow(self, end: int) -> None:
        """Stores state for ids up to `end` - 1 (never used: ref count 0, no key)."""
        more = end - len(self._refs)
        if more > 0:
            self._refs.extend(itertools.repeat(0, more))
            self._keys.extend(itertools.repeat(None, more))
            self._chains.extend(itertools.repeat(0, more))

    # -- accounting ---------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        """Blocks with ref count 0, cached or not: what an allocation can take."""
        return self.num_blocks - self._next_fresh + len(self._freed) + len(self._evictable)

    @property
    def num_cached_free_blocks(self) -> int:
        return len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self._next_fresh - len(self._freed) - len(self._evictable)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks reachable through the prefix cache, used or free."""
        return len(self._cached)

    def eviction_order(self) -> list[int]:
        """Cached free blocks, next to be evicted first (for inspection and tests)."""
        return list(self._evictable)

    # -- allocation ---------------------------------------------------------------------------------------
    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate(self, num_blocks: int) -> list[int]:
        """Takes `num_blocks` blocks at ref count 1: uncached ones first (never-used ids, then freed ones, as one
        FIFO queue), then evicts least recently freed."""
        freed, evictable = self._freed, self._evictable
        if num_blocks > self.num_free_blocks:
            raise RuntimeError(f"cannot allocate {num_blocks} blocks: {self.num_free_blocks} free")
        start = self._next_fresh
        num_fresh = min(num_blocks, self.num_blocks - start)
        out = []
        if num_fresh > 0:  # the head of the free queue: never-used ids, in order
            end = self._next_fresh = start + num_fresh
            self._grow(end)
            self._refs[start:end] = itertools.repeat(1, num_fresh)
            out = list(range(start, end))
        ref_cnt, key = self._refs, self._keys
        for _ in range(num_blocks - len(out)):
            if freed:
                bid = freed.popleft()
            else:
                bid = evictable.popitem(last=False)[0]
                del self._cached[key[bid]]
                key[bid] = None
                self.num_evictions += 1
            ref_cnt[bid] = 1
            out.append(bid)
        return out

    def touch(self, block_ids: Iterable[int]) -> None:
        """Takes one more reference on each block (prefix hits, forks); revives cached free blocks."""
        ref_cnt, evictable = self._refs, self._evictable
        for bid in block_ids:
            if ref_cnt[bid] == 0:
                del evictable[bid]
            ref_cnt[bid] += 1

    def free(self, block_ids: Iterable[int]) -> None:
        """Drops one reference on each block, in the given order (the order in which they become evictable)."""
        ref_cnt, key, evictable, freed = self._refs, self._keys, self._evictable, self._freed
        for bid in block_ids:
            rc = ref_cnt[bid] - 1
            ref_cnt[bid] = rc
            if rc == 0:
                if key[bid] is None:
                    freed.append(bid)
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
            return self._chains[existing]
        cid = self._next_chain_id
        self._next_chain_id = cid + 1
        self._cached[key] = block_id
        self._keys[block_id] = key
        self._chains[block_id] = cid
        return cid

    def cached_items(self) -> list[tuple[BlockKey, int]]:
        return list(self._cached.items())
