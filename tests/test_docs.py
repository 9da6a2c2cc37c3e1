"""README.md and docs/ against the repository: every repository path they name in backticks exists, every
`pagedserve COMMAND --flag` they show is a flag of that command, every page mkdocs.yml's nav names exists (and every
page is in it), and the site builds with `mkdocs build --strict` (where mkdocs is installed: the `docs` extra)."""

from __future__ import annotations

import argparse
import functools
import importlib.util
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml

from pagedserve_cli.main import build_parser

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]
# The repository's top-level folders and files: a word starting with one of these names a repository path.
ROOTS = ("scheduler_svc/", "worker_svc/", "pagedserve_common/", "pagedserve_cli/", "protos/", "tests/", "bench/",
         "deploy/", "docker/", "cuda/", "examples/", "docs/", ".ci/")
TOP_FILES = ("compose.yaml", "compose.gpu.yaml", "compose.tls.yaml", "Dockerfile", "pyproject.toml", "mkdocs.yml",
             "README.md")
# Paths a run or the reader writes (bench's outputs, npm's packages, a kustomization the page has one write).
WRITTEN = ("bench/out/", "examples/node/node_modules", "deploy/kubernetes/overlays/my-clients/")
FENCE = re.compile(r"^```[^\n]*\n(.*?)^```[ \t]*$", re.M | re.S)
SPAN = re.compile(r"(?<!`)`([^`\n]+)`(?!`)")
FLAG = re.compile(r"(?<![\w-])--[a-z][a-z0-9-]*")


def rel(page: Path) -> str:
    return str(page.relative_to(ROOT))


def fenced(text: str) -> list[str]:
    return [m.group(1) for m in FENCE.finditer(text)]


def prose(text: str) -> str:
    """The text outside fenced blocks, less the code spans that are links to another site (another repository's
    path: [`docs/x`](https://...))."""
    return re.sub(r"\[`[^`\n]+`\]\([a-z]+://[^)]*\)", "", FENCE.sub("", text))


def code(text: str) -> list[str]:
    """What a reader would copy: the inline code spans outside fenced blocks, and the fenced blocks' lines (a
    `\\`-continued command joined into one)."""
    out = [m.group(1) for m in SPAN.finditer(prose(text))]
    for block in fenced(text):
        out += block.replace("\\\n", " ").splitlines()
    return out


def repository_paths(snippet: str) -> list[str]:
    """The words of `snippet` that name a repository path (`bench/x.py`, `tests/a/b.py::test`, `worker_svc/`)."""
    paths = []
    for word in re.split(r"[\s,;()\[\]'\"=]+", snippet):
        word = word.split("::")[0].rstrip(".:")
        if word.startswith("./"):
            word = word[2:]
        if not (word.startswith(ROOTS) or word in TOP_FILES) or word.startswith(WRITTEN):
            continue
        if re.search(r"[*<>{}|$]|\.\.\.|\bX\b|YYYY|TIMESTAMP", word):  # a pattern or a placeholder, not a path
            continue
        paths.append(word)
    return paths


def cited_paths() -> list[tuple[str, str]]:
    return sorted({(rel(page), path) for page in PAGES for snippet in code(page.read_text())
                   for path in repository_paths(snippet)})


def test_the_docs_name_repository_paths():
    """A guard for the parsing: the pages are read and name the paths they are known to."""
    paths = {path for _, path in cited_paths()}
    assert {"scheduler_svc/http/fields.py", "tests/http/test_fields.py", "bench/sched_scale.py"} <= paths


@pytest.mark.parametrize("page, path", cited_paths(), ids=[f"{p}:{q}" for p, q in cited_paths()])
def test_each_path_in_backticks_exists(page, path):
    assert (ROOT / path).exists(), f"{page} names `{path}`, which the repository does not have"


def test_readme_links_exist():
    """The README's relative links (into docs/, mostly): GitHub renders them, no site build checks them."""
    text = (ROOT / "README.md").read_text()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target) or target.startswith("#"):
            continue
        assert (ROOT / target.split("#")[0]).exists(), f"README.md links to {target}, which does not exist"


# -- commands -----------------------------------------------------------------------------------------------------
def subcommands() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def commands() -> list[tuple[str, str, str]]:
    """(page, subcommand, the command's text) of every `pagedserve SUBCOMMAND ...` the pages show."""
    known = subcommands()
    out = set()
    for page in PAGES:
        for snippet in code(page.read_text()):
            for m in re.finditer(r"(?:^|[\s(`'\"])pagedserve ([a-z][a-z-]*)\b([^#`]*)", snippet):
                if m.group(1) in known:
                    # NOTE: the command ends at a shell separator (`&&`, `;`, `|` unless inside `[...]`)
                    text = re.split(r"\s(?:&&|;|\|\|)\s", m.group(2))[0]
                    out.add((rel(page), m.group(1), text.strip()))
    return sorted(out)


def flags_of(command: str) -> set[str]:
    parser = subcommands()[command]
    found = {s for a in parser._actions for s in a.option_strings}
    for action in parser._actions:  # `pagedserve model pull`: a subcommand's subcommands
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                found |= {s for a in child._actions for s in a.option_strings}
    return found


def test_the_docs_show_commands():
    shown = {c for _, c, _ in commands()}
    assert {"up", "generate", "bench", "kv-map", "scheduler", "worker"} <= shown, shown


@pytest.mark.parametrize("page, command, text", commands(), ids=[f"{p}:{c}:{t[:40]}" for p, c, t in commands()])
def test_each_flag_a_command_shows_exists(page, command, text):
    missing = sorted(set(FLAG.findall(text)) - flags_of(command))
    assert not missing, f"{page} shows `pagedserve {command} {text}`: `pagedserve {command}` has no {missing}"


# -- routes and RPCs ----------------------------------------------------------------------------------------------
ROUTE = re.compile(r"^((?:GET|POST|PUT|PATCH|DELETE)(?:\|(?:GET|POST|PUT|PATCH|DELETE))*) (/[^\s?#]*)$")
URL = re.compile(r"https?://127\.0\.0\.1:8000(/[A-Za-z0-9_/{}.-]*)")  # the default HTTP address (`up`'s)
RPC = re.compile(r"\b((?:pagedserve|grpc\.health)\.v1\.[A-Za-z]+)/([A-Za-z]+)\b")


@functools.cache
def served_routes() -> dict[str, set[str]]:
    """The HTTP app's routes: {path with `{name}` parameters: methods}. NOTE: built over a mock front end: only the
    route table is read, no request is made."""
    from unittest.mock import MagicMock

    from scheduler_svc.http.app import create_app

    routes: dict[str, set[str]] = {}
    for route in create_app(MagicMock()).routes:
        routes.setdefault(re.sub(r"\{(\w+)(:\w+)?\}", "{}", route.path), set()).update(route.methods)
    return routes


def routes_shown() -> list[tuple[str, str, str]]:
    """(page, method, path) of every `METHOD /path` code span and every URL on the default HTTP address the pages
    show (a URL's method: GET, or POST where the snippet sends a body)."""
    out = set()
    for page in PAGES:
        text = page.read_text()
        for span in (m.group(1) for m in SPAN.finditer(prose(text))):
            if m := ROUTE.match(span.strip()):
                out |= {(rel(page), method, m.group(2)) for method in m.group(1).split("|")}
        for snippet in code(text):
            for m in URL.finditer(snippet):
                if m.group(1).rstrip("/") == "/v1":  # a client's base URL, not a route
                    continue
                method = "POST" if re.search(r"\s(-d|--data\S*|--json)\s", snippet) else "GET"
                out.add((rel(page), method, m.group(1)))
    return sorted(out)


def test_the_docs_show_routes():
    shown = {path for _, _, path in routes_shown()}
    assert {"/v1/chat/completions", "/v1/completions", "/health", "/v1/models"} <= shown, shown


@pytest.mark.parametrize("page, method, path", routes_shown(), ids=[f"{p}:{m} {r}" for p, m, r in routes_shown()])
def test_each_route_the_docs_show_is_served(page, method, path):
    routes = served_routes()
    key = re.sub(r"\{[^}]*\}", "{}", path)
    assert method in routes.get(key, set()), f"{page} shows `{method} {path}`, which the HTTP API does not serve " \
                                              f"(it serves {sorted(routes)})"


def rpcs_shown() -> list[tuple[str, str, str]]:
    return sorted({(rel(page), m.group(1), m.group(2)) for page in PAGES for m in RPC.finditer(page.read_text())})


@pytest.mark.parametrize("page, service, method", rpcs_shown(), ids=[f"{p}:{s}/{m}" for p, s, m in rpcs_shown()])
def test_each_rpc_the_docs_show_exists(page, service, method):
    from grpc_health.v1 import health_pb2

    from pagedserve.v1 import generate_pb2, worker_pb2

    services = {s.full_name: s for module in (generate_pb2, worker_pb2, health_pb2)
                for s in module.DESCRIPTOR.services_by_name.values()}
    assert service in services, f"{page} shows {service}/{method}; there is no service {service}"
    methods = services[service].methods_by_name
    assert method in methods, f"{page} shows {service}/{method}; {service} has {sorted(methods)}"


# -- generated pages ----------------------------------------------------------------------------------------------
def test_the_generated_references_are_current():
    """docs/cli-reference.md and docs/grpc-reference.md are what docs/generate.py makes of the parser and the protos
    now: a flag, help text or proto comment changed without regenerating them fails here."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PAGEDSERVE_")}
    r = subprocess.run([sys.executable, str(DOCS / "generate.py"), "--check"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr


def test_the_cli_reference_has_every_command_and_flag():
    text = (DOCS / "cli-reference.md").read_text()
    for name, parser in subcommands().items():
        assert f"## `pagedserve {name}`" in text, name
        shown = [a for a in parser._actions if a.help != argparse.SUPPRESS]  # as --help: hidden flags stay hidden
        for flag in {s for a in shown for s in a.option_strings if s.startswith("--") and s != "--help"}:
            assert f"`{flag}" in text, (name, flag)


# -- the site -----------------------------------------------------------------------------------------------------
class _Loader(yaml.SafeLoader):
    """mkdocs.yml's `!!python/...` tags (the slugify function) read as None: only the nav matters here."""


_Loader.add_multi_constructor("tag:yaml.org,2002:python/", lambda loader, suffix, node: None)


def nav_pages(nav) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [p for item in nav for p in nav_pages(item)]
    if isinstance(nav, dict):
        return [p for value in nav.values() for p in nav_pages(value)]
    return []


def test_the_nav_names_every_page_and_only_pages_that_exist():
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=_Loader)
    assert config["strict"] is True and config["docs_dir"] == "docs"
    named = nav_pages(config["nav"])
    missing = [p for p in named if not (DOCS / p).is_file()]
    assert not missing, f"mkdocs.yml's nav names pages docs/ does not have: {missing}"
    left_out = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    left_out = [p for p in left_out if p not in named]
    assert not left_out, f"docs/ pages mkdocs.yml's nav does not name: {left_out}"


def test_the_dev_extra_installs_the_docs_extra():
    """CI installs `.[dev]` (the README's install line): with the `docs` extra's pins in it, the strict build below
    runs there instead of skipping."""
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    assert extras["docs"] and set(extras["docs"]) <= set(extras["dev"]), (extras["docs"], extras["dev"])


def test_the_site_builds_strictly(tmp_path):
    if importlib.util.find_spec("mkdocs") is None or importlib.util.find_spec("material") is None:
        pytest.skip("mkdocs and mkdocs-material are not installed (pip install -e '.[docs]' or '.[dev]')")
    out = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})  # NOTE: Material's notice on stderr
    assert out.returncode == 0, out.stderr[-4000:]
    assert (tmp_path / "site" / "index.html").is_file()
