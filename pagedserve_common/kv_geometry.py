"""The shape of a model's KV cache, one definition for the worker's pool and the scheduler's capacity plans."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve_common.defaults import DEFAULT_BLOCK_SIZE

# The KV cache's element types (--kv-cache-dtype) and their bytes per element.
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "int8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1}
# The 8-bit caches store each (token, kv head) row of K and of V as codes plus ONE float32 scale: x = code x scale.
# NOTE: why per token and kv head (not per tensor, not per channel): docs/performance.md, "What was tried" (the
# 8-bit cache's scales). It is written with its token, so a block's bytes never change after they are written,
# and a prefix hit, a copy-on-write copy or a swap moves a block's scales with it, exactly.
QUANTIZED_DTYPES = ("int8", "fp8_e4m3", "fp8_e5m2")
SCALE_BYTES = 4  # one float32 per (token, kv head) of K and of V
# What each 8-bit code spans: the largest magnitude it represents (the scale maps a row's absmax there).
QUANT_MAX = {"int8": 127.0, "fp8_e4m3": 448.0, "fp8_e5m2": 57344.0}


@dataclass(slots=True, frozen=True)
class KVGeometry:
    num_layers: int
    num_kv_heads: int  # NOTE: grouped-query attention stores kv heads, not attention heads
    head_dim: int
    dtype: str  # the cache's element type, a DTYPE_BYTES key, e.g. "float16" or "int8"
    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")

    @classmethod
    def from_config(cls, config: dict, dtype: str | None = None, block_size: int = DEFAULT_BLOCK_SIZE) -> KVGeometry:
        """From a HuggingFace config.json (as a dict); `dtype` (the cache's) defaults to the checkpoint's."""
        cfg = config.get("text_config") or config  # NOTE: multimodal configs nest the language model's
        heads = cfg["num_attention_heads"]
        dtype = dtype or str(cfg.get("dtype") or cfg.get("torch_dtype") or config.get("torch_dtype") or "float16")
        return cls(num_layers=cfg["num_hidden_layers"], num_kv_heads=cfg.get("num_key_value_heads") or heads,
                   head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, dtype=dtype.removeprefix("torch."),
                   block_size=block_size)

    @property
    def quantized(self) -> bool:
        return self.dtype in QUANTIZED_DTYPES

    @property
    def scale_bytes_per_token(self) -> int:
        """2 (K and V) x layers x kv_heads x 4 for an 8-bit cache (its per-row float32 scales), else 0."""
        return 2 * self.num_layers * self.num_kv_heads * SCALE_BYTES if self.quantized else 0

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x dtype bytes, plus the scales of an 8-bit cache."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * DTYPE_BYTES[self.dtype] \
            + self.scale_bytes_per_token

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def num_blocks_for(self, kv_memory: int) -> int:
        """Whole blocks in a byte budget."""
        return kv_memory // self.bytes_per_block
