"""The shape of a model's KV cache, one definition for the worker's pool and the scheduler's capacity plans."""

from __future__ import annotations

import math
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
    # Each layer's sliding window (0: full attention); () where every layer attends to all keys.
    layer_windows: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.dtype not in DTYPE_BYTES:
            raise ValueError(f"dtype must be one of {sorted(DTYPE_BYTES)}, got {self.dtype!r}")
        if self.layer_windows and (len(self.layer_windows) != self.num_layers or min(self.layer_windows) < 0):
            raise ValueError(f"layer_windows must be one window >= 0 per layer ({self.num_layers}), got "
                             f"{len(self.layer_windows)} of them")

    @property
    def groups(self) -> KVGroups:
        return KVGroups.of(self.layer_windows or (0,) * self.num_layers)

    @classmethod
    def from_config(cls, config: dict, dtype: str | None = None, block_size: int = DEFAULT_BLOCK_SIZE) -> KVGeometry:
        """From a HuggingFace config.json (as a dict); `dtype` (the cache's) defaults to the checkpoint's."""
        cfg = config.get("text_config") or config  # NOTE: multimodal configs nest the language model's
        heads = cfg["num_attention_heads"]
        windows = ()
        if cfg.get("sliding_window") and cfg.get("layer_types"):  # NOTE: Gemma 3's per-layer kinds
            windows = tuple(int(cfg["sliding_window"]) if t == "sliding_attention" else 0 for t in cfg["layer_types"])
        dtype = dtype or str(cfg.get("dtype") or cfg.get("torch_dtype") or config.get("torch_dtype") or "float16")
        return cls(num_layers=cfg["num_hidden_layers"], num_kv_heads=cfg.get("num_key_value_heads") or heads,
                   head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads, dtype=dtype.removeprefix("torch."),
                   block_size=block_size, layer_windows=windows if any(windows) else ())

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
        """One physical block: block_size tokens of ONE KV group's layers (all layers when there is one group)."""
        return self.bytes_per_token // self.groups.num_groups * self.block_size

    def num_blocks_for(self, kv_memory: int) -> int:
        """Whole blocks in a byte budget."""
        return kv_memory // self.bytes_per_block


def blocks_before_window(num_computed: int, window: int, block_size: int) -> int:
    """The leading blocks of a sliding layer (`window` > 0) that no query from position num_computed on can see:
    each wholly before that query's window (its last token < num_computed - window + 1). The scheduler frees them
    (scheduler_svc.kv.manager); the worker never reads their stale table entries (worker_svc.batch.live_entries)."""
    return max(0, num_computed - window + 1) // block_size


@dataclass(slots=True, frozen=True)
class KVGroups:
    """The layers split into KV groups of equal size (vLLM's hybrid KV cache idea): every layer of a group has the
    same window, and one physical block holds block_size tokens of one group's layers, so blocks of every group
    are the same size and share one pool. A sequence holds one block per group per logical block; a sliding
    group's blocks wholly before every future query's window can be freed (scheduler_svc.kv.manager).

    layers_per_group = the gcd of the layer counts of each window: Gemma 3 270M (15 layers of window 512, 3 full)
    -> 3 layers a group, 1 full group then 5 sliding groups. One window for all layers -> ONE group of all layers.
    Groups are ordered by window (full first), each window's layers in layer order.
    """

    windows: tuple[int, ...]  # per group: its layers' window (0: full attention)
    layer_slots: tuple[tuple[int, int], ...]  # per layer: (group, slot within the group)
    layers_per_group: int

    @classmethod
    def of(cls, layer_windows: tuple[int, ...]) -> KVGroups:
        by_window: dict[int, list[int]] = {}
        for layer, w in enumerate(layer_windows):
            by_window.setdefault(w, []).append(layer)
        size = math.gcd(*(len(layers) for layers in by_window.values()))
        windows, slots = [], [(0, 0)] * len(layer_windows)
        for w in sorted(by_window):
            layers = by_window[w]
            for start in range(0, len(layers), size):
                for slot, layer in enumerate(layers[start:start + size]):
                    slots[layer] = (len(windows), slot)
                windows.append(w)
        return cls(tuple(windows), tuple(slots), size)

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    def table(self, logical_block_ids) -> list[int]:
        """The block table of logical blocks `logical_block_ids` where logical block l's group-g block is physical
        block l * num_groups + g (one group: the ids themselves): the layout of plans built outside the scheduler
        (the worker's warm-up, offline tools)."""
        ng = self.num_groups
        return [b * ng + g for b in logical_block_ids for g in range(ng)]
