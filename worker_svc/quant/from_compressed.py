"""compressed-tensors checkpoints (llm-compressor's; config.json quantization_config quant_method
"compressed-tensors") read without dequantising, as from_hf reads GPTQ and AWQ: int weights with a scale (and a
zero point) per output channel or per group of inputs, w = s * (q - z), written as GGML blocks (int_groups).

- format "pack-quantized" (W4A16): `P.weight_packed` int32 [out, in * bits / 32], each row's quants densely packed,
  lowest bits first, stored q + 2^(bits-1) (unsigned); `P.weight_scale` [out, groups]; `P.weight_zero_point` (asym)
  int32 [out * bits / 32, groups], packed along the outputs the same way; `P.weight_shape` [2].
- format "int-quantized" / "naive-quantized" (W8A16, W8A8): `P.weight` int8 [out, in] (q, signed), `P.weight_scale`
  [out, groups], `P.weight_zero_point` int8 (asym).
NOTE: compressed-tensors' own decompression computes s * (q - z) in the scale's dtype (bf16: one more rounding); the
blocks hold the exact value (the scale must be an fp16 value: int_groups.fp16_scales). W8A8's dynamic per-token int8
activations are not applied: the activations stay float (--activation-dtype int8 quantises per 32 inputs instead),
which the origin ('... W8A8 (its per-token int8 activations not applied)') says in the worker's start-up
line."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from worker_svc.quant.int_groups import IntGroups, fp16_scales, unpack_words

FORMATS = ("pack-quantized", "int-quantized", "naive-quantized")
SUFFIXES = (".weight_packed", ".weight_scale", ".weight_zero_point", ".weight_shape", ".weight_g_idx")


def compressed_spec(qc: dict) -> tuple[str, dict, bool]:
    """(format, the weights' quantisation args, whether activations are quantised) of the config; ValueError naming
    the field for what is not read (several weight schemes, float types, tensor or block strategies, act order)."""
    fmt = qc.get("format")
    if fmt not in FORMATS:
        raise ValueError(f"quantization_config.format {fmt!r}: compressed-tensors is read as {', '.join(FORMATS)}")
    groups = qc.get("config_groups")
    if not isinstance(groups, dict) or not groups:
        raise ValueError("quantization_config.config_groups: missing")
    schemes = [g.get("weights") for g in groups.values()]
    if any(s != schemes[0] for s in schemes) or not isinstance(schemes[0], dict):
        raise ValueError("quantization_config.config_groups: one weights scheme for every group is read here")
    if any(g.get("format", fmt) != fmt for g in groups.values()):
        raise ValueError("quantization_config.config_groups.*.format: one format for every group is read here")
    w = schemes[0]
    bits, strategy = w.get("num_bits"), w.get("strategy")
    if w.get("type", "int") != "int" or bits != (4 if fmt == "pack-quantized" else 8):
        raise ValueError(f"quantization_config weights type {w.get('type')!r} num_bits {bits!r}: {fmt} is read as "
                         f"int{4 if fmt == 'pack-quantized' else 8}")
    if strategy not in ("channel", "group"):
        raise ValueError(f"quantization_config weights strategy {strategy!r}: channel or group is read here")
    if w.get("dynamic") or w.get("actorder") not in (None, False):
        raise ValueError("quantization_config weights dynamic / actorder: not read here")
    acts = [g.get("input_activations") for g in groups.values()]
    return fmt, w, any(a is not None for a in acts)


def origin(fmt: str, w: dict, quantized_activations: bool) -> str:
    group = f"group {w.get('group_size')}" if w.get("strategy") == "group" else "per channel"
    scheme = f"W{w['num_bits']}A{8 if quantized_activations else 16}"
    note = " (its per-token int8 activations not applied)" if quantized_activations else ""
    return f"compressed-tensors {scheme}{note} {'sym' if w.get('symmetric', True) else 'asym'}, {group}"


def unpack_compressed(prefix: str, tensors: dict[str, torch.Tensor], fmt: str, w: dict) -> IntGroups:
    """One Linear's tensors as IntGroups; ValueError naming the tensor that does not fit."""
    bits = int(w["num_bits"])
    scale = tensors.get(f"{prefix}.weight_scale")
    zp = tensors.get(f"{prefix}.weight_zero_point")
    if scale is None or scale.dim() != 2:
        raise ValueError(f"{prefix}.weight_scale: missing or not [out, groups]")
    if fmt == "pack-quantized":
        packed = tensors[f"{prefix}.weight_packed"]
        shape = tensors.get(f"{prefix}.weight_shape")
        if packed.dtype != torch.int32 or shape is None:
            raise ValueError(f"{prefix}.weight_packed: not int32 with a weight_shape")
        num_out, num_in = (int(n) for n in shape.tolist())
        if num_in * bits % 32:
            raise ValueError(f"{prefix}: {num_in} inputs of {bits} bits are not whole int32 words")
        q = unpack_words(packed.numpy(), bits, axis=1)[:num_out, :num_in]
        offset = 1 << (bits - 1)  # the packed quants are unsigned already
        zero = None if zp is None else unpack_words(zp.numpy(), bits, axis=0)[:num_out].astype(np.int32)
    else:
        weight = tensors[f"{prefix}.weight"]
        if weight.dtype != torch.int8:
            raise ValueError(f"{prefix}.weight: {weight.dtype}, not int8")
        num_out, num_in = weight.shape
        offset = 128
        q = (weight.numpy().astype(np.int32) + offset).astype(np.uint8)
        zero = None if zp is None else zp.numpy().astype(np.int32) + offset
    num_groups = scale.shape[1]
    group = num_in if w.get("strategy") == "channel" else int(w.get("group_size") or 0)
    if group <= 0 or -(-num_in // group) != num_groups or scale.shape[0] != num_out:
        raise ValueError(f"{prefix}.weight_scale {list(scale.shape)} does not fit {num_out} outputs of {num_in} "
                         f"inputs in groups of {group}")
    zero = np.full((num_out, num_groups), offset, np.int32) if zero is None else zero.reshape(num_out, num_groups)
    return IntGroups(group, np.ascontiguousarray(q), fp16_scales(f"{prefix}.weight_scale", scale), zero)


def read_compressed_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """The dir's quantised Linear tensors: every *.safetensors tensor with one of SUFFIXES, and int8 `P.weight`s."""
    from safetensors import safe_open

    tensors = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                if name.endswith(SUFFIXES) or (name.endswith(".weight") and f.get_slice(name).get_dtype() == "I8"):
                    tensors[name] = f.get_tensor(name)
    return tensors
