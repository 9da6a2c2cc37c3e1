"""The lean forward's layers over weights kept quantised: a matmul on the quantised kernel (q_gemm.cpp on the CPU,
cuda/quant_gemm.cu on a GPU: any object with QuantKernel's pack and linear) and an
embedding whose rows are dequantised when looked up. Neither ever holds the float weight."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from worker_svc.quant.kernel import QuantKernel
from worker_svc.quant.weight import QuantWeight


@dataclass(slots=True)
class QuantPart:
    """One weight's panels (ps_q_pack) and its output features."""

    ggml_type: int
    packed: torch.Tensor
    out_features: int


@dataclass(slots=True)
class QuantLinear:
    """y = x @ W.T + b over one or more quantised weights side by side (a fused QKV or gate/up: one part where they
    share a format, else one part each). Batch invariant: the kernel's chain per output does not depend on M."""

    parts: list[QuantPart]
    bias: torch.Tensor | None
    kernel: QuantKernel  # or quant.cupy_kernel.CupyQuantKernel (the same pack / linear)
    invariant: bool = True  # linear.Linear's field: every call runs the one M-invariant kernel

    @property
    def out_features(self) -> int:
        return sum(p.out_features for p in self.parts)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        bias = self.bias
        if bias is not None and bias.dtype != x.dtype:
            bias = bias.to(x.dtype)
        if len(self.parts) == 1:
            p = self.parts[0]
            return self.kernel.linear(p.ggml_type, x, p.packed, p.out_features, bias)
        outs, at = [], 0
        for p in self.parts:
            b = None if bias is None else bias[at:at + p.out_features].contiguous()
            outs.append(self.kernel.linear(p.ggml_type, x, p.packed, p.out_features, b))
            at += p.out_features
        return torch.cat(outs, dim=1)


def quant_linear(weights: list[QuantWeight], bias: torch.Tensor | None, kernel: QuantKernel) -> QuantLinear:
    """One QuantLinear for `weights` (each [out_i, in], one `in`), stacked by output in order: the rows of weights
    that share a format are one weight (a row's blocks do not depend on the other rows), packed once."""
    if len({w.shape[1] for w in weights}) != 1:
        raise ValueError(f"weights of different input sizes cannot share a matmul: {[list(w.shape) for w in weights]}")
    in_features = weights[0].shape[1]
    groups: list[list[QuantWeight]] = []
    for w in weights:  # runs of one format, in order
        if groups and groups[-1][0].format == w.format:
            groups[-1].append(w)
        else:
            groups.append([w])
    parts = []
    for group in groups:
        blocks = group[0].blocks if len(group) == 1 else torch.cat([w.blocks for w in group]).contiguous()
        fmt = group[0].format
        parts.append(QuantPart(fmt.ggml_type, kernel.pack(fmt.ggml_type, blocks, in_features), int(blocks.shape[0])))
    return QuantLinear(parts, bias, kernel)


@dataclass(slots=True)
class QuantEmbedding:
    """An embedding table kept quantised: a lookup dequantises the rows it takes (formats.dequantize: each value
    the float32 one GGML gives), then rounds them to the model's dtype, as a dequantised table would hold them."""

    weight: QuantWeight
    dtype: torch.dtype

    def __call__(self, ids: torch.Tensor) -> torch.Tensor:
        # NOTE: the blocks stay on the CPU (dequantize is numpy's); on a GPU the ids come over, the rows go back
        index = ids.reshape(-1).to(self.weight.blocks.device)
        rows = QuantWeight(self.weight.format, (int(ids.numel()), self.weight.shape[1]),
                           self.weight.blocks.index_select(0, index).contiguous())
        return rows.dequantize().to(device=ids.device, dtype=self.dtype).reshape(*ids.shape, self.weight.shape[1])
