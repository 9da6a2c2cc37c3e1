"""Download a model from the Hugging Face Hub (or a Hub-compatible HF_ENDPOINT) into the model cache: only the
files pagedserve loads, once; later starts reuse the cache, offline too."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import structlog

from pagedserve_common.model_spec import LOCAL_HINT, ModelFetchError, ModelSpecError

log = structlog.get_logger("pagedserve.model")

DEFAULT_ENDPOINT = "https://huggingface.co"
WEIGHTS_INDEX = "model.safetensors.index.json"
# What a model needs besides its weights: config, generation defaults, tokenizer (any of the usual formats), chat
# template, and the index that names the weight shards.
SMALL_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "tokenizer.model",
               "special_tokens_map.json", "added_tokens.json", "vocab.json", "merges.txt", "chat_template.jinja",
               "chat_template.json", WEIGHTS_INDEX)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")  # one of them is the tokenizer itself
OTHER_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")  # weights pagedserve does not load
TRUE = ("1", "true", "yes", "on")


def hub_cache(cache_root: Path) -> Path:
    """Where Hub downloads live: huggingface_hub's cache layout (refs, blobs, snapshots) under the model cache."""
    return cache_root / "hub"


def endpoint() -> str:
    return os.environ.get("HF_ENDPOINT", DEFAULT_ENDPOINT).rstrip("/")


def offline() -> bool:
    # NOTE: read now, not when huggingface_hub was imported (which reads it once).
    return (os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or "").strip().lower() in TRUE


def download(repo_id: str, revision: str | None, cache_root: Path) -> Path:
    """The snapshot directory of `repo_id` at `revision` (default: the repo's default branch) in the cache, with
    its config, tokenizer and safetensors weights; ModelFetchError (one line) if that cannot be had."""
    cache, url, local_only = hub_cache(cache_root), endpoint(), offline()
    started = time.monotonic()
    log.info("fetching model", model=repo_id, revision=revision or "default branch", endpoint=url,
             offline=local_only, cache=str(cache))
    with _hub_errors(repo_id, revision, url, local_only, cache):
        # Two passes: the small files first (they say which weight files the model has), then those weights at the
        # commit the first pass found, so both come from one commit even if the branch moves meanwhile.
        meta = Path(_snapshot(repo_id, revision, cache, list(SMALL_FILES), url, local_only))
        weights = _weight_files(repo_id, meta, cache)
        snapshot = Path(_snapshot(repo_id, meta.name, cache, weights, url, local_only))
    missing = [w for w in weights if not (snapshot / w).is_file()]
    if missing:
        raise ModelFetchError(f"--model {repo_id}: the download misses {', '.join(missing)}")
    num_bytes = sum((snapshot / f).stat().st_size for f in os.listdir(snapshot) if (snapshot / f).is_file())
    log.info("fetched model", model=repo_id, commit=snapshot.name, num_files=len(os.listdir(snapshot)),
             bytes=num_bytes, seconds=round(time.monotonic() - started, 1), path=str(snapshot))
    return snapshot


def _snapshot(repo_id: str, revision: str | None, cache: Path, patterns: list[str], url: str,
              local_only: bool) -> str:
    from huggingface_hub import snapshot_download

    # NOTE: token=None: huggingface_hub reads HF_TOKEN (then its saved login) on each call.
    return snapshot_download(repo_id, revision=revision, cache_dir=cache, allow_patterns=patterns, endpoint=url,
                             local_files_only=local_only, library_name="pagedserve")


def _weight_files(repo_id: str, meta: Path, cache: Path) -> list[str]:
    """The safetensors files the model's weights are in (its index names the shards), after checking that the
    small files hold a config and a tokenizer. NOTE: a repo may also carry other copies of the weights
    (consolidated.safetensors, .bin, subfolders): only the ones transformers loads are fetched."""
    present = set(os.listdir(meta))
    if "config.json" not in present:
        raise ModelFetchError(f"--model {repo_id}: the repo has no config.json (not a transformers model)")
    if not present & set(TOKENIZER_FILES):
        raise ModelFetchError(f"--model {repo_id}: the repo has no tokenizer ({' / '.join(TOKENIZER_FILES)})")
    if WEIGHTS_INDEX in present:
        shards = json.loads((meta / WEIGHTS_INDEX).read_text()).get("weight_map", {}).values()
        return sorted(set(shards))
    files = _repo_files(repo_id, meta, cache)
    top = sorted(f for f in files if "/" not in f and f.endswith(".safetensors"))
    if not top:
        other = sorted(f for f in files if f.endswith(OTHER_WEIGHTS))
        has = f"it has {', '.join(other[:4])}" if other else "it has no weights at all"
        raise ModelFetchError(f"--model {repo_id}: the repo has no safetensors weights ({has}); pagedserve loads "
                              f"*.safetensors (a .gguf file: download it and pass its path as --model)")
    return ["model.safetensors"] if "model.safetensors" in top else top


def _repo_files(repo_id: str, meta: Path, cache: Path) -> list[str]:
    """Every file of the repo at the snapshot's commit, from the tree listing the download cached (no network)."""
    from huggingface_hub import get_cached_repo_tree
    from huggingface_hub.errors import CachedRepoTreeNotFoundError

    try:
        return [f.path for f in get_cached_repo_tree(repo_id, revision=meta.name, cache_dir=cache)]
    except CachedRepoTreeNotFoundError:  # NOTE: a cache an older huggingface_hub wrote: what is on disk
        return sorted(str(p.relative_to(meta)) for p in meta.rglob("*") if p.is_file())


@contextmanager
def _hub_errors(repo_id: str, revision: str | None, url: str, local_only: bool, cache: Path) -> Iterator[None]:
    """huggingface_hub's exceptions (multi-line, with URLs and advice) as one ModelFetchError line each."""
    import httpx2
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, HFValidationError, IncompleteSnapshotError,
                                        LocalEntryNotFoundError, OfflineModeIsEnabled, RepositoryNotFoundError,
                                        RevisionNotFoundError)

    where = f"{repo_id} from {url}"
    try:
        yield
    except HFValidationError as e:
        raise ModelSpecError(f"--model {repo_id}: not a valid Hub repo id ({_first_line(e)})") from None
    except GatedRepoError:
        raise ModelFetchError(f"--model {repo_id}: the repo is gated: accept its terms on the Hub, then set HF_TOKEN "
                              f"to a token of that account") from None
    except RepositoryNotFoundError:
        raise ModelFetchError(f"--model {repo_id}: no such model repo on {url} (a private one needs HF_TOKEN)") \
            from None
    except RevisionNotFoundError:
        raise ModelFetchError(f"--revision {revision}: {repo_id} has no such branch, tag or commit on {url}") \
            from None
    except IncompleteSnapshotError:
        raise ModelFetchError(f"cannot fetch {where}: the cached copy in {cache} is incomplete and the Hub cannot be "
                              f"reached{' (HF_HUB_OFFLINE is set)' if local_only else ''}; {LOCAL_HINT}") from None
    except (LocalEntryNotFoundError, OfflineModeIsEnabled, httpx2.TransportError) as e:
        why = "HF_HUB_OFFLINE is set" if local_only else f"the Hub cannot be reached ({_reason(e)})"
        raise ModelFetchError(f"cannot fetch {where}: {why} and it is not in the cache ({cache}); {LOCAL_HINT}") \
            from None
    except HfHubHTTPError as e:
        status = e.response.status_code if e.response is not None else "?"
        raise ModelFetchError(f"cannot fetch {where}: the Hub answered HTTP {status}; {LOCAL_HINT}") from None


def _reason(error: BaseException) -> str:
    """The innermost cause's first line: the connection error itself, not the wrappers' advice."""
    while error.__cause__ is not None:
        error = error.__cause__
    return _first_line(error) or type(error).__name__


def _first_line(error: BaseException) -> str:
    return next((line.strip() for line in str(error).splitlines() if line.strip()), "")
