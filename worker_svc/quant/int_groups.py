"""Integer weights with a scale and a zero per group of inputs (the Hugging Face GPTQ / AWQ / compressed-tensors
checkpoints' arithmetic: w = s * (q - z)), unpacked from those formats' int32 words and written as the GGML blocks the
quantised kernels run, with no rounding anywhere.

Exactness (why each mapping is exact): s is an fp16 scale (11 significant bits) and q - z an integer of at most 9
bits, so s * (q - z) is exact in float32, and so is each GGML block's own dequantisation of what is written, d = s
and a quant that is q - z plus the block's offset (the first block that holds every q - z, smallest first):
- every zero 8 in 4 bits (GPTQ sym, compressed-tensors symmetric int4): Q4_0, its quants q: d * (q - 8), 4.5 bits a
  weight;
- otherwise, where every q - z is in -16..15 with 4-bit quants (4-bit asymmetric: AWQ, GPTQ sym=False, compressed-
  tensors asymmetric W4A16, whose q and z are in 0..15, GPTQ v1's z in 1..16): Q5_0, its 5-bit quants q - z + 16 in
  0..31: d * (q5 - 16), 5.5 bits a weight (a Q4_1 block's fp16 min cannot hold -z * s exactly, so asymmetric int4
  takes the fifth bit);
- otherwise, where every q - z fits int8 (8-bit symmetric, zero 128; 8-bit asymmetric within int8): Q8_0, its
  quants q - z: d * q8, 8.5 bits a weight.
A scale that is not an fp16 value exactly, an 8-bit q - z outside int8, or a group that is not whole 32-input blocks,
is refused by name."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from worker_svc.quant.formats import Q4_0, Q5_0, Q8_0, QuantFormat
from worker_svc.quant.weight import QuantWeight

BLOCK = 32  # inputs a GGML Q4_0 / Q5_0 / Q8_0 block
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AWQ's GEMM packing: nibble i of a word holds output column 8 * word + ORDER[i]


@dataclass(slots=True)
class IntGroups:
    """W [out, in] = scale[:, g(i)] * (q - zero[:, g(i)]), g(i) = i // group. q: uint8 [out, in] (0 .. 2^bits - 1);
    scale: float32 [out, groups] (each an fp16 value); zero: int32 [out, groups]."""

    group: int
    q: np.ndarray
    scale: np.ndarray
    zero: np.ndarray

    def expand(self, a: np.ndarray) -> np.ndarray:
        """[out, groups] -> [out, in]: each input's group's value."""
        return np.repeat(a, self.group, axis=1)[:, :self.q.shape[1]]

    def dequantize(self) -> np.ndarray:
        """The reference: float64 s * (q - z) (exact; the float32 model's weight where s is fp16)."""
        return self.expand(self.scale).astype(np.float64) * (self.q.astype(np.int64) - self.expand(self.zero))


def unpack_words(words: np.ndarray, bits: int, axis: int) -> np.ndarray:
    """int32 words -> their 32 // bits fields of `bits` bits, lowest first, placed along `axis` (0: each word's fields
    are consecutive rows; 1: consecutive columns). GPTQ's qweight packs inputs along axis 0, its qzeros outputs along
    axis 1."""
    per = 32 // bits
    shifts = np.arange(per, dtype=np.uint32) * bits
    u = np.ascontiguousarray(words).view(np.uint32)
    if axis == 0:
        fields = (u[:, None, :] >> shifts[None, :, None]) & ((1 << bits) - 1)  # [rows, per, cols]
    else:
        fields = (u[:, :, None] >> shifts[None, None, :]) & ((1 << bits) - 1)  # [rows, cols, per]
    shape = (u.shape[0] * per, u.shape[1]) if axis == 0 else (u.shape[0], u.shape[1] * per)
    return fields.reshape(shape).astype(np.uint8)


def unpack_awq(words: np.ndarray) -> np.ndarray:
    """AWQ GEMM's int32 words [rows, out / 8] -> 4-bit fields [rows, out], undoing its interleaved order."""
    nibbles = unpack_words(words, 4, axis=1).reshape(words.shape[0], -1, 8)
    out = np.empty_like(nibbles)
    out[:, :, list(AWQ_ORDER)] = nibbles
    return out.reshape(words.shape[0], -1)


def fp16_scales(name: str, scales: torch.Tensor) -> np.ndarray:
    """The scales as float32 values, each an fp16 value exactly; ValueError naming the tensor where one is not."""
    s = scales.to(torch.float32)
    if not torch.equal(s.to(torch.float16).to(torch.float32), s) or not bool(torch.isfinite(s).all()):
        raise ValueError(f"{name}: a {scales.dtype} scale that is not an fp16 value exactly (the kernels' blocks hold "
                         "fp16 scales; rounding it would change the weights)")
    return s.numpy()


def to_blocks(groups: IntGroups, name: str) -> QuantWeight:
    """The weight as Q4_0 blocks (every zero 8, 4-bit quants), Q5_0 blocks (4-bit quants, q - z in -16..15) or Q8_0
    blocks (q - z as int8), bit-exact (see the module's docstring); ValueError naming `name` where none holds it
    exactly."""
    out, num_in = groups.q.shape
    if groups.group % BLOCK or num_in % BLOCK:
        raise ValueError(f"{name}: group size {groups.group} over {num_in} inputs is not whole {BLOCK}-input blocks")
    d = groups.expand(groups.scale)[:, ::BLOCK].astype(np.float16).view(np.uint8).reshape(out, -1, 2)
    four_bit = int(groups.q.max(initial=0)) < 16
    if four_bit and bool((groups.zero == 8).all()):
        return _weight(Q4_0, d, [_nibble_bytes(groups.q)])
    diff = groups.q.astype(np.int32) - groups.expand(groups.zero)
    if four_bit and diff.min(initial=0) >= -16 and diff.max(initial=0) <= 15:
        q5 = (diff + 16).astype(np.uint32).reshape(out, -1, BLOCK)
        # qh: bit j of a little-endian uint32 is weight j's fifth bit (distinct bits: their sum is their OR)
        qh = ((q5 >> 4) << np.arange(BLOCK, dtype=np.uint32)).sum(axis=2, dtype=np.uint32)
        return _weight(Q5_0, d, [qh.astype("<u4").view(np.uint8).reshape(out, -1, 4), _nibble_bytes(q5 & 15)])
    if diff.min(initial=0) < -128 or diff.max(initial=0) > 127:
        raise ValueError(f"{name}: q - zero leaves int8 (an asymmetric 8-bit weight): not held exactly")
    return _weight(Q8_0, d, [diff.astype(np.int8).view(np.uint8).reshape(out, -1, BLOCK)])


def _nibble_bytes(q: np.ndarray) -> np.ndarray:
    """4-bit values [out, in] -> [out, blocks, 16] bytes as Q4_0 / Q5_0 hold them: byte j of a block = weight j (low
    nibble) | weight 16 + j (high)."""
    pairs = q.reshape(q.shape[0], -1, 2, BLOCK // 2)
    return (pairs[:, :, 0] | (pairs[:, :, 1] << 4)).astype(np.uint8)


def _weight(fmt: QuantFormat, d: np.ndarray, fields: list[np.ndarray]) -> QuantWeight:
    """The blocks of `fmt` from their fields after d, each uint8 [out, blocks, bytes], in the block's order."""
    out, num_blocks = d.shape[:2]
    blocks = np.concatenate([d, *fields], axis=2).reshape(out, -1)
    return QuantWeight(fmt, (out, num_blocks * BLOCK), torch.from_numpy(blocks))
