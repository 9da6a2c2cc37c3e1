"""The worker's one preallocated KV pool tensor, sized from a byte budget, with block copies."""

from __future__ import annotations

from dataclasses import dataclass

import torch

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass(slots=True, frozen=True)
class KVLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def bytes_per_token(self) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x dtype bytes."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.dtype.itemsize

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_per_token * self.block_size

    def num_blocks_for(self, kv_memory: int) -> int:
        return kv_memory // self.bytes_per_block


class KVPool:
    """kv[layer] is one layer's [2, num_blocks, block_size, num_kv_heads, head_dim] view (0 = K, 1 = V).

    NOTE: the whole pool is ONE tensor of shape [layers, 2, num_blocks, block_size, kv_heads, head_dim]: a
    block's slots are contiguous per layer, so writing a token is one row and copying a block is one slice.
    Slot s of the pool is token s % block_size of block s // block_size.
    """

    def __init__(self, layout: KVLayout, num_blocks: int, device: torch.device | str = "cpu",
                 num_cpu_blocks: int = 0) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV budget holds no block: {layout.bytes_per_block} bytes needed per block")
        self.layout = layout
        self.num_blocks = num_blocks
        shape = (layout.num_layers, 2, num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
        self.kv = torch.zeros(shape, dtype=layout.dtype, device=device)
        # Swap space: the same layout in host memory (pinned beside a GPU, for fast copies).
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu_kv = torch.zeros((*shape[:2], num_cpu_blocks, *shape[3:]), dtype=layout.dtype,
                                  pin_memory=torch.device(device).type == "cuda") if num_cpu_blocks else None

    @property
    def nbytes(self) -> int:
        return self.kv.numel() * self.kv.element_size()

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Saves device blocks into CPU swap blocks: (device src, cpu dst)."""
        if pairs:
            src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=self.kv.device)
            self.cpu_kv[:, :, [d for _, d in pairs]] = self.kv[:, :, src].to("cpu")

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Restores CPU swap blocks into device blocks: (cpu src, device dst)."""
        if pairs:
            dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=self.kv.device)
            self.kv[:, :, dst] = self.cpu_kv[:, :, [s for s, _ in pairs]].to(self.kv.device)
