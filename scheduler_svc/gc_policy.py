"""The scheduler process's garbage-collector policy: long-lived objects frozen, so full collections stay short."""

from __future__ import annotations

import gc
import sys
from dataclasses import dataclass

# NOTE: a full walk of the frozen objects is made once the heap has grown by this factor since the last one: the
# bound on cyclic garbage that can hide among them (see settle()).
REWALK_GROWTH = 2.0


@dataclass(slots=True)
class FreezeSurvivors:
    """A gc callback: after each full collection, freezes its survivors; before one, once the heap has grown by
    REWALK_GROWTH since the last full walk, unfreezes everything so that this one walks it all.

    NOTE: the heap is measured in pymalloc blocks (sys.getallocatedblocks(): ~0.5 ms, it counts arenas), not in
    frozen objects (gc.get_freeze_count() walks them all: ~20 ms at 600,000)."""

    num_blocks_walked: int  # allocated blocks right after the last full walk
    rewalk: bool = False
    num_rewalks: int = 0

    def __call__(self, phase: str, info: dict) -> None:
        if info["generation"] != 2:
            return
        if phase == "start":
            if sys.getallocatedblocks() > REWALK_GROWTH * self.num_blocks_walked:
                gc.unfreeze()
                self.rewalk = True
            return
        gc.freeze()
        if self.rewalk:
            self.num_blocks_walked, self.rewalk = sys.getallocatedblocks(), False
            self.num_rewalks += 1


def settle() -> FreezeSurvivors:
    """Sets the policy; call once the process has started up (imports, engine, servers), before it serves.

    NOTE: the policy, measured by bench/sched_scale.py (batch 1,024, 100,000 queued requests, 1,000,000 blocks,
    ~600,000 tracked objects): a full collection walks every tracked container it holds, ~130 ms there, against a
    ~7 ms step, and CPython runs one each time the objects promoted since the last reach 25% of the heap, which a
    steady turnover of requests does again and again. Hence:
    - start-up's objects, then each full collection's survivors, are frozen (gc.freeze): a full collection walks
      only what was promoted since the one before (a few ms at most), never the queue, the pool or the modules;
    - frozen objects are still freed by refcounting: a finished request is (it holds no reference cycle:
      Request.parent is cut when a forked request finishes), and a token list is array('i'), one object;
    - cyclic garbage that forms among frozen objects (asyncio, grpc, exceptions) is not freed until the next full
      walk, which comes once the heap has doubled (REWALK_GROWTH) since the last: such garbage stays below the
      live heap's size. That walk is the one long pause left, and it comes only while the heap grows
      (logarithmically often), not in a steady state.
    Young collections keep CPython's thresholds: they are short, and free the short-lived cycles.
    """
    for cb in [cb for cb in gc.callbacks if isinstance(cb, FreezeSurvivors)]:
        gc.callbacks.remove(cb)  # NOTE: idempotent: a second call replaces the first
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    policy = FreezeSurvivors(sys.getallocatedblocks())
    gc.callbacks.append(policy)
    return policy
