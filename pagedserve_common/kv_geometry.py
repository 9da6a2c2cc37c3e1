"""The shape of a model's KV cache, one definition for the worker's pool and the scheduler's capacity plans."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve_common.defaults import DEFAULT_BLOCK_SIZE

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1}


@dataclass(slots=True, frozen=True)
class KVGeometry:
    num_layers: int
    num_kv_heads: int  # NOTE: grouped-query attention stores kv heads, not attention heads
    head_dim: int
    dtype: str  # a DTYPE_BYTES key, e.g. "float16"
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")

    @classmethod
    def from_config(cls, config: dict, dtype: str | None = None, block_size: int = DEFAULT_BLOCK_SIZE) -> KVGeometry:
        """From a HuggingFace config.json (as a dict); `dtype` defaults to the checkpoint's."""
        cfg = config.get("text_config") or config  # NOTE: multimodal configs nest the language model's
        heads = cfg["num_attention_heads"]
        dtype = dtype or str(cfg.get("dtype") or cfg.get("torch_dtype") or config.get("torch_dtype") or "float16")
        return cls(num_layers=cfg["num_hidden_layers"], num_kv_heads=cfg.get("num_key_value_heads") or heads,
                   head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, dtype=dtype.removeprefix("torch."),
                   block_size=block_size)

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x dtype bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype]

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def num_blocks_for(self, kv_memory: int) -> int:
        """Whole blocks in a byte budget."""
        return kv_memory // self.bytes_per_block
