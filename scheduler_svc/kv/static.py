"""Contiguous KV reservations per sequence (FasterTransformer/Orca style), to compare with paging on one pool."""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from pagedserve_common.config import KV_ALLOCATIONS
from pagedserve_common.defaults import DEFAULT_BLOCK_SIZE
from scheduler_svc.kv.manager import NO_CHANGE, Allocation, BlockTables, PrefixHit
from scheduler_svc.kv.run_pool import RunPool

# SchedulerConfig.kv_allocation (pagedserve_common.config.KV_ALLOCATIONS): the static modes use StaticKVCacheManager.
STATIC_KV_ALLOCATIONS = KV_ALLOCATIONS[1:]


@dataclass(slots=True)
class _Run:
    block_ids: list[int]  # consecutive ids, reserved whole at admission
    num_tokens: int = 0  # tokens the table covers: computed or scheduled this step
    handed_out: bool = False  # allocate() has returned the run once (as new_block_ids)


class StaticKVCacheManager(BlockTables):
    """KVCacheManager's interface over a RunPool: each sequence holds ONE run of consecutive block ids, reserved
    whole before its first token (reserve(), or its first allocate()), so its block table never grows while the
    reservation covers it. No prefix cache, no forks, no sharing.

    NOTE: the worker still gets block tables: contiguity is only this manager's choice of ids. A sequence that
    outgrows its run (its reservation was too short) grows in place if the blocks after it are free; otherwise
    allocate() returns None and the scheduler preempts, as with paging.
    """

    enable_prefix_caching = False

    def __init__(self, num_blocks: int, block_size: int = DEFAULT_BLOCK_SIZE) -> None:
        super().__init__(block_size)
        self.pool = RunPool(num_blocks)
        self._seqs: dict[Hashable, _Run] = {}

    # -- queries ------------------------------------------------------------------------------------------
    def find_prefix(self, token_ids: Sequence[int], extra_key: object = None,
                    max_tokens: int | None = None) -> PrefixHit:
        return PrefixHit([], 0, None)  # NOTE: no prefix cache: every prompt is computed whole

    def cached_prefix_len(self, token_ids: Sequence[int], extra_key: object = None) -> int:
        return 0

    # -- allocation ---------------------------------------------------------------------------------------
    def _num_reserved_blocks(self, num_tokens: int) -> int:
        return max(1, self.num_blocks_for(num_tokens))

    def reserve(self, request_id: Hashable, num_tokens: int) -> bool:
        """Reserves a new sequence's run for `num_tokens` tokens: the lowest-starting hole that is long enough.
        False (and no change) when none is, even if the holes add up to enough blocks: the sequence waits."""
        if request_id in self._seqs:
            raise ValueError(f"request {request_id} already has a block table")
        num_blocks = self._num_reserved_blocks(num_tokens)
        if not self.pool.can_allocate(num_blocks):
            return False
        self._seqs[request_id] = _Run(self.pool.allocate(num_blocks))
        return True

    def allocate(self, request_id: Hashable, num_tokens: int, token_ids: Sequence[int] | None = None,
                 hit: PrefixHit | None = None, extra_key: object = None,
                 num_computed: int | None = None) -> Allocation | None:
        """Covers `num_tokens` tokens of `request_id`; None (and no change) when it can't. A sequence not yet
        reserved first reserves exactly `num_tokens`. The first call hands out the whole run as new_block_ids;
        later ones return NO_CHANGE while the run covers the tokens. `token_ids`, `hit`, `extra_key` and `num_computed` are
        accepted for KVCacheManager's interface (hits are always empty here)."""
        run = self._seqs.get(request_id)
        if run is None:
            if not self.reserve(request_id, num_tokens):
                return None
            run = self._seqs[request_id]
        if num_tokens < run.num_tokens:
            raise ValueError(f"request {request_id}: num_tokens {num_tokens} < {run.num_tokens} already held")
        more = self.num_blocks_for(num_tokens) - len(run.block_ids)
        grown: list[int] = []
        if more > 0:  # outgrew its reservation: only the blocks right after the run will do
            end = run.block_ids[-1] + 1
            if self.pool.free_run_at(end) < more:
                return None
            grown = self.pool.allocate_at(end, more)
            run.block_ids.extend(grown)
        run.num_tokens = num_tokens
        if not run.handed_out:
            run.handed_out = True
            return Allocation(list(run.block_ids))
        return Allocation(grown) if grown else NO_CHANGE

    def fork(self, parent_id: Hashable, child_id: Hashable) -> None:
        raise ValueError("contiguous KV reservations do not support forks (n > 1)")

    def free(self, request_id: Hashable) -> None:
        """Returns the sequence's run to the pool, merged with the holes next to it."""
        self.pool.free(self._seqs.pop(request_id).block_ids)
