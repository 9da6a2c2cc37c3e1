"""What the served model's files (or the scheduler's flags in their place) say about requests: the sampling defaults
of --generation-config, the chat template of --chat-template, and the names of --served-model-name."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from pagedserve_common.sampling import InvalidField, SamplingParams
from pagedserve_common.startup import StartupError

# generation_config.json's keys that set a request's default, as vLLM's --generation-config auto reads them
# (max_new_tokens is the API's max_tokens); other keys (do_sample, num_beams, ...) are not sampling defaults there.
GENERATION_CONFIG_KEYS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
                          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
NO_MODEL_DEFAULTS = "vllm"  # vLLM's value for "the API's own defaults"


def sampling_defaults(spec: str, model_dir: str) -> SamplingParams:
    """The defaults of fields a request leaves unset: SamplingParams() with what `spec`'s generation_config.json
    sets (auto: the model's; vllm: none; else a directory). A value out of range fails the start, naming the file."""
    found, path = _generation_config(spec, model_dir)
    try:
        defaults = dataclasses.replace(SamplingParams(), **found)
        defaults.validate()
    except (InvalidField, TypeError) as e:
        raise StartupError(f"--generation-config {spec}: {path}: {e}") from None
    return defaults


def fill_context_cap(spec: str, model_dir: str) -> int | None:
    """Where a request that leaves max_tokens unset and would generate to the context's end (chat, Responses)
    stops instead: generation_config.json's max_new_tokens, as vLLM caps it; None: the context's end."""
    return _generation_config(spec, model_dir)[0].get("max_tokens")


def _generation_config(spec: str, model_dir: str) -> tuple[dict, Path | None]:
    """(the request defaults `spec`'s generation_config.json sets, in SamplingParams' names; its path)."""
    if spec == NO_MODEL_DEFAULTS:
        return {}, None
    path = Path(model_dir if spec == "auto" else spec) / "generation_config.json"
    if not path.is_file():
        if spec == "auto":
            return {}, None  # NOTE: many checkpoints have none
        raise StartupError(f"--generation-config {spec}: no generation_config.json there")
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise StartupError(f"--generation-config {spec}: cannot read {path}: {e}") from None
    return {ours: config[theirs] for theirs, ours in GENERATION_CONFIG_KEYS.items()
            if isinstance(config, dict) and config.get(theirs) is not None}, path


def chat_template(spec: str | None) -> str | None:
    """--chat-template: a file's text, or `spec` itself when it names no file (a template has `{` in it)."""
    if spec is None:
        return None
    path = Path(spec).expanduser()
    if "{" not in spec:
        try:
            return path.read_text()
        except OSError as e:
            raise StartupError(f"--chat-template {spec}: cannot read it ({e.strerror})") from None
    return spec


def model_names(served_model_name: tuple[str, ...] | None, model: str) -> tuple[str, ...]:
    """The names a request may give as `model`: --served-model-name's (the first is the one answers carry), else
    --model's. NOTE: duplicates dropped, order kept."""
    return tuple(dict.fromkeys(served_model_name or (model,)))
