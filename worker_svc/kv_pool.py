"""The worker's one preallocated KV pool tensor, sized from a byte budget, with block copies."""

from __future__ import annotations

import torch

from pagedserve_common.kv_geometry import KVGeometry

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class KVPool:
    """kv[layer] is one layer's [2, num_blocks, block_size, num_kv_heads, head_dim] view (0 = K, 1 = V).

    NOTE: the whole pool is ONE tensor of shape [layers, 2, num_blocks, block_size, kv_heads, head_dim]: a
    block's slots are contiguous per layer, so writing a token is one row and copying a block is one slice.
    Slot s of the pool is token s % block_size of block s // block_size.
    """

    def __init__(self, geometry: KVGeometry, num_blocks: int, device: torch.device | str = "cpu",
                 num_cpu_blocks: int = 0) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV budget holds no block: {geometry.bytes_per_block} bytes needed per block")
        self.geometry = geometry
        self.num_blocks = num_blocks
        shape = (geometry.num_layers, 2, num_blocks, geometry.block_size, geometry.num_kv_heads, geometry.head_dim)
        dtype = DTYPES[geometry.dtype]
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        # Swap space: the same layout in host memory (pinned beside a GPU, for fast copies).
        self.num_cpu_blocks = num_cpu_blocks
        self.cpu_kv = torch.zeros((*shape[:2], num_cpu_blocks, *shape[3:]), dtype=dtype,
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
