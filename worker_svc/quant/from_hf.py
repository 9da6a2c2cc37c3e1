"""Hugging Face quantised checkpoints read without dequantising: a model dir whose config.json has a
`quantization_config` of quant_method "gptq" or "awq" stores each quantised Linear as int32-packed int4/int8 tensors
beside the float ones; each is read into the GGML blocks the quantised kernels run (int_groups: exactly, no rounding).
quant_method "compressed-tensors": from_compressed.

- GPTQ (AutoGPTQ / GPTQModel / optimum): `P.qweight` int32 [in * bits / 32, out] (each word 32 / bits inputs, lowest
  bits first), `P.qzeros` int32 [groups, out * bits / 32] (outputs, lowest first), `P.scales` fp16 [groups, out],
  `P.g_idx` int32 [in]; w = scales[g] * (q - z). checkpoint_format "gptq" (v1, the default) stores z - 1, "gptq_v2"
  z (NOTE: v1 is read as the field + 1, unmasked: a stored 15 is 16; v1 cannot hold a zero of 0). bits 4 or 8;
  group_size -1 is one group over all inputs; g_idx must be i // group_size (desc_act's permuted groups are refused).
- AWQ (AutoAWQ, version "gemm"): `P.qweight` int32 [in, out / 8] and `P.qzeros` int32 [groups, out / 8], 8 outputs a
  word in the order int_groups.AWQ_ORDER, `P.scales` fp16 [groups, out]; w = scales[g] * (q - z), 4 bits.

A field that would change the weights and is not implemented here is refused by name (ValueError)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from worker_svc.quant.from_compressed import (compressed_spec, origin, read_compressed_tensors,
                                              unpack_compressed)
from worker_svc.quant.int_groups import IntGroups, fp16_scales, to_blocks, unpack_awq, unpack_words
from worker_svc.quant.weight import QuantWeight

HF_METHODS = ("gptq", "awq", "compressed-tensors")


@dataclass(slots=True)
class HfQuantized:
    """The weights read (by parameter name, `P.weight`), the checkpoint tensors they replace (never loaded as
    floats), and what they were (the worker's start-up line: 'GPTQ 4-bit sym, group 128')."""

    weights: dict[str, QuantWeight]
    tensor_names: set[str] = field(default_factory=set)
    origin: str = ""


def hf_quant_method(config: dict) -> str | None:
    """config.json's quantization_config quant_method, lower case (None where it has none)."""
    qc = config.get("quantization_config")
    return str(qc.get("quant_method", "")).lower() if isinstance(qc, dict) else None


def load_hf_quantized(model_dir: str | Path, config: dict) -> HfQuantized:
    """The quantised weights of `model_dir` (config: its config.json); empty where it has no quantization_config. A
    quant_method other than HF_METHODS is refused by name."""
    method = hf_quant_method(config)
    if method is None:
        return HfQuantized({})
    if method not in HF_METHODS:
        raise ValueError(f"{model_dir}/config.json: quantization_config.quant_method {method!r} is not read here "
                         f"(one of {', '.join(HF_METHODS)}; other quantised checkpoints: a GGUF file)")
    qc = config["quantization_config"]
    if method == "compressed-tensors":
        return _load_compressed(Path(model_dir), qc)
    spec = _gptq_spec(qc) if method == "gptq" else _awq_spec(qc)
    tensors = _read_tensors(Path(model_dir))
    prefixes = sorted(name.removesuffix(".qweight") for name in tensors if name.endswith(".qweight"))
    if not prefixes:
        raise ValueError(f"{model_dir}: quantization_config says {method}, but no tensor is named *.qweight")
    result = HfQuantized({}, origin=spec.origin)
    for prefix in prefixes:
        parts = {s: tensors.get(f"{prefix}.{s}") for s in ("qweight", "qzeros", "scales", "g_idx")}
        for s in ("qweight", "qzeros", "scales"):
            if parts[s] is None:
                raise ValueError(f"{model_dir}: {prefix}.qweight has no {prefix}.{s}")
        groups = spec.unpack(prefix, parts)
        result.weights[f"{prefix}.weight"] = to_blocks(groups, f"{prefix}.qweight")
        result.tensor_names |= {f"{prefix}.{s}" for s, t in parts.items() if t is not None}
    return result


def _load_compressed(model_dir: Path, qc: dict) -> HfQuantized:
    if qc.get("quantization_status", "compressed") != "compressed" or qc.get("sparsity_config"):
        raise ValueError(f"{model_dir}/config.json: quantization_config.quantization_status "
                         f"{qc.get('quantization_status')!r} / sparsity_config: a compressed, dense checkpoint is read")
    fmt, w, quantized_activations = compressed_spec(qc)
    tensors = read_compressed_tensors(model_dir)
    prefixes = sorted(name.removesuffix(".weight_scale") for name in tensors if name.endswith(".weight_scale"))
    if not prefixes:
        raise ValueError(f"{model_dir}: quantization_config says compressed-tensors, but no tensor is *.weight_scale")
    result = HfQuantized({}, origin=origin(fmt, w, quantized_activations))
    for prefix in prefixes:
        groups = unpack_compressed(prefix, tensors, fmt, w)
        result.weights[f"{prefix}.weight"] = to_blocks(groups, f"{prefix}.weight_scale")
        result.tensor_names |= {name for name in tensors if name.startswith(f"{prefix}.weight")}
    return result


@dataclass(slots=True, frozen=True)
class _Spec:
    method: str
    bits: int
    group_size: int  # -1: one group over all inputs
    sym: bool
    zero_offset: int  # added to a stored zero (GPTQ v1 stores z - 1)
    desc_act: bool = False  # GPTQ's act-order: each Linear must have a g_idx (read only where it is in input order)

    @property
    def origin(self) -> str:
        group = "one group a row" if self.group_size == -1 else f"group {self.group_size}"
        return f"{self.method.upper()} {self.bits}-bit {'sym' if self.sym else 'asym'}, {group}"

    def unpack(self, prefix: str, parts: dict[str, torch.Tensor | None]) -> IntGroups:
        qweight, qzeros, scales = (_int32(prefix, parts[s], s) if s != "scales" else parts[s]
                                   for s in ("qweight", "qzeros", "scales"))
        if self.method == "gptq":
            q, zero = unpack_words(qweight, self.bits, axis=0).T, unpack_words(qzeros, self.bits, axis=1)
        else:
            q, zero = unpack_awq(qweight).T, unpack_awq(qzeros)
        num_out, num_in = q.shape
        group = num_in if self.group_size == -1 else self.group_size
        num_groups = -(-num_in // group)
        scale = fp16_scales(f"{prefix}.scales", scales)
        if scale.shape != (num_groups, num_out) or zero.shape[0] != num_groups or zero.shape[1] < num_out:
            raise ValueError(f"{prefix}: scales {list(scales.shape)} / qzeros {list(qzeros.shape)} do not fit "
                             f"{num_groups} groups of {group} inputs over {num_out} outputs (qweight "
                             f"{list(qweight.shape)})")
        g_idx = parts["g_idx"]
        if g_idx is None and self.desc_act:
            raise ValueError(f"{prefix}: quantization_config.desc_act true, and no {prefix}.g_idx says its groups")
        if g_idx is not None and not torch.equal(g_idx.to(torch.int64), torch.arange(num_in) // group):
            raise ValueError(f"{prefix}.g_idx: groups out of input order (desc_act / act-order) are not read here")
        return IntGroups(group, np.ascontiguousarray(q),
                         np.ascontiguousarray(scale.T), zero[:, :num_out].T.astype(np.int32) + self.zero_offset)


def _int32(prefix: str, t: torch.Tensor, what: str) -> np.ndarray:
    if t.dtype != torch.int32 or t.dim() != 2:
        raise ValueError(f"{prefix}.{what}: {t.dtype} {list(t.shape)}, not an int32 matrix of packed quants")
    return t.numpy()


def _gptq_spec(qc: dict) -> _Spec:
    bits, group_size = qc.get("bits"), qc.get("group_size", 128)
    if bits not in (4, 8):
        raise ValueError(f"quantization_config.bits {bits!r}: GPTQ is read with 4 or 8 bits")
    fmt = qc.get("checkpoint_format", "gptq")
    if fmt not in ("gptq", "gptq_v2"):
        raise ValueError(f"quantization_config.checkpoint_format {fmt!r}: GPTQ is read as gptq or gptq_v2")
    if qc.get("pack_dtype", "int32") not in ("int32", "torch.int32"):
        raise ValueError(f"quantization_config.pack_dtype {qc.get('pack_dtype')!r}: GPTQ is read packed in int32")
    _check_group(group_size)
    return _Spec("gptq", bits, group_size, bool(qc.get("sym", True)), 1 if fmt == "gptq" else 0,
                 bool(qc.get("desc_act", False)))


def _awq_spec(qc: dict) -> _Spec:
    bits, group_size = qc.get("bits", qc.get("w_bit")), qc.get("group_size", qc.get("q_group_size", 128))
    if bits != 4:
        raise ValueError(f"quantization_config.bits {bits!r}: AWQ is read with 4 bits")
    version = str(qc.get("version", "gemm")).lower()
    if version != "gemm":
        raise ValueError(f"quantization_config.version {version!r}: AWQ is read in the gemm packing only")
    if not qc.get("zero_point", True):
        raise ValueError("quantization_config.zero_point false: AWQ is read with zero points only")
    _check_group(group_size)
    return _Spec("awq", 4, group_size, False, 0)


def _check_group(group_size: object) -> None:
    if type(group_size) is not int or not (group_size == -1 or group_size > 0):
        raise ValueError(f"quantization_config.group_size {group_size!r}: a positive size or -1")


def _read_tensors(model_dir: Path) -> dict[str, torch.Tensor]:
    """Every tensor of the dir's *.safetensors whose name ends in a quantised Linear's suffix."""
    from safetensors import safe_open

    suffixes = (".qweight", ".qzeros", ".scales", ".g_idx")
    tensors = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            tensors.update({name: f.get_tensor(name) for name in f.keys() if name.endswith(suffixes)})
    return tensors
