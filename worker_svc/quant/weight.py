"""A weight matrix kept in GGML blocks (worker_svc.quant.formats), as the matmul kernels read it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker_svc.quant.formats import QuantFormat, dequantize


@dataclass(slots=True)
class QuantWeight:
    """A weight [out, in] (a Linear's layout: one row an output) as `format`'s blocks: uint8 [out, row_bytes],
    row_bytes = in // block_size * block_bytes, contiguous (a kernel walks it with a fixed row stride). A
    ValueError at construction names the field that does not fit."""

    format: QuantFormat
    shape: tuple[int, int]  # (out, in): the float weight's shape
    blocks: torch.Tensor
    source: tuple[str, str] | None = None  # (file, tensor name) where `blocks` view a mapping of it, else None

    def __post_init__(self) -> None:
        if len(self.shape) != 2 or not all(isinstance(n, int) and n > 0 for n in self.shape):
            raise ValueError(f"shape {list(self.shape)} is not two positive sizes (out, in)")
        self.shape = (self.shape[0], self.shape[1])
        num_out, num_in = self.shape
        try:
            row_bytes = self.format.row_bytes(num_in)
        except ValueError as e:  # in is not whole blocks
            raise ValueError(f"shape {list(self.shape)}: {e}") from None
        if self.blocks.dtype != torch.uint8 or tuple(self.blocks.shape) != (num_out, row_bytes):
            raise ValueError(f"blocks are {self.blocks.dtype} {list(self.blocks.shape)}; shape {list(self.shape)} "
                             f"in {self.format.name} takes uint8 [{num_out}, {row_bytes}]")
        if not self.blocks.is_contiguous():
            raise ValueError("blocks are not contiguous")

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [out, in] (formats.dequantize, on the CPU)."""
        return torch.from_numpy(dequantize(self.blocks.cpu().numpy(), self.format))
