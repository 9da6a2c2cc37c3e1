"""A GGUF file converted into a Hugging Face model dir (config.json, float safetensors, tokenizer) through
transformers' GGUF loader, its block-quantised weights also kept as stored (worker_svc.quant), per architecture where
the file and transformers' loader leave something out or differ (rope bases, the tokenizer's class and BOS)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

import structlog

from worker_svc.resolved_config import write_resolved_config

if TYPE_CHECKING:
    import torch

log = structlog.get_logger("pagedserve.model")

MODEL_INPUT_NAMES = ["input_ids", "attention_mask"]
# Gemma 3's sliding-window layers use rope base 10000, which its GGUF does not store (llama.cpp fixes it in code:
# rope_freq_base_train_swa); transformers' Gemma3TextConfig defaults to the same.
GEMMA3_LOCAL_ROPE_THETA = 10000.0


TENSOR_LOG_PARTS = 4  # without a terminal, `converting tensors` is logged at 0, 25, 50, 75 and 100% of them


class TensorProgress:
    """The tensors of a GGUF file dequantised so far: on a terminal (stderr, with progress bars on) a tqdm bar;
    otherwise a `converting tensors` log line (converted, total) at the start, at each quarter and at the end."""

    def __init__(self, bar: bool | None = None) -> None:
        self.bar = _bars_wanted() if bar is None else bar
        self.total = self.converted = 0
        self.logged = -1  # the last part logged (0..TENSOR_LOG_PARTS)
        self._tqdm = None

    def track(self, tensors: Iterable) -> Iterator:
        """`tensors`, counted as the caller goes through them."""
        tensors = list(tensors)
        self.start(len(tensors))
        for tensor in tensors:
            yield tensor
            self.advance()

    def start(self, total: int) -> None:
        self.total, self.converted, self.logged = total, 0, -1
        if self.bar:
            from tqdm import tqdm

            self.close()
            self._tqdm = tqdm(total=total, desc="converting tensors", unit="tensor", leave=False,
                              file=sys.stderr)
        else:
            self._log()

    def advance(self, n: int = 1) -> None:
        self.converted += n
        if self._tqdm is not None:
            self._tqdm.update(n)
        elif not self.bar:
            self._log()

    def close(self) -> None:
        if self._tqdm is not None:
            self._tqdm.close()
            self._tqdm = None

    def _log(self) -> None:
        part = self.converted * TENSOR_LOG_PARTS // self.total if self.total else TENSOR_LOG_PARTS
        if part > self.logged:
            self.logged = part
            log.info("converting tensors", converted=self.converted, total=self.total)


def _bars_wanted() -> bool:
    """A bar where stderr is a terminal, unless bars are off (TQDM_DISABLE: pagedserve_cli.logs sets it for JSON
    logs)."""
    off = os.environ.get("TQDM_DISABLE", "").strip().lower() in ("1", "true", "yes")
    return not off and sys.stderr.isatty()


@contextmanager
def _tensors_counted(progress: TensorProgress) -> Iterator[None]:
    """transformers' GGUF loader counting its tensors into `progress`. NOTE: load_gguf_checkpoint goes through the
    tensors in `for tensor in tqdm(reader.tensors, ...)`, its module's tqdm, with no callback of its own: that name
    is swapped for progress.track while the loader runs (so not thread-safe: one conversion at a time a process)."""
    import transformers.modeling_gguf_pytorch_utils as loader

    original = getattr(loader, "tqdm", None)
    loader.tqdm = lambda iterable, *args, **kwargs: progress.track(iterable)
    try:
        yield
    finally:
        if original is None:
            del loader.tqdm
        else:
            loader.tqdm = original
        progress.close()


def convert_gguf(gguf_path: Path, out_dir: Path, progress: TensorProgress | None = None) -> "torch.dtype":
    """Dequantise a GGUF checkpoint into an HF model dir (safetensors), its quantised weights also kept as they are
    (_keep_quantized); the tensors' progress as `progress` shows it (a bar on a terminal, else log lines). Returns
    the dtype the float weights were saved in. NOTE: writes no completion marker (model_store does)."""
    import gguf
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    src, fname = str(gguf_path.parent), gguf_path.name
    fields = gguf.GGUFReader(str(gguf_path)).fields
    arch = _field(fields, "general.architecture")
    config = AutoConfig.from_pretrained(src, gguf_file=fname)
    # A model loaded with from_pretrained(gguf_file=...) needs accelerate and refuses save_pretrained,
    # so build the class from its config and load the dequantised tensors ourselves.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    progress = TensorProgress() if progress is None else progress
    with _tensors_counted(progress):
        parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)
    tensors = parsed["tensors"]
    if not progress.total:  # a transformers that no longer counts through its tqdm: the count at least, once done
        progress.start(len(tensors))
        progress.advance(len(tensors))
        progress.close()
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"GGUF tensors do not match the model: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    dtype = _lossless_dtype(tensors)
    model.to(dtype).save_pretrained(out_dir)
    _keep_quantized(gguf_path, model, parsed["config"], out_dir)

    thetas = _rope_thetas(arch, float(parsed["config"]["rope_theta"]))
    _patch_json(out_dir / "config.json", **_legacy_rope_keys(thetas))

    log.info("converting tokenizer", gguf=fname)  # NOTE: seconds for a real vocabulary, with no bar of its own
    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=fname)
    tokenizer.save_pretrained(out_dir)
    bos = _add_bos(fields)
    _patch_json(out_dir / "tokenizer_config.json", model_input_names=MODEL_INPUT_NAMES, add_bos_token=bos,
                model_max_length=config.max_position_embeddings, drop=("is_local", "local_files_only"),
                **_tokenizer_updates(fields))
    # NOTE: the config as transformers resolves it, for a worker that reads it without transformers' config classes
    write_resolved_config(out_dir, _verify(out_dir, thetas, bos))
    return dtype


def _field(fields: dict, name: str, default=None):
    """A GGUF metadata field's value (`default` where the file has none)."""
    field = fields.get(name)
    return default if field is None else field.contents()


def _rope_thetas(arch: str, freq_base: float) -> dict[str, float]:
    """The rope base of each attention layer type, as the converted config must hold them: {"": theta} for a model
    of one base; Gemma 3's full-attention layers take the file's rope.freq_base, its sliding ones
    GEMMA3_LOCAL_ROPE_THETA."""
    if arch == "gemma3":
        return {"full_attention": freq_base, "sliding_attention": GEMMA3_LOCAL_ROPE_THETA}
    return {"": freq_base}


def _legacy_rope_keys(thetas: dict[str, float]) -> dict[str, float]:
    """The top-level keys older transformers read the rope bases from (transformers 5 keeps them only under
    rope_parameters): rope_theta, and Gemma 3's rope_local_base_freq for its sliding layers."""
    if "" in thetas:
        return {"rope_theta": thetas[""]}
    return {"rope_theta": thetas["full_attention"], "rope_local_base_freq": thetas["sliding_attention"]}


def _add_bos(fields: dict) -> bool:
    """Whether the tokenizer puts BOS in front of a prompt: a byte-level BPE vocabulary (tokenizer.ggml.model gpt2,
    the SmolLM2 family) never, as its Hugging Face original does not; a SentencePiece one (llama, Gemma) as the
    file's tokenizer.ggml.add_bos_token says."""
    if _field(fields, "tokenizer.ggml.model") == "gpt2":
        return False
    return bool(_field(fields, "tokenizer.ggml.add_bos_token", False))


def _tokenizer_updates(fields: dict) -> dict:
    """tokenizer_config.json's other changes: a byte-level BPE vocabulary loads as GPT2Tokenizer (the same
    tokenizer.json in transformers 4 and 5); a SentencePiece one keeps the class transformers gave it
    (GemmaTokenizer, LlamaTokenizer), and its add_eos_token is the file's."""
    if _field(fields, "tokenizer.ggml.model") == "gpt2":
        return {"tokenizer_class": "GPT2Tokenizer"}
    return {"add_eos_token": bool(_field(fields, "tokenizer.ggml.add_eos_token", False))}


def _keep_quantized(gguf_path: Path, model, gguf_config: dict, out_dir: Path) -> None:
    """The GGUF's block-quantised weights, raw, beside the float ones (worker_svc.quant.store), each checked first
    to dequantise bit for bit to the float weight `model` (as saved) has under its name: a RuntimeError names one
    that does not."""
    from worker_svc.quant.from_gguf import check_against_floats, quantized_weights
    from worker_svc.quant.store import save_quantized

    weights = quantized_weights(gguf_path, model, gguf_config)
    check_against_floats(weights, model.state_dict())
    save_quantized(out_dir, weights, source="gguf")


def _lossless_dtype(tensors: dict) -> "torch.dtype":
    """The smallest of bf16/f16 that holds every dequantised value exactly, else float32."""
    import torch

    for dtype in (torch.bfloat16, torch.float16):
        if all(torch.equal(t.to(dtype).to(t.dtype), t) for t in tensors.values()):
            return dtype
    return torch.float32


def _patch_json(path: Path, drop: tuple[str, ...] = (), **updates) -> None:
    data = json.loads(path.read_text())
    for key in drop:
        data.pop(key, None)
    data.update(updates)
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def _verify(out_dir: Path, thetas: dict[str, float], bos: bool):
    """Cheap round-trip checks of what we wrote (config and tokenizer, not the weights): each layer type's rope
    base, and BOS in front of an encoded text exactly where `bos`. Returns the config transformers reads."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(out_dir)
    for layer_type, theta in thetas.items():
        params = config.rope_parameters[layer_type] if layer_type else config.rope_parameters
        if params.get("rope_theta") != theta:
            raise RuntimeError(f"rope theta{f' of {layer_type}' if layer_type else ''} did not round-trip: "
                               f"{config.rope_parameters} != {theta}")
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    if (tokenizer("hello")["input_ids"][0] == tokenizer.bos_token_id) != bos:
        raise RuntimeError(f"converted tokenizer {'does not add' if bos else 'adds'} a BOS token")
    return config
