"""Abstract attention backend: write this step's K/V into the paged pool, then attend over it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from worker_svc.attention.metadata import AttentionMetadata
from worker_svc.attention.quant import QUANTIZED, SCALE_DTYPE, raw


class AttentionBackend(ABC):
    """Paged attention over one layer's slice of the KV pool.

    Pool layout, per layer: kv_layer has shape [2, num_blocks, block_size, num_kv_heads, head_dim]; index 0 holds
    K and 1 holds V. Slot s = block_id * block_size + offset is token row `offset` of block `block_id`.
    Tensors are packed over the batch: row t of query/key/value is the t-th new token (see AttentionMetadata).

    GQA: num_heads is a multiple of num_kv_heads; query head h reads kv head h // (num_heads // num_kv_heads).

    NOTE: slots past a sequence's seq_len (rest of its last block, padding entries of its block table) hold
    garbage, NaN included; implementations must never let them reach the output.

    8-bit caches (worker_svc.attention.quant): kv_layer's dtype is int8 or float8 (its codes) and kv_scales is
    the layer's [2, num_blocks, block_size, num_kv_heads] float32 scales; a row reads as codes x its scale. The
    write quantises each new (token, kv head) row on its way into the pool (no float copy of the cache), and
    attention dequantises as it reads each block. kv_scales is None exactly for a float pool.
    """

    name: str = "abstract"

    @abstractmethod
    def write_kv(
        self, kv_layer: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
        kv_scales: torch.Tensor | None = None,
    ) -> None:
        """Write key/value [T, num_kv_heads, head_dim] into slots slot_mapping [T] of kv_layer (and of kv_scales,
        quantised, for an 8-bit cache), in place."""

    @abstractmethod
    def forward(
        self, query: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float,
        kv_scales: torch.Tensor | None = None, window: int = 0,
    ) -> torch.Tensor:
        """Attend query [T, num_heads, head_dim] over the pool (already holding this step's K/V).

        window > 0 (a sliding-window layer): the query at position p sees only keys at p - window < q <= p, as
        transformers' sliding mask has it; blocks wholly before that are never read. 0: keys 0..p.

        Returns [T, num_heads, head_dim] in query's dtype.
        """

    def copy_blocks(self, kv_pool: torch.Tensor, copies: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer, K and V, of a [layers, 2, num_blocks, ...] pool tensor:
        the [layers, 2, nb, bs, kvh, hd] pool, or an 8-bit cache's [layers, 2, nb, bs, kvh] scales (copy-on-write,
        before the step's forward; KVPool.copy_blocks calls it for both). Backends with a kernel override this."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=kv_pool.device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=kv_pool.device)
        pool = raw(kv_pool)
        pool[:, :, dst] = pool[:, :, src]


def check_shapes(query: torch.Tensor, kv_layer: torch.Tensor,
                 kv_scales: torch.Tensor | None = None) -> tuple[int, int, int]:
    """Validate shapes shared by all backends; return (num_heads, num_kv_heads, head_dim)."""
    if kv_layer.dim() != 5 or kv_layer.shape[0] != 2:
        shape = tuple(kv_layer.shape)
        raise ValueError(f"kv_layer must be [2, num_blocks, block_size, kv_heads, head_dim], got {shape}")
    if (kv_layer.dtype in QUANTIZED) != (kv_scales is not None):
        raise ValueError(f"a {kv_layer.dtype} pool layer {'needs' if kv_scales is None else 'has no'} kv_scales")
    if kv_scales is not None and (kv_scales.shape != kv_layer.shape[:-1] or kv_scales.dtype != SCALE_DTYPE):
        raise ValueError(f"kv_scales must be float32 {tuple(kv_layer.shape[:-1])}, got {kv_scales.dtype} "
                         f"{tuple(kv_scales.shape)}")
    if query.dim() != 3:
        raise ValueError(f"query must be [T, num_heads, head_dim], got {tuple(query.shape)}")
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_layer.shape[3]
    if kv_layer.shape[4] != head_dim:
        raise ValueError(f"head_dim mismatch: query {head_dim}, pool {kv_layer.shape[4]}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    return num_heads, num_kv_heads, head_dim
