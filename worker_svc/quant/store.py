"""Quantised weights stored in a model dir beside its float weights: QUANTIZED_FILE holds each weight's raw blocks
(uint8 [out, row_bytes], under the float weight's parameter name), QUANTIZATION_JSON what they are:

    {"source": "gguf", "tensors": {"model.layers.0.self_attn.q_proj.weight": {"format": "q4_1", "shape": [576, 576]}}}

A dir without QUANTIZATION_JSON has none (a Hub snapshot, a converted dir of before; the float weights serve)."""

from __future__ import annotations

import json
from pathlib import Path

from worker_svc.quant.formats import FORMATS, QuantFormat
from worker_svc.quant.weight import QuantWeight

QUANTIZED_FILE = "quantized.safetensors"
QUANTIZATION_JSON = "quantization.json"


def save_quantized(model_dir: Path, weights: dict[str, QuantWeight], source: str) -> None:
    """Write `weights` (possibly none) into `model_dir`: QUANTIZED_FILE, then QUANTIZATION_JSON."""
    from safetensors.torch import save_file

    save_file({name: w.blocks for name, w in weights.items()}, str(model_dir / QUANTIZED_FILE))
    entries = [f"    {json.dumps(name)}: {json.dumps({'format': w.format.name, 'shape': list(w.shape)})}"
               for name, w in sorted(weights.items())]  # one line a tensor
    body = "{\n" + ",\n".join(entries) + "\n  }" if entries else "{}"
    (model_dir / QUANTIZATION_JSON).write_text(f'{{\n  "source": {json.dumps(source)},\n  "tensors": {body}\n}}\n')


def load_quantized(model_dir: str | Path) -> dict[str, QuantWeight]:
    """{parameter name: QuantWeight} of `model_dir`, {} where it has no QUANTIZATION_JSON. NOTE: the dir may be the
    user's: every entry is checked against its tensor (format known, shape two positive sizes of whole blocks,
    blocks uint8 of the bytes that shape takes) and a file that disagrees is a ValueError naming the tensor and
    the field."""
    from safetensors import SafetensorError

    model_dir = Path(model_dir)
    index_path, blocks_path = model_dir / QUANTIZATION_JSON, model_dir / QUANTIZED_FILE
    if not index_path.is_file():
        return {}
    try:
        index = json.loads(index_path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{index_path}: not JSON ({e})") from None
    entries = index.get("tensors") if isinstance(index, dict) else None
    if not isinstance(entries, dict):
        raise ValueError(f"{index_path}: no \"tensors\" object")
    if not entries:
        return {}
    kinds = {name: _format_and_shape(f"{index_path}: tensor {name!r}", entry) for name, entry in entries.items()}
    if not blocks_path.is_file():
        raise ValueError(f"{index_path} lists {len(entries)} tensors, but there is no {QUANTIZED_FILE}")
    try:
        return _read_blocks(blocks_path, kinds)
    except SafetensorError as e:
        raise ValueError(f"{blocks_path}: not a safetensors file ({e})") from None


def _read_blocks(blocks_path: Path, kinds: dict[str, tuple[QuantFormat, tuple[int, int]]]) -> dict[str, QuantWeight]:
    from safetensors import safe_open

    where = blocks_path.parent / QUANTIZATION_JSON
    weights = {}
    with safe_open(str(blocks_path), framework="pt") as stored:
        names = set(stored.keys())
        for name, (fmt, shape) in kinds.items():
            if name not in names:
                raise ValueError(f"{where}: tensor {name!r}: not in {QUANTIZED_FILE}")
            try:
                weights[name] = QuantWeight(fmt, shape, stored.get_tensor(name), (str(blocks_path), name))
            except ValueError as e:
                raise ValueError(f"{where}: tensor {name!r}: {e}") from None
        unlisted = sorted(names - set(kinds))
        if unlisted:
            raise ValueError(f"{blocks_path}: tensor {unlisted[0]!r} has no entry in {QUANTIZATION_JSON}")
    return weights


def remapped(weight: QuantWeight) -> QuantWeight:
    """`weight` over a fresh mapping of its file (itself where its blocks are in memory).

    Why: a mapping stays whole while any view of it lives, and every page of it once read stays resident. Packing
    the kernels' panels reads every block of the file once; an embedding kept quantised, read row by row after that,
    takes a mapping of its own, none of whose pages has been read, and the first mapping goes with the packed
    weights' views (91 MB resident of the default model's file, else, for the process's life)."""
    from safetensors import safe_open

    if weight.source is None:
        return weight
    path, name = weight.source
    with safe_open(path, framework="pt") as stored:
        return QuantWeight(weight.format, weight.shape, stored.get_tensor(name), weight.source)


def _format_and_shape(where: str, entry: object) -> tuple[QuantFormat, tuple[int, int]]:
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: its entry is not an object")
    name = entry.get("format")
    if not isinstance(name, str) or name not in FORMATS:
        raise ValueError(f"{where}: format {name!r} is not one of {', '.join(FORMATS)}")
    shape = entry.get("shape")
    if not (isinstance(shape, list) and len(shape) == 2 and all(type(n) is int and n > 0 for n in shape)):
        raise ValueError(f"{where}: shape {shape!r} is not two positive sizes [out, in]")
    return FORMATS[name], (shape[0], shape[1])
