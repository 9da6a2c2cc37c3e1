"""KV-cache capacity planning from a model's config.json: bytes per token, block, sequence, and what fits."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from pagedserve_common.kv_geometry import KVGeometry



def read_config(model_dir: str | Path) -> dict:
    with open(Path(model_dir) / "config.json") as f:
        return json.load(f)


def max_model_len_of(config: dict) -> int:
    """The model's longest sequence per its config (0 when it does not say)."""
    return (config.get("text_config") or config).get("max_position_embeddings", 0)


@dataclass(slots=True, frozen=True)
class KVPlan:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    seq_len: int
    bytes_per_token: int  # the scales of an 8-bit cache included
    scale_bytes_per_token: int  # of which scales (0 for a float cache)
    bytes_per_block: int
    blocks_per_sequence: int
    bytes_per_sequence: int  # whole blocks: what paging holds for one sequence of seq_len tokens (decoding)
    memory: int | None = None
    num_blocks: int | None = None
    num_tokens: int | None = None
    num_sequences: int | None = None  # paged: sequences of seq_len tokens that fit at once
    max_model_len: int | None = None
    contiguous_num_sequences: int | None = None  # each sequence preallocated at max_model_len

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def plan(geometry: KVGeometry, seq_len: int, memory: int | None = None, max_model_len: int = 0) -> KVPlan:
    """What one sequence of seq_len tokens costs, and with `memory` what fits: paged (whole blocks per sequence)
    against contiguous preallocation at max_model_len (seq_len when 0)."""
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    per_token, block_size = geometry.bytes_per_token, geometry.block_size
    per_block = geometry.bytes_per_block  # KV groups: one group's layers
    # NOTE: a sliding group (KVGeometry.groups) holds at most ceil(window / block_size) + 1 blocks of a decoding
    # sequence (scheduler_svc.kv.manager frees the rest); a full group, every block
    num_logical = -(-seq_len // block_size)
    blocks_per_seq = sum(min(num_logical, -(-w // block_size) + 1) if w else num_logical
                         for w in geometry.groups.windows)
    fit = {}
    if memory is not None:
        num_blocks = memory // per_block
        max_len = max_model_len or seq_len
        fit = dict(memory=memory, num_blocks=num_blocks,
                   num_tokens=num_blocks // geometry.groups.num_groups * block_size,  # of every layer
                   num_sequences=num_blocks // blocks_per_seq, max_model_len=max_len,
                   contiguous_num_sequences=memory // (max_len * per_token))
    return KVPlan(num_layers=geometry.num_layers, num_kv_heads=geometry.num_kv_heads, head_dim=geometry.head_dim,
                  dtype=geometry.dtype, block_size=block_size, seq_len=seq_len, bytes_per_token=per_token,
                  scale_bytes_per_token=geometry.scale_bytes_per_token,
                  bytes_per_block=per_block, blocks_per_sequence=blocks_per_seq,
                  bytes_per_sequence=blocks_per_seq * per_block, **fit)
