"""A GGUF file's block-quantised weights, as raw blocks under the parameter names (and in the row order) of the Hugging
Face model that worker_svc.model_store.convert_gguf builds from it, and their check against the float weights that
conversion writes."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from worker_svc.quant.formats import FORMATS_BY_GGML_TYPE
from worker_svc.quant.weight import QuantWeight

# NOTE: transformers' GGUF loader changes the tensors of most architectures (its TENSOR_PROCESSORS: transposes,
# reshapes, experts split, norms shifted) beyond a reordering of rows; only these are read as stored (no processor)
# or with their rows reordered, the one change that blocks follow exactly (rows are independent). Any other
# architecture keeps no quantised weights.
ROW_ORDER_ARCHS = {"llama"}  # attn_q, attn_k: rope's row permutation undone (rope_heads, reverse_rope_rows)
# Architectures whose processor changes only 1-D tensors, so every 2-D weight is read as stored: gemma3's
# (Gemma2TensorProcessor) subtracts 1 from the norm weights, which are float32 vectors, never blocks. NOTE: llama.cpp
# stores Gemma's q/k unpermuted (its rope is the neox, half-split, one, as transformers').
AS_STORED_ARCHS = {"gemma3"}


def quantized_weights(gguf_path: Path, model: torch.nn.Module, gguf_config: dict) -> dict[str, QuantWeight]:
    """{parameter name: QuantWeight} for every 2-D tensor of the GGUF file in one of worker_svc.quant's formats that
    maps to a parameter of `model` (the model conversion built from the file), its rows in the order that
    conversion's float weight has them. `gguf_config`: the config transformers' loader parsed from the file. A tied
    output (no output.weight in the file) is the embedding's alone."""
    import gguf
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    reader = gguf.GGUFReader(str(gguf_path))
    arch = reader.fields["general.architecture"].contents()
    if arch in TENSOR_PROCESSORS and arch not in ROW_ORDER_ARCHS | AS_STORED_ARCHS:
        return {}
    names = hf_names(arch, model)
    weights = {}
    for tensor in reader.tensors:
        fmt = FORMATS_BY_GGML_TYPE.get(int(tensor.tensor_type))
        hf_name = names.get(tensor.name)
        if fmt is None or hf_name is None or len(tensor.shape) != 2:
            continue
        blocks = np.asarray(tensor.data)  # uint8 [out, row_bytes]; GGUF's shape is (in, out), innermost first
        num_heads = rope_heads(arch, tensor.name, gguf_config)
        if num_heads is not None:
            blocks = blocks[reverse_rope_rows(blocks.shape[0], num_heads)]
        shape = (int(tensor.shape[1]), int(tensor.shape[0]))
        # NOTE: a copy, contiguous and writable (the file's tensors are a read-only memory map)
        weights[hf_name] = QuantWeight(fmt, shape, torch.from_numpy(np.array(blocks, order="C")))
    return weights


def rope_heads(arch: str, gguf_name: str, gguf_config: dict) -> int | None:
    """The heads over which llama.cpp permuted the rows of `gguf_name` for rope, or None where they are as stored.
    NOTE: as transformers' LlamaTensorProcessor decides it: attn_q over the attention heads, attn_k over the KV
    heads, and neither where the parsed config lacks one of the two counts."""
    num_heads, num_kv_heads = gguf_config.get("num_attention_heads"), gguf_config.get("num_key_value_heads")
    if arch not in ROW_ORDER_ARCHS or None in (num_heads, num_kv_heads):
        return None
    if ".attn_q." in gguf_name:
        return num_heads
    if ".attn_k." in gguf_name:
        return num_kv_heads
    return None


def hf_names(arch: str, model: torch.nn.Module) -> dict[str, str]:
    """{GGUF tensor name: parameter name of `model`}, from gguf-py's tensor name map of `arch` over the model's
    state dict names (as transformers' loader maps them); the first parameter naming a GGUF tensor keeps it."""
    import gguf

    arch_ids = {name: arch_id for arch_id, name in gguf.MODEL_ARCH_NAMES.items()}
    if arch not in arch_ids:
        return {}
    name_map = gguf.get_tensor_name_map(arch_ids[arch], model.config.num_hidden_layers)
    names: dict[str, str] = {}
    for hf_name in model.state_dict():
        stem, dot, suffix = hf_name.rpartition(".")
        gguf_stem = name_map.get_name(stem) if dot else None
        if gguf_stem is not None:
            names.setdefault(f"{gguf_stem}.{suffix}", hf_name)
    return names


def reverse_rope_rows(num_rows: int, num_heads: int) -> np.ndarray:
    """Row indices that undo llama.cpp's rope permutation of a q or k projection of `num_heads` heads: row
    h * 2 * half + i * half + j of the result is row h * 2 * half + 2 * j + i of the file's (i in 0, 1; j < half),
    half = head_dim / 2; what transformers' LlamaTensorProcessor does to the float weight."""
    half = num_rows // num_heads // 2
    if num_heads * 2 * half != num_rows:
        raise ValueError(f"{num_rows} rows are not {num_heads} heads of an even size")
    return np.arange(num_rows).reshape(num_heads, half, 2).swapaxes(1, 2).reshape(-1)


def check_against_floats(weights: dict[str, QuantWeight], state_dict: dict[str, torch.Tensor]) -> None:
    """Each weight's blocks dequantise, cast to the dtype its float weight is saved in, to that weight bit for bit;
    else a RuntimeError naming the first that does not (blocks that disagree with the float weights are never
    kept)."""
    for name, weight in weights.items():
        saved = state_dict.get(name)
        if saved is None:
            raise RuntimeError(f"quantised weight {name} has no float weight of that name")
        mine = weight.dequantize().to(saved.dtype)
        if mine.shape != saved.shape or not bit_equal(mine, saved):
            raise RuntimeError(f"quantised weight {name} ({weight.format.name} {list(weight.shape)}) does not "
                               f"dequantise to its float weight ({saved.dtype} {list(saved.shape)})")


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bit_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype and shape, and the same bits (so -0.0 differs from 0.0, and a NaN equals the same NaN)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    bits = _BITS[a.element_size()]
    return torch.equal(a.contiguous().view(bits), b.contiguous().view(bits))
