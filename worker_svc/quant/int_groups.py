"""Integer weights with a scale and a zero per group of inputs (the Hugging Face GPTQ / AWQ / compressed-tensors
checkpoints' arithmetic: w = s * (q - z)), unpacked from those formats' int32 words and written as the GGML blocks the
quantised kernels run, with no rounding anywhere.

Exactness (why each mapping is exact): s is an fp16 scale (11 significant bits) and q - z an integer of at most 9
bits, so s * (q - z) is exact in float32, and so is each GGML block's own dequantisation of what is written:
- every zero 8 in 4 bits (GPTQ sym): a Q4_0 block per 32 inputs, d = s, its quants q: Q4_0's d * (q - 8);
- otherwise, where every q - z fits int8 (4-bit asymmetric; 8-bit symmetric, zero 128): a Q8_0 block, d = s, its
  quants q - z (8 bits a weight, not 4: a Q4_1 block's fp16 min cannot hold -z * s exactly, so an asymmetric 4-bit
  weight is widened as GGUF's Q5_0 and Q6_K are).
A scale that is not an fp16 value exactly, or a group that is not whole 32-input blocks, is refused by name."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from worker_svc.quant.formats import Q4_0, Q8_0
from worker_svc.quant.weight import QuantWeight

BLOCK = 32  # inputs a GGML Q4_0 / Q8_0 block
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
    """The weight as Q4_0 blocks (every zero 8, 4-bit quants) or Q8_0 blocks (q - z as int8), bit-exact (see the
    module's NOTE); ValueError naming `name` where neither holds it exactly."""
    out, num_in = groups.q.shape
    if groups.group % BLOCK or num_in % BLOCK:
        raise ValueError(f"{name}: group size {groups.group} over {num_in} inputs is not whole {BLOCK}-input blocks")
    d = groups.expand(groups.scale)[:, ::BLOCK].astype(np.float16).view(np.uint8).reshape(out, -1, 2)
    zero = groups.expand(groups.zero)
    if int(groups.q.max(initial=0)) < 16 and bool((groups.zero == 8).all()):
        q = groups.q.reshape(out, -1, 2, BLOCK // 2)  # Q4_0: byte j = weight j (low nibble) | weight 16 + j (high)
        qs = (q[:, :, 0] | (q[:, :, 1] << 4)).astype(np.uint8)
        return QuantWeight(Q4_0, (out, num_in), torch.from_numpy(np.concatenate([d, qs], axis=2).reshape(out, -1)))
    diff = groups.q.astype(np.int32) - zero
    if diff.min(initial=0) < -128 or diff.max(initial=0) > 127:
        raise ValueError(f"{name}: q - zero leaves int8 (an asymmetric 8-bit weight): not held exactly")
    qs = diff.astype(np.int8).view(np.uint8).reshape(out, -1, BLOCK)
    return QuantWeight(Q8_0, (out, num_in), torch.from_numpy(np.concatenate([d, qs], axis=2).reshape(out, -1)))
