"""A worker's KV pool as plain per-block lists, and its figures: what `pagedserve kv-map` (and bench frames) draw.

Pure Python, no grpc import: `KVSnapshot.from_pb(msg)` takes a `pagedserve.v1.KVState` message (read by attribute,
so any object with its fields does), and `figures(snapshot)` the numbers shown beside the map.

Per block b (0 <= b < num_blocks), in plain lists:
  - `owner[b]`: index into `request_ids` of the first sequence (admission order) whose table holds b; FREE (-1)
    for a free block, CACHED (-2) for a free block still in the prefix cache, UNLISTED (-3) for a used block no
    listed sequence holds (never expected; drawn as used, full);
  - `filled[b]`: token slots of b holding a token (0..block_size; 0 when free; a block shared by several
    tables counts the longest of them);
  - `ref_counts[b]`: block tables holding b (capped at 255); > 1 means shared (prefix hit, parallel samples);
  - `cached[b]`: 1 when b is in the prefix cache, else 0.
Colours: `owner_colour(request_id)` is a stable xterm-256 colour index, `xterm_rgb(index)` its (r, g, b).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field

FREE = -1
CACHED = -2
UNLISTED = -3


@dataclass(slots=True)
class KVSequence:
    """One live sequence's block table: logical block i is physical block block_ids[i]."""

    request_id: str
    seq_id: int
    block_ids: list[int]
    num_tokens: int  # tokens the table holds (the step in flight included); slots past it are empty
    tenant: str = ""  # whose service it counts as (--scheduling-policy fair); "": the shared tenant


@dataclass(slots=True)
class KVSnapshot:
    """One worker's pool at one instant between steps (see the module docstring for the per-block lists)."""

    worker_id: str
    block_size: int
    num_blocks: int
    owner: list[int]
    filled: list[int]
    ref_counts: list[int]
    cached: list[int]
    request_ids: list[str]  # distinct requests holding blocks, in admission order (owner indexes into it)
    sequences: list[KVSequence] = field(default_factory=list)  # in admission order
    kv_allocation: str = "paged"
    num_steps: int = 0
    num_waiting: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    num_evictions: int = 0
    num_preemptions: int = 0
    num_prefill_tokens: int = 0
    time: float = 0.0  # the server's wall clock, seconds since the epoch
    waiting_for_blocks: bool = False  # the last step left the queue head waiting for free blocks
    kv_cache_dtype: str = ""  # the worker's cache element type ('' from a server that does not say)
    bytes_per_token: int = 0  # KV bytes per token, an 8-bit cache's scales included (0: not said)
    num_kv_groups: int = 1  # blocks per logical block (KV groups); sequences then list the blocks they hold

    @classmethod
    def build(cls, worker_id: str, block_size: int, ref_counts: list[int], cached: list[int],
              sequences: list[KVSequence], **counters) -> KVSnapshot:
        """Derives owner/filled from the ref counts, cached flags and block tables; `counters` are the other
        fields (kv_allocation, num_steps, ...). Tests and benchmarks build snapshots by hand with it."""
        n = len(ref_counts)
        if len(cached) != n:
            raise ValueError(f"{len(cached)} cached flags for {n} blocks")
        ref_counts, cached = list(ref_counts), list(cached)
        owner = [UNLISTED if rc else CACHED if c else FREE for rc, c in zip(ref_counts, cached)]
        filled = [0] * n
        request_ids: list[str] = []
        index: dict[str, int] = {}
        num_groups = max(1, counters.get("num_kv_groups", 1))
        for seq in sequences:
            i = index.get(seq.request_id)
            if i is None:
                i = index[seq.request_id] = len(request_ids)
                request_ids.append(seq.request_id)
            num_logical, num_held = -(-seq.num_tokens // block_size), len(seq.block_ids)
            for k, b in enumerate(seq.block_ids):
                # KV groups: the last num_groups blocks are the last logical block's; the others are full
                logical = k if num_groups == 1 else num_logical - 1 - (num_held - 1 - k) // num_groups
                if not 0 <= b < n:
                    raise ValueError(f"sequence {seq.seq_id}: block {b} outside the pool of {n}")
                if owner[b] == UNLISTED:  # NOTE: the first holder in admission order owns a shared block
                    owner[b] = i
                tokens = min(max(seq.num_tokens - logical * block_size, 0), block_size)
                if tokens > filled[b]:
                    filled[b] = tokens
        for b in range(n):
            if owner[b] == UNLISTED:
                filled[b] = block_size
        return cls(worker_id, block_size, n, owner, filled, ref_counts, cached, request_ids, list(sequences),
                   **counters)

    @classmethod
    def from_pb(cls, pb) -> KVSnapshot:
        """From a pagedserve.v1.KVState message."""
        if len(pb.ref_counts) != pb.num_blocks:
            raise ValueError(f"{len(pb.ref_counts)} ref counts for {pb.num_blocks} blocks")
        sequences = [KVSequence(s.request_id, s.seq_id, list(s.block_ids), s.num_tokens, s.tenant)
                     for s in pb.sequences]
        return cls.build(pb.worker_id, pb.block_size, list(pb.ref_counts), list(pb.cached), sequences,
                         kv_allocation=pb.kv_allocation or "paged", num_steps=pb.num_steps,
                         num_waiting=pb.num_waiting, prefix_query_tokens=pb.prefix_query_tokens,
                         prefix_hit_tokens=pb.prefix_hit_tokens, num_evictions=pb.num_evictions,
                         num_preemptions=pb.num_preemptions, num_prefill_tokens=pb.num_prefill_tokens,
                         time=pb.time, waiting_for_blocks=pb.waiting_for_blocks,
                         kv_cache_dtype=pb.kv_cache_dtype, bytes_per_token=pb.bytes_per_token,
                         num_kv_groups=pb.num_kv_groups or 1)


def largest_free_run(ref_counts: list[int]) -> int:
    """The longest run of consecutive block ids with ref count 0 (cached free blocks included)."""
    best = run = 0
    for rc in ref_counts:
        run = run + 1 if rc == 0 else 0
        if run > best:
            best = run
    return best


def _share(part: int, whole: int) -> float:
    return part / whole if whole else 0.0


def figures(s: KVSnapshot) -> dict:
    """The numbers beside the map, by key:
      block_size, num_blocks, kv_allocation, num_steps, kv_cache_dtype, bytes_per_token;
      num_used_blocks (ref count >= 1), num_shared_blocks (ref count >= 2), num_free_blocks (ref count 0, cached
        ones included: what an allocation can take), num_cached_free_blocks (of those, in the prefix cache);
      num_running (listed sequences), num_waiting, waiting_for_blocks (the queue head waited for free blocks at
        the last step);
      num_slots_allocated (used blocks x block_size), num_slots_filled (slots holding a token),
        slot_utilization = filled / allocated, internal_fragmentation = 1 - slot_utilization (0.0 when nothing
        is allocated);
      largest_free_run (consecutive free block ids), external_fragmentation = free blocks outside the largest
        free run / free blocks (0.0 with none free). NOTE: computed alike for every mode; it only costs a
        static allocator, which needs contiguous runs; a paged one takes any free block, so there it is 0 in
        effect whatever the number says;
      prefix_query_tokens, prefix_hit_tokens, prefix_hit_rate = hit / query (0.0 before any query);
      num_evictions, num_preemptions, num_prefill_tokens.
    """
    rc, bs = s.ref_counts, s.block_size
    num_used = sum(1 for r in rc if r)
    num_free = s.num_blocks - num_used
    allocated = num_used * bs
    filled_slots = sum(f for f, r in zip(s.filled, rc) if r)
    run = largest_free_run(rc)
    utilization = _share(filled_slots, allocated)
    return {
        "block_size": bs, "num_blocks": s.num_blocks, "kv_allocation": s.kv_allocation, "num_steps": s.num_steps,
        "kv_cache_dtype": s.kv_cache_dtype, "bytes_per_token": s.bytes_per_token,
        "num_used_blocks": num_used, "num_shared_blocks": sum(1 for r in rc if r > 1),
        "num_free_blocks": num_free,
        "num_cached_free_blocks": sum(1 for r, c in zip(rc, s.cached) if not r and c),
        "num_running": len(s.sequences), "num_waiting": s.num_waiting, "waiting_for_blocks": s.waiting_for_blocks,
        "num_slots_allocated": allocated, "num_slots_filled": filled_slots, "slot_utilization": utilization,
        "internal_fragmentation": 1.0 - utilization if allocated else 0.0,
        "largest_free_run": run, "external_fragmentation": _share(num_free - run, num_free),
        "prefix_query_tokens": s.prefix_query_tokens, "prefix_hit_tokens": s.prefix_hit_tokens,
        "prefix_hit_rate": _share(s.prefix_hit_tokens, s.prefix_query_tokens),
        "num_evictions": s.num_evictions, "num_preemptions": s.num_preemptions,
        "num_prefill_tokens": s.num_prefill_tokens,
    }


# xterm-256 colours 16..231 are a 6x6x6 cube; PALETTE keeps the bright, saturated ones (legible on black and
# on white, never grey), so two requests rarely look alike.
_LEVELS = (0, 95, 135, 175, 215, 255)
PALETTE = tuple(16 + 36 * r + 6 * g + b for r in range(6) for g in range(6) for b in range(6)
                if max(r, g, b) >= 3 and max(r, g, b) - min(r, g, b) >= 2)


def owner_colour(request_id: str) -> int:
    """A stable xterm-256 colour index for a request (crc32: the same in every process, unlike hash())."""
    return PALETTE[zlib.crc32(request_id.encode()) % len(PALETTE)]


def xterm_rgb(index: int) -> tuple[int, int, int]:
    """The (r, g, b) of an xterm-256 colour index of the cube (16..231) or the grey ramp (232..255)."""
    if 16 <= index <= 231:
        i = index - 16
        return _LEVELS[i // 36], _LEVELS[i // 6 % 6], _LEVELS[i % 6]
    if 232 <= index <= 255:
        v = 8 + 10 * (index - 232)
        return v, v, v
    raise ValueError(f"xterm_rgb covers colours 16..255, got {index}")
