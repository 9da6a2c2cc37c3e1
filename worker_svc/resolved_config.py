"""A converted model dir's config as transformers resolved it at conversion, read without transformers.

Why: the worker that serves a model's blocks as stored reads a handful of its config's values (checkpoint_tree.py,
the lean forwards); transformers' own config classes would cost it ~51 MB resident for the process's life (their
import pulls type validators -> activations -> hub kernels -> torch.distributed.tensor and sympy in)."""

from __future__ import annotations

import json
from pathlib import Path

RESOLVED_CONFIG = "resolved_config.json"  # to_dict() of the config transformers read: every default filled in


class ResolvedConfig:
    """RESOLVED_CONFIG's values as attributes (getattr's default where a key is absent), and to_dict()."""

    __slots__ = ("_values",)

    def __init__(self, values: dict) -> None:
        self._values = dict(values)

    def __getattr__(self, name: str):
        try:
            return self._values[name]
        except KeyError:
            raise AttributeError(name) from None

    def to_dict(self) -> dict:
        return dict(self._values)


def write_resolved_config(model_dir: Path, config) -> None:
    """RESOLVED_CONFIG for `model_dir` from its transformers `config` (at conversion, where transformers is loaded),
    without `_name_or_path` (the dir it was read from: a conversion's temporary one)."""
    values = {k: v for k, v in config.to_dict().items() if k != "_name_or_path"}
    (model_dir / RESOLVED_CONFIG).write_text(json.dumps(values, indent=2, sort_keys=True) + "\n")


def resolved_config(model_dir: Path) -> ResolvedConfig | None:
    """The dir's RESOLVED_CONFIG where it has one whose ropes are all the default one (the only one this module
    computes without transformers' config methods), else None: transformers' config class reads config.json."""
    path = model_dir / RESOLVED_CONFIG
    if not path.is_file():
        return None
    config = ResolvedConfig(json.loads(path.read_text()))
    ropes = rope_parameters(config).values()
    return config if all((p or {}).get("rope_type", "default") == "default" for p in ropes) else None


def rope_parameters(config) -> dict:
    """{layer type or "": rope parameters}: Gemma 3 keys them by layer type, the Llama family has one set."""
    params = config.rope_parameters
    types = set(getattr(config, "layer_types", None) or ())
    if types and types <= set(params):
        return {t: params[t] for t in sorted(types)}
    return {"": params}
