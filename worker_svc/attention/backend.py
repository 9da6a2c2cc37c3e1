"""Abstract attention backend: write this step's K/V into the paged pool, then attend over it."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence

import torch

from worker_svc.attention.metadata import AttentionMetadata


class AttentionBackend(ABC):
    """Paged attention over one layer's slice of the KV pool.

    Pool layout, per layer: kv_layer has shape [2, num_blocks, block_size, num_kv_heads, head_dim]; index 0 holds
    K and 1 holds V. Slot s = block_id * block_size + offset is token row `offset` of block `block_id`.
    Tensors are packed over the batch: row t of query/key/value is the t-th new token (see AttentionMetadata).

    GQA: num_heads is a multiple of num_kv_heads; query head h reads kv head h // (num_heads // num_kv_heads).

    NOTE: slots past a sequence's seq_len (rest of its last block, padding entries of its block table) hold
    garbage, NaN included; implementations must never let them reach the output.
    """

    name: str = "abstract"

    @abstractmethod
    def write_kv(
        self, kv_layer: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        """Write key/value [T, num_kv_heads, head_dim] into slots slot_mapping [T] of kv_layer, in place."""

    @abstractmethod
    def forward(
        self, query: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """Attend query [T, num_heads, head_dim] over the pool (already holding this step's K/V).

        Returns [T, num_heads, head_dim] in query's dtype.
        """

    def copy_blocks(self, kv_pool: torch.Tensor, copies: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer, K and V, of the [layers, 2, nb, bs, kvh, hd] pool
        (copy-on-write, before the step's forward). Backends with a kernel for it override this."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=kv_pool.device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=kv_pool.device)
        kv_pool[:, :, dst] = kv_pool[:, :, src]


def check_shapes(query: torch.Tensor, kv_layer: torch.Tensor) -> tuple[int, int, int]:
    """Validate shapes shared by all backends; return (num_heads, num_kv_heads, head_dim)."""
    if kv_layer.dim() != 5 or kv_layer.shape[0] != 2:
        shape = tuple(kv_layer.shape)
        raise ValueError(f"kv_layer must be [2, num_blocks, block_size, kv_heads, head_dim], got {shape}")
    if query.dim() != 3:
        raise ValueError(f"query must be [T, num_heads, head_dim], got {tuple(query.shape)}")
    num_heads, head_dim = query.shape[1], query.shape[2]
    num_kv_heads = kv_layer.shape[3]
    if kv_layer.shape[4] != head_dim:
        raise ValueError(f"head_dim mismatch: query {head_dim}, pool {kv_layer.shape[4]}")
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    return num_heads, num_kv_heads, head_dim
