"""The worker's one preallocated KV pool tensor (and an 8-bit cache's scales), sized from a byte budget."""

from __future__ import annotations

from typing import TYPE_CHECKING, Sequence

import torch

from pagedserve_common.kv_geometry import KVGeometry
from worker_svc.attention.quant import SCALE_DTYPE, STORAGE, raw

if TYPE_CHECKING:
    from worker_svc.attention.backend import AttentionBackend

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}  # the model's


class KVPool:
    """kv[slot] is one layer's [2, num_blocks, block_size, num_kv_heads, head_dim] view (0 = K, 1 = V).

    NOTE: the whole pool is ONE tensor of shape [layers_per_group, 2, num_blocks, block_size, kv_heads, head_dim]: a
    block's slots are contiguous per layer, so writing a token is one row and copying a block is one slice.
    Slot s of the pool is token s % block_size of block s // block_size.
    KV groups (geometry.groups): a block holds the layers of ONE group, whichever its table says; layer l lives in
    slot geometry.groups.layer_slots[l][1] of its group's blocks. One group (every model with one kind of layer):
    layers_per_group = num_layers and slot = layer. Copies and swaps move whole blocks, so they need no grouping.

    An 8-bit cache (int8, fp8) also has `scales`, [layers, 2, num_blocks, block_size, kv_heads] float32: row
    (token, kv head) of K or V holds codes x scale. INVARIANT: a block's scales move with its codes in every block
    operation (copy-on-write, swap out and in), so a block read anywhere dequantises to what its writer wrote.
    """

    def __init__(self, geometry: KVGeometry, num_blocks: int, device: torch.device | str = "cpu",
                 num_cpu_blocks: int = 0) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV budget holds no block: {geometry.bytes_per_block} bytes needed per block")
        self.geometry = geometry
        self.groups = geometry.groups
        self.num_blocks = num_blocks
        shape = (geometry.groups.layers_per_group, 2, num_blocks, geometry.block_size, geometry.num_kv_heads, geometry.head_dim)
        dtype = STORAGE[geometry.dtype]
        self.kv = torch.zeros(shape, dtype=dtype, device=device)
        self.scales = torch.zeros(shape[:-1], dtype=SCALE_DTYPE, device=device) if geometry.quantized else None
        # Swap space: the same layout in host memory (pinned beside a GPU, for fast copies).
        self.num_cpu_blocks = num_cpu_blocks
        pin = torch.device(device).type == "cuda"
        cpu_shape = (*shape[:2], num_cpu_blocks, *shape[3:])
        self.cpu_kv = torch.zeros(cpu_shape, dtype=dtype, pin_memory=pin) if num_cpu_blocks else None
        self.cpu_scales = torch.zeros(cpu_shape[:-1], dtype=SCALE_DTYPE, pin_memory=pin) \
            if num_cpu_blocks and geometry.quantized else None

    @property
    def nbytes(self) -> int:
        """The pool's device bytes, scales included."""
        scales = 0 if self.scales is None else self.scales.numel() * self.scales.element_size()
        return self.kv.numel() * self.kv.element_size() + scales

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Layer i's (codes or values [2, nb, bs, kvh, hd], scales [2, nb, bs, kvh] or None) in every block of its
        group."""
        slot = self.groups.layer_slots[i][1]
        return self.kv[slot], None if self.scales is None else self.scales[slot]

    def copy_blocks(self, copies: Sequence[tuple[int, int]], backend: AttentionBackend) -> None:
        """Copy-on-write: whole blocks src -> dst in every layer, K and V, and their scales."""
        backend.copy_blocks(self.kv, copies)
        if self.scales is not None:
            backend.copy_blocks(self.scales, copies)

    def swap_out(self, pairs: list[tuple[int, int]]) -> None:
        """Saves device blocks into CPU swap blocks: (device src, cpu dst)."""
        if pairs:
            src = torch.tensor([s for s, _ in pairs], dtype=torch.long, device=self.kv.device)
            dst = [d for _, d in pairs]
            raw(self.cpu_kv)[:, :, dst] = raw(self.kv)[:, :, src].to("cpu")
            if self.scales is not None:
                self.cpu_scales[:, :, dst] = self.scales[:, :, src].to("cpu")

    def swap_in(self, pairs: list[tuple[int, int]]) -> None:
        """Restores CPU swap blocks into device blocks: (cpu src, device dst)."""
        if pairs:
            dst = torch.tensor([d for _, d in pairs], dtype=torch.long, device=self.kv.device)
            src = [s for s, _ in pairs]
            raw(self.kv)[:, :, dst] = raw(self.cpu_kv)[:, :, src].to(self.kv.device)
            if self.scales is not None:
                self.scales[:, :, dst] = self.cpu_scales[:, :, src].to(self.kv.device)
