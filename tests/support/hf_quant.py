"""Hugging Face GPTQ / AWQ / compressed-tensors checkpoints of a float model, written for the loader's tests: each
Linear of the layers quantised by round-to-nearest (RTN: GPTQ's and AWQ's own searches only choose other quants and
scales; the checkpoint's layout and arithmetic, what the loader reads, are the same) and packed as the formats
document it (worker_svc/quant/from_hf.py, from_compressed.py), beside a float checkpoint of the same weights
dequantised (float64 s * (q - z), exact in float32): the reference model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import torch

from worker_svc.quant.int_groups import AWQ_ORDER, IntGroups

LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
COPIED = ("tokenizer.json", "tokenizer_config.json", "generation_config.json", "chat_template.jinja")


def rtn(w: np.ndarray, bits: int, group: int, sym: bool) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """w [out, in] -> (q uint8 [out, in], scale fp16 [out, groups], zero int [out, groups]) as GPTQ's quantiser
    picks them (sym: scale 2 max|w| / maxq, zero (maxq + 1) / 2; asym: over [min(w, 0), max(w, 0)], zero rounded)."""
    out, num_in = w.shape
    maxq, num_groups = 2 ** bits - 1, -(-num_in // group)
    padded = np.zeros((out, num_groups * group))  # zeros: min(w, 0) and max(w, 0) of a short last group unchanged
    padded[:, :num_in] = w
    wg = padded.reshape(out, num_groups, group)
    lo, hi = np.minimum(wg.min(axis=2), 0), np.maximum(wg.max(axis=2), 0)
    if sym:
        s, zero = 2 * np.maximum(-lo, hi) / maxq, np.full((out, num_groups), (maxq + 1) // 2)
    else:
        s = (hi - lo) / maxq
    scale = np.where(s == 0, 1.0, s).astype(np.float16)
    if not sym:
        zero = np.round(-lo / scale.astype(np.float64)).astype(np.int64)
    q = np.clip(np.round(wg / scale[:, :, None]) + zero[:, :, None], 0, maxq).reshape(out, -1)[:, :num_in]
    return np.ascontiguousarray(q.astype(np.uint8)), scale, zero


def q8_0_blocks(groups: IntGroups) -> torch.Tensor:
    """The Q8_0 blocks of the weight (d = s, int8 q - z: how asymmetric int4 was held before Q5_0), built apart from
    int_groups.to_blocks, for the kernels' tests that Q5_0 changes no output bit."""
    out = groups.q.shape[0]
    d = groups.expand(groups.scale)[:, ::32].astype(np.float16).view(np.uint8).reshape(out, -1, 2)
    diff = groups.q.astype(np.int32) - groups.expand(groups.zero)
    assert diff.min() >= -128 and diff.max() <= 127
    quants = diff.astype(np.int8).view(np.uint8).reshape(out, -1, 32)
    return torch.from_numpy(np.concatenate([d, quants], axis=2).reshape(out, -1))


def pack(fields: np.ndarray, bits: int, axis: int, order: tuple[int, ...] | None = None) -> np.ndarray:
    """uint fields -> int32 words of 32 / bits fields, lowest bits first, along `axis`; `order`: AWQ's, field i of a
    word holding column ORDER[i] of its 8."""
    per = 32 // bits
    f = fields.astype(np.uint32)
    if axis == 0:
        f = f.reshape(-1, per, f.shape[1]).transpose(0, 2, 1)  # [words, cols, per]
    else:
        f = f.reshape(f.shape[0], -1, per)
        if order is not None:
            f = f[:, :, list(order)]
    words = np.zeros(f.shape[:2], np.uint32)
    for i in range(per):
        words |= f[:, :, i] << np.uint32(bits * i)
    return words.view(np.int32)


def write_checkpoint(float_dir: str | Path, out_dir: Path, method: str, bits: int, group: int, sym: bool,
                     v2: bool = False, activations: bool = False) -> Path:
    """out_dir/quantised (the checkpoint) and out_dir/float (its dequantised reference); returns out_dir. group -1:
    one group a row (compressed-tensors: per channel); v2: GPTQ's gptq_v2 zeros; activations: compressed-tensors'
    W8A8 (dynamic per-token int8 activations) scheme."""
    from safetensors.torch import load_file, save_file

    float_dir = Path(float_dir)
    config = json.loads((float_dir / "config.json").read_text())
    state = load_file(str(float_dir / "model.safetensors"))
    quantised, reference = {}, {}
    for name, t in state.items():
        prefix = name.removesuffix(".weight")
        if not (name.endswith(".weight") and prefix.rpartition(".")[2] in LINEARS):
            quantised[name] = reference[name] = t
            continue
        size = t.shape[1] if group == -1 else group
        q, scale, zero = rtn(t.float().numpy(), bits, size, sym)
        tensors, used_scale = PACKERS[method](q, scale, zero, bits, size, v2)
        quantised.update({f"{prefix}.{suffix}": v for suffix, v in tensors.items()})
        expand = lambda a: np.repeat(a, size, axis=1)[:, :q.shape[1]]  # noqa: E731
        reference[name] = torch.from_numpy((expand(used_scale).astype(np.float64) *
                                            (q.astype(np.int64) - expand(zero))).astype(np.float32))
    qc = quantization_config(method, bits, group, sym, v2, activations)
    for sub, tensors, extra in (("quantised", quantised, {"quantization_config": qc}), ("float", reference, {})):
        target = out_dir / sub
        target.mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(target / "model.safetensors"))
        (target / "config.json").write_text(json.dumps({**config, **extra}, indent=2))
        for copied in COPIED:
            if (float_dir / copied).is_file():
                shutil.copy(float_dir / copied, target / copied)
    return out_dir


def quantization_config(method: str, bits: int, group: int, sym: bool, v2: bool, activations: bool) -> dict:
    if method == "gptq":
        return {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": sym, "desc_act": False,
                "checkpoint_format": "gptq_v2" if v2 else "gptq"}
    if method == "awq":
        return {"quant_method": "awq", "bits": bits, "group_size": group, "zero_point": True, "version": "gemm"}
    weights = {"num_bits": bits, "type": "int", "symmetric": sym, "strategy": "channel" if group == -1 else "group",
               "group_size": None if group == -1 else group, "dynamic": False, "actorder": None}
    acts = {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "token", "dynamic": True}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized" if bits == 4 else "int-quantized",
            "quantization_status": "compressed", "ignore": ["lm_head"],
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights,
                                          "input_activations": acts if activations else None}}}


def pack_gptq(q, scale, zero, bits, group, v2):
    stored_zero = (zero - (0 if v2 else 1)) & (2 ** bits - 1)  # v1 stores z - 1
    return {"qweight": torch.from_numpy(pack(q.T, bits, axis=0)),
            "qzeros": torch.from_numpy(pack(stored_zero.T, bits, axis=1)),
            "g_idx": torch.arange(q.shape[1], dtype=torch.int32) // group,
            "scales": torch.from_numpy(np.ascontiguousarray(scale.T))}, scale


def pack_awq(q, scale, zero, bits, group, v2):
    return {"qweight": torch.from_numpy(pack(q.T, 4, axis=1, order=AWQ_ORDER)),
            "qzeros": torch.from_numpy(pack(zero.T, 4, axis=1, order=AWQ_ORDER)),
            "scales": torch.from_numpy(np.ascontiguousarray(scale.T))}, scale


def pack_compressed(q, scale, zero, bits, group, v2):
    """compressed-tensors' layout (its pack_to_int32 writes the same words: tests/worker/test_hf_quant_formats.py):
    4-bit quants q + 8 packed densely along each row, zero points along the outputs; 8-bit: int8 q and zero points;
    bfloat16 scales (the RTN scale rounded to bfloat16: an fp16 value too)."""
    offset = 1 << (bits - 1)
    bf16 = torch.from_numpy(scale.astype(np.float32)).to(torch.bfloat16)
    out = {"weight_scale": bf16}
    if bits == 4:  # q is unsigned already: the signed quant plus the offset pack_to_int32 adds
        out.update(weight_packed=torch.from_numpy(pack(q, 4, axis=1)), weight_shape=torch.tensor(list(q.shape)))
    else:
        out["weight"] = torch.from_numpy((q.astype(np.int16) - offset).astype(np.int8))
    if not (zero == offset).all():
        out["weight_zero_point"] = torch.from_numpy(pack(zero, 4, axis=0)) if bits == 4 else \
            torch.from_numpy((zero - offset).astype(np.int8))
    return out, bf16.float().numpy()


PACKERS = {"gptq": pack_gptq, "awq": pack_awq, "compressed-tensors": pack_compressed}
