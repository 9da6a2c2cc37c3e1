"""GGML's block-quantised weight formats as a GGUF file stores them, and a reference dequantiser (numpy).

A quantised 2-D weight [out, in] is stored row by row: each row is in // block_size blocks of block_bytes bytes, one
block holding block_size consecutive weights of the row (so rows are independent: permuting rows of blocks permutes
the rows of the weight). Scales are IEEE fp16, little-endian, as every other multi-byte field.

NOTE: the C++ kernel that multiplies with these blocks must reproduce dequantize() bit for bit. Every value below is
computed in float32 in GGML's order of operations (written at each format); most products are exact in float32 (an
fp16 scale has 11 significant bits, a quant 4 to 8), so each weight has at most one rounding, at the step named.
An FMA of an exact product and the next term gives the same single rounding."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

QK_K = 256  # weights in a K-quant super-block


@dataclass(slots=True, frozen=True)
class QuantFormat:
    name: str  # "q4_0", ... (GGML's type name, lower case)
    ggml_type: int  # GGML's enum ggml_type value, as a GGUF tensor info stores it
    block_size: int  # weights per block
    block_bytes: int  # bytes per block

    def row_bytes(self, num_cols: int) -> int:
        """Bytes of a row of `num_cols` weights; ValueError unless the row is whole blocks."""
        if num_cols <= 0 or num_cols % self.block_size:
            raise ValueError(f"a row of {num_cols} weights is not a whole number of {self.name} blocks "
                             f"({self.block_size} weights each)")
        return num_cols // self.block_size * self.block_bytes

    def num_cols(self, row_bytes: int) -> int:
        """Weights in a row of `row_bytes` bytes; ValueError unless the row is whole blocks."""
        if row_bytes <= 0 or row_bytes % self.block_bytes:
            raise ValueError(f"a row of {row_bytes} bytes is not a whole number of {self.name} blocks "
                             f"({self.block_bytes} bytes each)")
        return row_bytes // self.block_bytes * self.block_size


Q4_0 = QuantFormat("q4_0", 2, 32, 18)  # d: fp16; qs: 16 bytes of 4-bit quants
Q4_1 = QuantFormat("q4_1", 3, 32, 20)  # d, m: fp16; qs: 16 bytes of 4-bit quants
Q5_0 = QuantFormat("q5_0", 6, 32, 22)  # d: fp16; qh: 4 bytes (each weight's fifth bit); qs: 16 bytes of 4-bit quants
Q8_0 = QuantFormat("q8_0", 8, 32, 34)  # d: fp16; qs: 32 int8
Q4_K = QuantFormat("q4_k", 12, QK_K, 144)  # d, dmin: fp16; scales: 12 bytes (8 x 6-bit scale, min); qs: 128 bytes
Q6_K = QuantFormat("q6_k", 14, QK_K, 210)  # ql: 128 bytes; qh: 64 bytes; scales: 16 int8; d: fp16

FORMATS: dict[str, QuantFormat] = {f.name: f for f in (Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K)}
FORMATS_BY_GGML_TYPE: dict[int, QuantFormat] = {f.ggml_type: f for f in FORMATS.values()}


@dataclass(slots=True)
class QuantGroups:
    """A quantised weight decoded into GGML's terms: each group of `group` consecutive weights of a row shares a scale
    (and a min): w = scale * q + add (Q4_1), scale * q - sub (Q4_K), else scale * q, in float32, one rounding at most.
    q: int32 [rows, cols] (signed: Q4_0's q - 8, Q5_0's q - 16, Q6_K's q - 32); scale, add, sub: float32
    [rows, cols // group]. What the int8-activation kernel's contract is written in (q8a_gemm.cpp)."""

    group: int
    q: np.ndarray
    scale: np.ndarray
    add: np.ndarray | None = None
    sub: np.ndarray | None = None

    def dequantize(self) -> np.ndarray:
        rows, cols = self.q.shape
        q = self.q.reshape(rows, -1, self.group).astype(np.float32)
        w = self.scale[:, :, None] * q
        if self.add is not None:
            w = w + self.add[:, :, None]
        if self.sub is not None:
            w = w - self.sub[:, :, None]
        return w.reshape(rows, cols)


def decode(blocks: np.ndarray, fmt: QuantFormat) -> QuantGroups:
    """`blocks` (uint8 [rows, row_bytes] in `fmt`) as quants and scales. ValueError for anything else (another dtype or
    rank, a row that is not whole blocks)."""
    blocks = np.asarray(blocks)
    if blocks.dtype != np.uint8 or blocks.ndim != 2:
        raise ValueError(f"{fmt.name} blocks must be uint8 [rows, row_bytes], not {blocks.dtype} of shape "
                         f"{list(blocks.shape)}")
    num_rows, row_bytes = blocks.shape
    num_cols = fmt.num_cols(row_bytes)
    flat = np.ascontiguousarray(blocks).reshape(-1, fmt.block_bytes)  # one block a row
    group, q, scale, add, sub = _DECODERS[fmt.name](flat)
    per_row = num_cols // group
    shaped = lambda a: None if a is None else np.ascontiguousarray(a, np.float32).reshape(num_rows, per_row)  # noqa: E731
    return QuantGroups(group, q.astype(np.int32).reshape(num_rows, num_cols), shaped(scale), shaped(add), shaped(sub))


def dequantize(blocks: np.ndarray, fmt: QuantFormat) -> np.ndarray:
    """The float32 weight [rows, cols] of `blocks`, uint8 [rows, row_bytes] in `fmt` (as GGML dequantises it). ValueError
    for anything else (another dtype or rank, a row that is not whole blocks)."""
    return decode(blocks, fmt).dequantize()


def _fp16(fields: np.ndarray) -> np.ndarray:
    """Two-byte columns [n, 2] read as little-endian fp16, widened (exactly) to float32 [n, 1]."""
    return np.ascontiguousarray(fields).view("<f2").astype(np.float32)


def _nibbles(qs: np.ndarray) -> np.ndarray:
    """[..., k] bytes -> [..., 2, k] quants: the low nibbles, then the high nibbles."""
    return np.stack([qs & 0x0F, qs >> 4], axis=-2)


# Each decoder: one block a row -> (group, q [blocks, block_size], scale, add, sub [blocks, groups a block]).
def _q4_0(b: np.ndarray):
    # weight j (0..15) is the low nibble of qs[j], weight 16 + j its high nibble; w = (q - 8) * d, exact
    return 32, _nibbles(b[:, 2:18]).reshape(-1, 32).astype(np.int32) - 8, _fp16(b[:, 0:2]), None, None


def _q4_1(b: np.ndarray):
    # nibbles as in Q4_0, unsigned; w = d * q + m: d * q exact, one rounding at the add
    return 32, _nibbles(b[:, 4:20]).reshape(-1, 32), _fp16(b[:, 0:2]), _fp16(b[:, 2:4]), None


def _q5_0(b: np.ndarray):
    # nibbles as in Q4_0; weight i's fifth bit is bit i of qh (a little-endian uint32); w = (q - 16) * d, exact
    qh = np.ascontiguousarray(b[:, 2:6]).view("<u4")
    high = ((qh >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
    q = (_nibbles(b[:, 6:22]).reshape(-1, 32) | (high << 4)).astype(np.int32) - 16
    return 32, q, _fp16(b[:, 0:2]), None, None


def _q8_0(b: np.ndarray):
    # w = q * d, q int8, exact
    return 32, b[:, 2:34].view(np.int8), _fp16(b[:, 0:2]), None, None


def _q4_k(b: np.ndarray):
    # 8 sub-blocks of 32 weights, each with a 6-bit scale sc and min mn packed into 12 bytes s[0..11]:
    #   j < 4:  sc = s[j] & 63,                          mn = s[j + 4] & 63
    #   j >= 4: sc = (s[j + 4] & 15) | (s[j - 4] >> 6) << 4, mn = (s[j + 4] >> 4) | (s[j] >> 6) << 4
    # qs: 4 chunks of 32 bytes; chunk c holds sub-block 2c in its low nibbles and sub-block 2c + 1 in its high ones.
    # Order: d1 = d * sc and m1 = dmin * mn first (exact), then w = d1 * q - m1 (d1 * q exact; one rounding at the
    # subtraction).
    d, dmin = _fp16(b[:, 0:2]), _fp16(b[:, 2:4])
    s = b[:, 4:16]
    low, mid, high = s[:, 0:4], s[:, 4:8], s[:, 8:12]
    sc = np.concatenate([low & 63, (high & 0x0F) | ((low >> 6) << 4)], axis=1).astype(np.float32)
    mn = np.concatenate([mid & 63, (high >> 4) | ((mid >> 6) << 4)], axis=1).astype(np.float32)
    q = _nibbles(b[:, 16:144].reshape(-1, 4, 32)).reshape(-1, QK_K)
    return 32, q, d * sc, None, dmin * mn


def _q6_k(b: np.ndarray):
    # Two halves of 128 weights; half h uses ql[64h..64h+63], qh[32h..32h+31]. Within a half, weight
    #   l      = ql[l] & 15      | (qh[l] >> 0 & 3) << 4        (l in 0..31)
    #   32 + l = ql[32 + l] & 15 | (qh[l] >> 2 & 3) << 4
    #   64 + l = ql[l] >> 4      | (qh[l] >> 4 & 3) << 4
    #   96 + l = ql[32 + l] >> 4 | (qh[l] >> 6 & 3) << 4
    # less 32 (a 6-bit signed quant); weight i of the block uses the int8 scale sc[i // 16].
    # Order: w = (d * sc) * q, left to right: d * sc exact, one rounding at the multiply by q.
    ql = b[:, 0:128].reshape(-1, 2, 64)
    qh = b[:, 128:192].reshape(-1, 2, 1, 32)
    sc = b[:, 192:208].view(np.int8).astype(np.float32)
    d = _fp16(b[:, 208:210])
    low = _nibbles(ql).reshape(-1, 2, 128)  # position nibble * 64 + byte
    high = ((qh >> np.array([0, 2, 4, 6], np.uint8)[:, None]) & 3).reshape(-1, 2, 128)  # position k * 32 + l
    q = (low | (high << 4)).astype(np.int32).reshape(-1, QK_K) - 32
    return 16, q, d * sc, None, None


_DECODERS: dict[str, Callable[[np.ndarray], tuple]] = {
    "q4_0": _q4_0, "q4_1": _q4_1, "q5_0": _q5_0, "q8_0": _q8_0, "q4_k": _q4_k, "q6_k": _q6_k,
}
