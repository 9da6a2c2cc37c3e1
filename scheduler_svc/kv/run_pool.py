"""A BlockPool that hands out contiguous runs of block ids, first fit: the free space is a list of holes."""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Iterable

from scheduler_svc.kv.block_pool import BlockPool


class RunPool(BlockPool):
    """N blocks with ids 0..N-1, handed out as runs of consecutive ids: the lowest-starting hole that is long
    enough (first fit). No prefix cache and no sharing: a block is used (ref count 1) or free in one hole.

    NOTE: the holes are sorted, disjoint and never adjacent (a freed run merges with its neighbours), so a run
    that fits nowhere fits nowhere even though the holes may add up to enough blocks: external fragmentation.
    The base class's counters, ref_cnt and block_key stay meaningful; its free queue stays empty. Per-block
    state is stored up to the highest id ever handed out (BlockPool._grow).
    """

    __slots__ = ("_holes", "_num_free")

    def __init__(self, num_blocks: int) -> None:
        super().__init__(num_blocks)
        self._next_fresh = num_blocks  # NOTE: the holes replace the free queue (and its counter of fresh ids)
        self._holes: list[tuple[int, int]] = [(0, num_blocks)]  # (start, end): free blocks start..end-1
        self._num_free = num_blocks

    # -- accounting ---------------------------------------------------------------------------------------
    @property
    def num_free_blocks(self) -> int:
        return self._num_free

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self._num_free

    def holes(self) -> list[tuple[int, int]]:
        """The free runs as (first block id, number of blocks), lowest first (for inspection and tests)."""
        return [(start, end - start) for start, end in self._holes]

    @property
    def largest_free_run(self) -> int:
        return max((end - start for start, end in self._holes), default=0)

    def free_run_at(self, start: int) -> int:
        """How many free blocks follow from block `start` on (0 when `start` is used or out of range)."""
        holes = self._holes
        i = bisect.bisect_right(holes, (start, self.num_blocks + 1)) - 1
        if i < 0 or holes[i][1] <= start:
            return 0
        return holes[i][1] - start

    # -- allocation ---------------------------------------------------------------------------------------
    def can_allocate(self, num_blocks: int) -> bool:
        """Whether one run of `num_blocks` consecutive free blocks exists (not merely that many free blocks)."""
        return num_blocks <= 0 or any(end - start >= num_blocks for start, end in self._holes)

    def allocate(self, num_blocks: int) -> list[int]:
        """Takes the first `num_blocks` blocks of the lowest-starting hole that holds them, at ref count 1."""
        if num_blocks <= 0:
            return []
        for start, end in self._holes:
            if end - start >= num_blocks:
                return self.allocate_at(start, num_blocks)
        raise RuntimeError(f"no run of {num_blocks} free blocks (the longest has {self.largest_free_run}; "
                           f"{self._num_free} free in all)")

    def allocate_at(self, start: int, num_blocks: int) -> list[int]:
        """Takes blocks start..start+num_blocks-1, which must all be free (to grow a run in place)."""
        holes = self._holes
        i = bisect.bisect_right(holes, (start, self.num_blocks + 1)) - 1
        if i < 0 or holes[i][1] < start + num_blocks:
            raise RuntimeError(f"blocks {start}..{start + num_blocks - 1} are not all free")
        hole_start, hole_end = holes[i]
        # The hole keeps what lies before and after the taken run.
        parts = [p for p in ((hole_start, start), (start + num_blocks, hole_end)) if p[0] < p[1]]
        holes[i:i + 1] = parts
        self._grow(start + num_blocks)
        self._refs[start:start + num_blocks] = itertools.repeat(1, num_blocks)
        self._num_free -= num_blocks
        return list(range(start, start + num_blocks))

    def touch(self, block_ids: Iterable[int]) -> None:
        raise NotImplementedError("blocks of contiguous runs are never shared")

    def cache(self, block_id: int, key) -> int:
        raise NotImplementedError("contiguous runs have no prefix cache")

    def free(self, block_ids: Iterable[int]) -> None:
        """Drops one reference on each block; blocks at ref count 0 go back into the holes, merged."""
        ref_cnt, freed = self._refs, []
        for bid in block_ids:
            if not 0 <= bid < len(ref_cnt) or ref_cnt[bid] < 1:
                raise RuntimeError(f"block {bid} freed more times than it was referenced")
            ref_cnt[bid] -= 1
            if ref_cnt[bid] == 0:
                freed.append(bid)
        freed.sort()
        first = 0
        for k in range(1, len(freed) + 1):  # one hole per run of consecutive ids
            if k == len(freed) or freed[k] != freed[k - 1] + 1:
                self._add_hole(freed[first], freed[k - 1] + 1)
                first = k
        self._num_free += len(freed)

    def _add_hole(self, start: int, end: int) -> None:
        holes = self._holes
        i = bisect.bisect_left(holes, (start, start))
        if i < len(holes) and holes[i][0] == end:  # touches the next hole
            end = holes.pop(i)[1]
        if i > 0 and holes[i - 1][1] == start:  # touches the previous one
            holes[i - 1] = (holes[i - 1][0], end)
        else:
            holes.insert(i, (start, end))
