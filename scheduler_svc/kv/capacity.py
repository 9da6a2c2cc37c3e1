"""KV-cache capacity planning from a model's config.json: bytes per token, block, sequence, and what fits."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from pagedserve_common.defaults import DEFAULT_BLOCK_SIZE

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}


@dataclass(slots=True, frozen=True)
class KVShape:
    num_layers: int
    num_kv_heads: int  # NOTE: grouped-query attention stores kv heads, not attention heads
    head_dim: int
    max_model_len: int
    dtype: str

    @classmethod
    def from_config(cls, config: dict, dtype: str | None = None) -> KVShape:
        cfg = config.get("text_config", config)  # multimodal configs nest the language model's
        heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // heads
        dtype = dtype or str(cfg.get("dtype") or cfg.get("torch_dtype") or config.get("torch_dtype") or "float16")
        if dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {dtype!r}")
        return cls(num_layers=cfg["num_hidden_layers"], num_kv_heads=cfg.get("num_key_value_heads") or heads,
                   head_dim=head_dim, max_model_len=cfg.get("max_position_embeddings", 0), dtype=dtype)

    @classmethod
    def from_model_dir(cls, model_dir: str | Path, dtype: str | None = None) -> KVShape:
        with open(Path(model_dir) / "config.json") as f:
            return cls.from_config(json.load(f), dtype)

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x dtype bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]


@dataclass(slots=True, frozen=True)
class KVPlan:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    block_size: int
    seq_len: int
    bytes_per_token: int
    bytes_per_block: int
    blocks_per_sequence: int
    bytes_per_sequence: int  # whole blocks: what paging reserves for one sequence of seq_len tokens
    memory: int | None = None
    num_blocks: int | None = None
    num_tokens: int | None = None
    num_sequences: int | None = None  # paged: sequences of seq_len tokens that fit at once
    max_model_len: int | None = None
    contiguous_num_sequences: int | None = None  # each sequence preallocated at max_model_len

    def to_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if v is not None}


def plan(shape: KVShape, seq_len: int, block_size: int = DEFAULT_BLOCK_SIZE, memory: int | None = None) -> KVPlan:
    if seq_len < 1:
        raise ValueError(f"seq_len must be >= 1, got {seq_len}")
    per_token = shape.bytes_per_token
    per_block = per_token * block_size
    blocks_per_seq = -(-seq_len // block_size)
    fit = {}
    if memory is not None:
        num_blocks = memory // per_block
        max_len = shape.max_model_len or seq_len
        fit = dict(memory=memory, num_blocks=num_blocks, num_tokens=num_blocks * block_size,
                   num_sequences=num_blocks // blocks_per_seq, max_model_len=max_len,
                   contiguous_num_sequences=memory // (max_len * per_token))
    return KVPlan(num_layers=shape.num_layers, num_kv_heads=shape.num_kv_heads, head_dim=shape.head_dim,
                  dtype=shape.dtype, block_size=block_size, seq_len=seq_len, bytes_per_token=per_token,
                  bytes_per_block=per_block, blocks_per_sequence=blocks_per_seq,
                  bytes_per_sequence=blocks_per_seq * per_block, **fit)
