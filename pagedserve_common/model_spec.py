"""What `--model` takes (a directory, a .gguf file, a Hub repo id, a known name), and its errors; no heavy imports."""

from __future__ import annotations

import re
from collections.abc import Collection
from pathlib import Path

DIR, GGUF, HUB, KNOWN = "dir", "gguf", "hub", "known"  # the kinds of spec classify() tells apart
FORMS = ("a Hugging Face model directory (holding config.json), a .gguf file, a Hugging Face Hub repo id "
         "(ORG/NAME, at --revision), or a known name")
MODEL_HELP = ("the model: a local Hugging Face model directory, a .gguf file (converted once into the cache), a "
              "Hugging Face Hub repo id ORG/NAME (downloaded once into the cache; HF_ENDPOINT, HF_TOKEN, "
              "HF_HUB_OFFLINE apply), or a known name")
REVISION_HELP = "the branch, tag or commit of a Hub repo id --model (no other --model has revisions)"
LOCAL_HINT = "pass a local model instead: --model DIR (a Hugging Face model directory) or --model FILE.gguf"
# NOTE: ORG/NAME only: the Hub's few legacy ids without an organisation ("gpt2") would read as a known name here;
# their ORG/NAME form ("openai-community/gpt2") works.
HUB_REPO_ID = re.compile(r"[A-Za-z0-9][\w.-]{0,95}/[A-Za-z0-9][\w.-]{0,95}")
COMMIT = re.compile(r"[0-9a-f]{40}")


class ModelSpecError(ValueError):
    """--model (or --revision) names nothing pagedserve can load: a bad flag value (exit code 2)."""


class ModelFetchError(RuntimeError):
    """--model is well formed but could not be fetched or converted (offline, no such repo, no safetensors
    weights): exit code 1. The message is one line, naming the model and what to do."""


def classify(spec: str, known: Collection[str], revision: str | None = None) -> str:
    """DIR, GGUF, HUB or KNOWN for a --model value; ModelSpecError (naming --model and the accepted forms) for
    anything else, and for a --revision given with a spec that has none."""
    path = Path(spec).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelSpecError(f"--model {spec}: the directory has no config.json (a Hugging Face model "
                                 f"directory holds config.json, the tokenizer files and *.safetensors)")
        kind = DIR
    elif spec.lower().endswith(".gguf"):
        if not path.is_file():
            raise ModelSpecError(f"--model {spec}: no such .gguf file")
        kind = GGUF
    elif spec in known:
        kind = KNOWN
    elif HUB_REPO_ID.fullmatch(spec) and ".." not in spec:
        kind = HUB
    else:
        raise ModelSpecError(f"--model {spec!r}: no such directory or .gguf file, and not a Hub repo id or known "
                             f"name; --model takes {FORMS} ({', '.join(sorted(known))})")
    if revision is not None and kind != HUB:
        raise ModelSpecError(f"--revision {revision}: only a Hugging Face Hub repo id has revisions, not --model "
                             f"{spec}")
    return kind


def snapshot_commit(model_dir: str | Path) -> str | None:
    """The commit of a Hub snapshot directory (…/snapshots/COMMIT, as model_hub returns), else None."""
    path = Path(model_dir)
    return path.name if path.parent.name == "snapshots" and COMMIT.fullmatch(path.name) else None
