"""Per-request block tables over a BlockPool: prefix lookup, allocation, fork with copy-on-write, free."""

from __future__ import annotations

from array import array
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from pagedserve_common.defaults import DEFAULT_BLOCK_SIZE
from pagedserve_common.kv_geometry import blocks_before_window
from scheduler_svc.kv.block_pool import BlockPool

VALID_BLOCK_SIZES = tuple(2**i for i in range(3, 9))  # 8 .. 256


@dataclass(slots=True)
class PrefixHit:
    """The longest run of cached blocks from a prompt's start. Valid until the next allocation."""

    block_ids: list[int]
    num_tokens: int
    parent: object  # chain id of the last hit block, or the chain's root when nothing hit


@dataclass(slots=True, frozen=True)
class Allocation:
    """What one allocate() changed: blocks appended to the table, and copies the worker must run first."""

    new_block_ids: Sequence[int] = ()
    copies: Sequence[tuple[int, int]] = ()  # copy-on-write (src, dst) block pairs


NO_CHANGE = Allocation()


@dataclass(slots=True)
class _Seq:
    block_ids: list[int]
    num_tokens: int  # tokens the table covers: computed or scheduled this step
    num_cached_blocks: int  # leading full blocks already registered in (or found in) the prefix cache
    parent: object  # chain id of block num_cached_blocks - 1, or the chain's root
    cow_pending: bool = False  # forked onto a shared partial block: copy it before the first write
    # Leading logical blocks whose sliding groups' blocks were freed (their table entries are stale: never read).
    num_dropped: int = 0


def block_tokens(token_ids: Sequence[int], start: int, stop: int) -> bytes:
    """The tokens of one full block as its prefix-cache key holds them: int32 bytes.

    NOTE: bytes, not a tuple: a Request's tokens are array('i'), and a tuple of an array's slice boxes every id
    (~0.3 us a block against ~0.08 us for the bytes, bench/sched_scale.py); the same ids give the same bytes
    whether they come as an array or a list, so a key never depends on how the caller holds its tokens.
    """
    chunk = token_ids[start:stop]
    return chunk.tobytes() if type(chunk) is array else array("i", chunk).tobytes()


def _root(extra_key: object) -> object:
    # NOTE: chain ids are ints; the root is None or a tuple, so a root can never equal a chain id.
    return None if extra_key is None else ("extra", extra_key)


class BlockTables:
    """What every KV manager shares: the tables by request id, their queries and the prefix-query counters.
    A subclass sets `pool` and keeps its per-request state (with block_ids and num_tokens) in `_seqs`."""

    def __init__(self, block_size: int) -> None:
        if block_size not in VALID_BLOCK_SIZES:
            raise ValueError(f"block_size must be a power of two from 8 to 256, got {block_size}")
        self.block_size = block_size
        self._seqs: dict = {}
        self.prefix_query_tokens = 0
        self.prefix_hit_tokens = 0

    def __contains__(self, request_id: Hashable) -> bool:
        return request_id in self._seqs

    def block_table(self, request_id: Hashable) -> list[int]:
        return list(self._seqs[request_id].block_ids)

    def held_block_ids(self, request_id: Hashable) -> list[int]:
        """The blocks the request holds a reference on, in table order (here: its whole table)."""
        return self.block_table(request_id)

    def num_tokens(self, request_id: Hashable) -> int:
        return self._seqs[request_id].num_tokens

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


    def record_prefix_query(self, num_query_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_query_tokens += num_query_tokens
        self.prefix_hit_tokens += num_hit_tokens


class KVCacheManager(BlockTables):
    """Owns every request's block table (logical block i -> physical block id) on one worker's pool.

    NOTE: tables are append-only while a request runs, except that a forked request's first write into the
    partial block it shares replaces that last entry (copy-on-write) before the worker ever saw the old one.

    KV groups (pagedserve_common.kv_geometry.KVGroups; `group_windows`: each group's window, 0 for full attention):
    logical block i owns the num_groups consecutive entries i * num_groups + g of the table, one physical block per
    group (one group: the table is exactly the logical one). A sliding group's block that no future query can see
    (its last token < num_computed - window + 1, allocate()'s num_computed) is freed: its entry stays in the table,
    stale, and the worker's attention never reads it (every backend skips the blocks wholly before a window).
    A logical block is a prefix hit when every group's block for it is cached, but for the sliding groups' blocks
    wholly before the window of the hit's first query (find_prefix).
    """

    def __init__(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE, enable_prefix_caching: bool = True,
                 group_windows: Sequence[int] = (0,)) -> None:
        super().__init__(block_size)
        windows = set(group_windows) - {0}
        if not group_windows or len(windows) > 1 or min(group_windows) < 0:
            raise ValueError(f"group_windows must be one window >= 0 per KV group, at most one of them > 0 (a "
                             f"single sliding window), got {tuple(group_windows)}")
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self._seqs: dict[Hashable, _Seq] = {}
        self.num_groups = len(group_windows)
        self.window = windows.pop() if windows else 0
        self._sliding_groups = tuple(g for g, w in enumerate(group_windows) if w)

    def held_block_ids(self, request_id: Hashable) -> list[int]:
        """The blocks the request holds a reference on: its table less the stale entries of freed sliding blocks."""
        return self._live(self._seqs[request_id])

    def _live(self, seq: _Seq) -> list[int]:
        if not seq.num_dropped:
            return list(seq.block_ids)
        ng, sliding, end = self.num_groups, self._sliding_groups, seq.num_dropped * self.num_groups
        return [b for k, b in enumerate(seq.block_ids) if k >= end or k % ng not in sliding]

    def _num_droppable(self, num_computed: int | None) -> int:
        """Leading logical blocks wholly before the window of a query at position num_computed (and every later one)."""
        if not self.window or num_computed is None:
            return 0
        return blocks_before_window(num_computed, self.window, self.block_size)

    def _drop(self, seq: _Seq, num_computed: int | None) -> None:
        """Frees the sliding groups' blocks no query from position num_computed on can see, oldest first (so
        they are evicted first)."""
        target = self._num_droppable(num_computed)
        if target > seq.num_dropped:
            ng = self.num_groups
            self.pool.free([seq.block_ids[j * ng + g] for j in range(seq.num_dropped, target)
                            for g in self._sliding_groups])
            seq.num_dropped = target

    # -- queries ------------------------------------------------------------------------------------------
    def cached_prefix_len(self, token_ids: Sequence[int], extra_key: object = None) -> int:
        """Tokens of the prompt's prefix this pool holds now, as find_prefix() finds them; no side effects (no
        counters, no LRU change), so the router can ask every worker."""
        return self.find_prefix(token_ids, extra_key).num_tokens

    def find_prefix(self, token_ids: Sequence[int], extra_key: object = None,
                    max_tokens: int | None = None) -> PrefixHit:
        """The prompt's longest cached prefix of full blocks, of at most `max_tokens` tokens when given (a request
        whose prompt logprobs need the rows' logits). NOTE: never covers the last token, whose logits are needed; no
        side effects: the scheduler counts the query (record_prefix_query) once it admits the prompt."""
        parent = _root(extra_key)
        if not self.enable_prefix_caching:
            return PrefixHit([], 0, parent)
        limit = len(token_ids) - 1 if max_tokens is None else min(len(token_ids) - 1, max_tokens)
        if self.num_groups > 1:
            return self._find_grouped(token_ids, parent, limit)
        bs = self.block_size
        # NOTE: reads the pool's key map and chain ids directly: this loop runs once per block of every prompt.
        cached, chain_id = self.pool._cached, self.pool._chains
        block_ids: list[int] = []
        for start in range(0, limit // bs * bs, bs):
            bid = cached.get((parent, block_tokens(token_ids, start, start + bs)))
            if bid is None:
                break
            block_ids.append(bid)
            parent = chain_id[bid]
        return PrefixHit(block_ids, len(block_ids) * bs, parent)

    def _find_grouped(self, token_ids: Sequence[int], parent: object, limit: int) -> PrefixHit:
        """find_prefix with KV groups: a logical block hits when every group's block for it is cached, except a
        sliding group's block wholly before the window of the hit's first query (at the hit's end), which no query
        reads: that entry is stale from the start (never referenced, as _hit_seq makes it) and, where its block was
        evicted, holds group 0's block id of the same logical block instead (any id in the pool would do: no one
        reads it). Group 0's chain links the blocks; a sliding group 0 is needed whole (its chain is the key)."""
        bs, ng, cached, chain_id = self.block_size, self.num_groups, self.pool._cached, self.pool._chains
        optional = tuple(g for g in self._sliding_groups if g)  # needed only inside the window
        rows: list[list[int | None]] = []
        incomplete: list[int] = []  # the logical blocks with an optional group's block missing, ascending
        chain = [parent]
        for start in range(0, limit // bs * bs, bs):
            tokens = block_tokens(token_ids, start, start + bs)
            row = [cached.get((chain[-1], tokens))]
            if row[0] is None:
                break
            row.extend(cached.get(((chain[-1], g), tokens)) for g in range(1, ng))
            if any(row[g] is None for g in range(1, ng) if g not in optional):
                break
            if any(row[g] is None for g in optional):
                incomplete.append(len(rows))
            rows.append(row)
            chain.append(chain_id[row[0]])
        # the longest hit of n logical blocks whose blocks inside the window of a query at n * bs are all cached:
        # where block m < n is incomplete and inside that window, every hit of m + 1 .. n blocks is too (the window's
        # start only moves back as n shrinks), so the next candidate is m blocks
        n = len(rows)
        while incomplete and incomplete[-1] < n:
            if incomplete[-1] < blocks_before_window(n * bs, self.window, bs):
                break
            n = incomplete.pop()
        block_ids = [b if b is not None else row[0] for row in rows[:n] for b in row]
        return PrefixHit(block_ids, n * bs, chain[n])

    # -- allocation ---------------------------------------------------------------------------------------
    def _blocks_needed(self, request_id: Hashable, num_tokens: int, hit: PrefixHit | None,
                       num_computed: int | None = None) -> int:
        seq = self._seqs.get(request_id)
        ng = self.num_groups
        if seq is None:
            hit_ids = hit.block_ids if hit is not None else ()
            ref_cnt = self.pool._refs  # NOTE: hit blocks were handed out once: they have stored state
            # Cached free blocks that a hit revives leave the free pool too (not the stale ones: _start).
            revived = sum(1 for b in self._live(self._hit_seq(hit, num_computed)) if ref_cnt[b] == 0) if hit_ids else 0
            return self.num_blocks_for(num_tokens) * ng - len(hit_ids) + revived
        return self.num_blocks_for(num_tokens) * ng - len(seq.block_ids) + self._num_copies(seq, num_tokens)

    def _hit_seq(self, hit: PrefixHit, num_computed: int | None) -> _Seq:
        """A table that starts from `hit`, without references yet: blocks no query can see are stale at once."""
        num_dropped = min(self._num_droppable(num_computed), len(hit.block_ids) // self.num_groups)
        return _Seq(list(hit.block_ids), hit.num_tokens, len(hit.block_ids) // self.num_groups, hit.parent,
                    num_dropped=num_dropped)

    def _num_copies(self, seq: _Seq, num_tokens: int) -> int:
        """The shared partial blocks (one per group) to copy before writing up to `num_tokens`."""
        if not seq.cow_pending or num_tokens <= seq.num_tokens:
            return 0
        return sum(self._needs_copy(b) for b in seq.block_ids[-self.num_groups:])

    def _needs_copy(self, last: int) -> bool:
        """Whether a forked request's first write (cow_pending, past its tokens) must first copy the partial block
        `last` it was forked onto.

        NOTE: only the fork's parent writes such a block in place. A child writes in place only when it is the
        last holder and the block never entered the prefix cache: otherwise slots it would overwrite may be
        read by another request, or by a future prefix hit on the content the parent completed.
        """
        return self.pool._refs[last] > 1 or self.pool._keys[last] is not None

    def allocate(self, request_id: Hashable, num_tokens: int, token_ids: Sequence[int] | None = None,
                 hit: PrefixHit | None = None, extra_key: object = None,
                 num_computed: int | None = None) -> Allocation | None:
        """Grows the table of `request_id` to cover `num_tokens` tokens; None (and no change) when it can't.

        A new request starts from `hit` (from find_prefix()). `token_ids` are the request's known tokens; the full
        blocks among the first `num_tokens` of them enter the prefix cache. `num_computed`: the position of the
        step's first query (None: unknown); sliding groups' blocks before its window are freed first (even when
        the table cannot grow).
        """
        pool = self.pool
        seq = self._seqs.get(request_id)
        if seq is not None and self.window:  # NOTE: one test on the hot path of a model without windows
            self._drop(seq, num_computed)
        ng = self.num_groups
        if seq is not None and not seq.cow_pending and num_tokens <= len(seq.block_ids) // ng * self.block_size:
            # NOTE: the common step of a running sequence (a decode inside its last block): no block, no copy;
            # only a block it just filled may enter the prefix cache.
            if num_tokens < seq.num_tokens:
                raise ValueError(f"request {request_id}: num_tokens {num_tokens} < {seq.num_tokens} already held")
            seq.num_tokens = num_tokens
            self._cache_full_blocks(seq, token_ids)
            return NO_CHANGE
        if seq is None:
            seq = self._start(request_id, num_tokens, hit, extra_key, num_computed)
            if seq is None:
                return None
        if num_tokens < seq.num_tokens:
            raise ValueError(f"request {request_id}: num_tokens {num_tokens} < {seq.num_tokens} already held")
        block_ids = seq.block_ids
        num_new = (-(-num_tokens // self.block_size) - len(block_ids) // ng) * ng
        copies: list[tuple[int, int]] = []
        if seq.cow_pending and num_tokens > seq.num_tokens:
            if num_new + self._num_copies(seq, num_tokens) > pool.num_free_blocks:
                return None
            for k in range(len(block_ids) - ng, len(block_ids)):  # the last logical block: one per group
                if self._needs_copy(block_ids[k]):
                    src, dst = block_ids[k], pool.allocate(1)[0]
                    pool.free((src,))
                    block_ids[k] = dst
                    copies.append((src, dst))
            seq.cow_pending = False
        if num_new > 0:
            if num_new > pool.num_free_blocks:
                return None
            new_block_ids = pool.allocate(num_new)
            block_ids.extend(new_block_ids)
        else:
            new_block_ids = ()
        seq.num_tokens = num_tokens
        self._cache_full_blocks(seq, token_ids)
        if not copies and not new_block_ids:
            return NO_CHANGE
        return Allocation(new_block_ids, copies)

    def _start(self, request_id: Hashable, num_tokens: int, hit: PrefixHit | None,
               extra_key: object, num_computed: int | None = None) -> _Seq | None:
        """The table of a new request, from its prefix hit; None (and no table) when the pool can't hold
        `num_tokens` tokens of it. NOTE: hit blocks of sliding groups that no query can see are stale at once:
        never referenced."""
        if self._blocks_needed(request_id, num_tokens, hit, num_computed) > self.pool.num_free_blocks:
            return None
        if hit is None:
            seq = _Seq([], 0, 0, _root(extra_key))
        else:
            seq = self._hit_seq(hit, num_computed)
            self.pool.touch(self._live(seq))
        self._seqs[request_id] = seq
        return seq

    def _cache_full_blocks(self, seq: _Seq, token_ids: Sequence[int] | None) -> None:
        """Enters the full blocks of `seq`'s known tokens (`token_ids`, None: unknown) into the prefix cache."""
        if token_ids is not None and self.enable_prefix_caching:
            num_full = min(seq.num_tokens, len(token_ids)) // self.block_size
            if num_full > seq.num_cached_blocks:
                self._cache_blocks(seq, token_ids, num_full)

    def _cache_blocks(self, seq: _Seq, token_ids: Sequence[int], num_full: int) -> None:
        bs, pool, parent, ng = self.block_size, self.pool, seq.parent, self.num_groups
        for i in range(seq.num_cached_blocks, num_full):
            tokens = block_tokens(token_ids, i * bs, (i + 1) * bs)
            ids = seq.block_ids[i * ng:(i + 1) * ng]
            if i < seq.num_dropped and 0 in self._sliding_groups:  # its block is gone (never known whole): the
                parent = object()  # chain is cut; later blocks go under a parent no lookup can reach
                continue
            for g in range(1, ng):  # NOTE: never a stale entry: its block may belong to someone else now
                if i >= seq.num_dropped or g not in self._sliding_groups:
                    pool.cache(ids[g], ((parent, g), tokens))
            parent = pool.cache(ids[0], (parent, tokens))
        seq.parent = parent
        seq.num_cached_blocks = num_full

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        """`child_id` shares every block of `parent_id` (parallel sampling): one more reference each.

        The shared partial last block, if any, is copied when the child first writes into it; the parent
        keeps writing in place (its slots past the child's length are ones the child never reads).
        """
        if child_id in self._seqs:
            raise ValueError(f"request {child_id} already has a block table")
        p = self._seqs[parent_id]
        self.pool.touch(self._live(p))
        self._seqs[child_id] = _Seq(list(p.block_ids), p.num_tokens, p.num_cached_blocks, p.parent,
                                    cow_pending=p.num_tokens % self.block_size != 0, num_dropped=p.num_dropped)

    def free(self, request_id: Hashable) -> None:
        """Drops the request's table. NOTE: tail first, so a chain's tail is evicted before its head."""
        seq = self._seqs.pop(request_id)
        self.pool.free(reversed(self._live(seq)))
