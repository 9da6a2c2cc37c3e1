"""Random GGML blocks for tests: random bytes, with each block's fp16 scale fields set to finite values (a NaN or
infinite scale is no weight a file holds)."""

from __future__ import annotations

import numpy as np

from worker_svc.quant.formats import Q5_0, QuantFormat, decode

# byte offsets of each format's fp16 fields in a block (GGML's block structs)
FP16_FIELDS = {"q4_0": (0,), "q4_1": (0, 2), "q5_0": (0,), "q8_0": (0,), "q4_k": (0, 2), "q6_k": (208,)}
FP16_EXPONENT = 0x7C00  # all ones: inf or NaN


def random_blocks(rng: np.random.Generator, fmt: QuantFormat, num_rows: int, num_cols: int,
                  scale: float | None = None) -> np.ndarray:
    """uint8 [num_rows, row_bytes]. The fp16 fields: any finite bit pattern (subnormals, zeros of both signs, up to
    65504) where `scale` is None, else normal values of about that size (a plausible weight)."""
    blocks = rng.integers(0, 256, (num_rows * num_cols // fmt.block_size, fmt.block_bytes), dtype=np.uint8)
    for offset in FP16_FIELDS[fmt.name]:
        if scale is None:
            bits = rng.integers(0, 1 << 16, len(blocks), dtype=np.uint16)
            bits = np.where(bits & FP16_EXPONENT == FP16_EXPONENT, bits & ~np.uint16(FP16_EXPONENT), bits)
        else:
            bits = (rng.standard_normal(len(blocks)) * scale).astype("<f2").view(np.uint16)
        blocks[:, offset:offset + 2] = bits.astype("<u2").view(np.uint8).reshape(-1, 2)
    return blocks.reshape(num_rows, fmt.row_bytes(num_cols))


def q5_0_widened_to_q8_0(blocks: np.ndarray) -> np.ndarray:
    """Q5_0 rows (uint8 [num_rows, row_bytes]) as the Q8_0 rows holding the same weights: each block's d, then its
    32 quants q - 16 as int8 (how the CPU kernels' panels held Q5_0 before they kept its 5 bits)."""
    blocks = np.asarray(blocks)
    num_rows = blocks.shape[0]
    q = decode(blocks, Q5_0).q.reshape(-1, Q5_0.block_size).astype(np.int8)
    d = blocks.reshape(-1, Q5_0.block_bytes)[:, 0:2]
    return np.concatenate([d, q.view(np.uint8)], axis=1).reshape(num_rows, -1)
