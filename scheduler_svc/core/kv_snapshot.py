"""A read-only picture of one worker's KV pool between two steps: what GetKVState answers (no protobuf here)."""

from __future__ import annotations

import itertools
import operator
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedserve_common.kv_geometry import KVGeometry
    from scheduler_svc.core.scheduler import Scheduler


# NOTE: the largest pool a snapshot describes (GetKVState refuses a larger one: FAILED_PRECONDITION). Its per-block
# bytes take ~40 ms to build at 1 Mi blocks once every block has been used (measured on 2 loaded cores; ~150 ms at
# 4 Mi), on the event loop that runs every step, and make 2 MiB: within a client's default 4 MiB message.
MAX_SNAPSHOT_BLOCKS = 1 << 20


@dataclass(slots=True)
class SequenceBlocks:
    """One live sequence's block table."""

    request_id: str
    seq_id: int
    block_ids: list[int]  # the blocks it holds, in table order (KV groups: without the freed sliding ones)
    num_tokens: int  # tokens the table covers (those of the step in flight included)
    tenant: str = ""  # whose service it counts as (the fair policy); "": the shared tenant


@dataclass(slots=True)
class KVPoolSnapshot:
    worker_id: str
    block_size: int
    num_blocks: int
    ref_counts: bytes  # one byte per block, capped at 255
    cached: bytes  # one byte per block: 1 when it is in the prefix cache
    sequences: list[SequenceBlocks]  # in admission order
    kv_allocation: str
    num_steps: int
    num_waiting: int
    prefix_query_tokens: int
    prefix_hit_tokens: int
    num_evictions: int
    num_preemptions: int
    num_prefill_tokens: int
    time: float  # wall clock, seconds since the epoch
    waiting_for_blocks: bool = False  # the last step left the queue head waiting for free blocks
    kv_cache_dtype: str = ""  # the worker's cache element type ("int8", ...), as it registered
    bytes_per_token: int = 0  # KV bytes per token, an 8-bit cache's scales included
    num_kv_groups: int = 1  # blocks per logical block (KVGeometry.groups): a sliding-window model's may be more


def ref_count_bytes(ref_cnt: list[int]) -> bytes:
    """One byte per block, capped at 255. NOTE: bytes(list) runs in C (8 ms for a million blocks); only a pool
    with a block held by 256+ tables takes the slower capped copy."""
    try:
        return bytes(ref_cnt)
    except ValueError:
        return bytes([rc if rc < 256 else 255 for rc in ref_cnt])


def cached_bytes(block_key: list) -> bytes:
    """1 for each block with a prefix-cache key, else 0 (map in C: ~30 ms for a million blocks)."""
    return bytes(map(operator.is_not, block_key, itertools.repeat(None)))


def snapshot(worker_id: str, scheduler: Scheduler, geometry: KVGeometry | None = None,
             tenant: str | None = None) -> KVPoolSnapshot:
    """The pool of `scheduler` as it is now; `tenant`: only that tenant's sequences listed (None: every tenant's).
    NOTE: call it on the scheduler's event loop: schedule() and update() run synchronously there, so the picture
    is always between two of them (a step may be in flight: its tokens count in num_tokens, as they do in the block
    tables the worker was sent)."""
    kv = scheduler.kv
    pool = kv.pool
    # NOTE: running sequences hold block tables (swapped-out and waiting ones hold none), in admission order. A
    # sequence shows the id its client sent, not the engine's tenant-scoped one.
    sequences = [SequenceBlocks(req.client_request_id, req.seq_id, kv.held_block_ids(req.seq_id),
                                kv.num_tokens(req.seq_id), req.tenant)
                 for req in scheduler.running if req.seq_id in kv and tenant in (None, req.tenant)]
    # NOTE: blocks never handed out have no stored state (BlockPool): zeros, written in C, not walked.
    refs, keys = pool.stored_state()
    never_used = bytes(pool.num_blocks - len(refs))
    return KVPoolSnapshot(
        worker_id=worker_id, block_size=kv.block_size, num_blocks=pool.num_blocks,
        ref_counts=ref_count_bytes(refs) + never_used, cached=cached_bytes(keys) + never_used, sequences=sequences,
        kv_allocation=scheduler.config.kv_allocation, num_steps=scheduler.steps,
        num_waiting=scheduler.num_waiting, prefix_query_tokens=kv.prefix_query_tokens,
        prefix_hit_tokens=kv.prefix_hit_tokens, num_evictions=pool.num_evictions,
        num_preemptions=scheduler.num_preemptions, num_prefill_tokens=scheduler.num_prefill_tokens,
        time=time.time(), waiting_for_blocks=scheduler.waiting_for_blocks,
        kv_cache_dtype=geometry.dtype if geometry else "", bytes_per_token=geometry.bytes_per_token if geometry else 0,
        num_kv_groups=len(scheduler.config.kv_group_windows))
