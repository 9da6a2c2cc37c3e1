"""Packaging and layering: every package is installed, the scheduler stays free of torch and cupy, and the tests
mirror the packages without importing one another."""

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_python_package_is_listed_in_pyproject():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = cfg["package-dir"]
    found = set()
    for top in ("scheduler_svc", "worker_svc", "pagedserve_cli", "pagedserve_common"):
        found |= {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / top).rglob("__init__.py")}
    for name, where in dirs.items():
        found |= {".".join((name, *p.parent.relative_to(ROOT / where).parts))
                  for p in (ROOT / where).rglob("__init__.py")}
    assert found == set(cfg["packages"])


def test_every_kernel_source_ships_as_package_data():
    # The CPU kernel library is compiled at first use from these files (the units and the headers they include): an
    # install without one cannot build it. A package's patterns are globs below its folder, as setuptools reads them.
    from worker_svc.cpu_build import sources

    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    assert any(path.suffix == ".h" for path in sources())
    for path in sources():
        folder = next(p for p in path.parents if (p / "__init__.py").is_file())
        package = ".".join(folder.relative_to(ROOT).parts)
        assert any(path in set(folder.glob(pattern)) for pattern in data.get(package, ())), path


def test_kv_manager_imports_neither_torch_nor_grpc():
    code = ("import sys, scheduler_svc.kv.manager, scheduler_svc.kv.capacity; "
            "print(sorted(m for m in ('torch', 'cupy', 'grpc', 'numpy') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"


def test_the_scheduler_service_never_imports_torch_or_cupy():
    code = ("import sys, scheduler_svc.server, scheduler_svc.engine, pagedserve_cli.main; "
            "print(sorted(m for m in ('torch', 'cupy', 'transformers', 'worker_svc') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"


def _imported_top_levels(package: str) -> dict[str, set[str]]:
    """Every module of `package` -> the top-level packages it imports (at any depth, lazily or not)."""
    import ast

    out = {}
    for path in (ROOT / package).rglob("*.py"):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        out[str(path.relative_to(ROOT))] = names
    return out


def test_the_services_never_import_each_other_only_the_shared_module():
    """What both services need lives in pagedserve_common; neither service imports the other, in any module."""
    for package, other in (("worker_svc", "scheduler_svc"), ("scheduler_svc", "worker_svc")):
        offenders = sorted(m for m, names in _imported_top_levels(package).items() if other in names)
        assert offenders == [], f"{package} imports {other} in {offenders}"
    for module, names in _imported_top_levels("pagedserve_common").items():
        assert not names & {"scheduler_svc", "worker_svc", "torch", "grpc"}, module
    # And the shared module really is shared: both services use it.
    for package in ("worker_svc", "scheduler_svc"):
        assert any("pagedserve_common" in n for n in _imported_top_levels(package).values()), package


PACKAGES = ("scheduler_svc", "worker_svc", "pagedserve_common", "pagedserve_cli")


def _module_graph() -> dict[str, set[str]]:
    """Every module of PACKAGES -> the modules of PACKAGES it imports, at any depth (lazily, under TYPE_CHECKING
    or not): `from a.b import c` counts as importing a.b.c when that is a module, else a.b."""
    import ast

    modules = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in modules else node.module
                           for a in node.names]
            else:
                continue
            edges |= {t for t in targets if t in modules and t != name}
        graph[name] = edges
    return graph


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One import circle (its modules in order, the first repeated at the end), or None."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            if nxt not in state and (cycle := visit(nxt)) is not None:
                return cycle
        path.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)) is not None:
            return cycle
    return None


def test_no_module_imports_itself_through_others():
    """No import circle among the project's modules: each one can be read, and imported, after what it uses."""
    graph = _module_graph()
    assert "scheduler_svc.engine" in graph and "scheduler_svc.fleet" in graph["scheduler_svc.engine"]
    assert _find_cycle(graph) is None, " -> ".join(_find_cycle(graph))


def test_the_circle_finder_finds_a_circle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None


def test_protobuf_stays_at_the_edges():
    """Only the codecs and the gRPC servers and clients touch generated messages: the engine, the scheduler core,
    the front end, the HTTP app and the worker's runner work on the shared dataclasses."""
    edges = {"pagedserve_common.wire", "scheduler_svc.server", "scheduler_svc.ports", "worker_svc.client"}
    for package in ("scheduler_svc", "worker_svc", "pagedserve_common"):
        for module, names in _imported_modules(package).items():
            if module in edges or module.startswith("scheduler_svc.grpc."):
                continue
            assert not {n for n in names if n.startswith(("pagedserve.v1", "google.protobuf"))}, module
    assert any(n.startswith("pagedserve.v1") for n in _imported_modules("pagedserve_common")["pagedserve_common.wire"])


def _imported_modules(package: str) -> dict[str, set[str]]:
    """Every module of `package` (dotted) -> the full names of the modules it imports, at any depth."""
    import ast

    out = {}
    for path in (ROOT / package).rglob("*.py"):
        parts = path.relative_to(ROOT).with_suffix("").parts
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names.add(node.module)
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = names
    return out


# NOTE: the repository-wide checks stay at tests/: this file (every package, the layering, the tests' own layout),
# test_protos.py (protos/ against its generated stubs), test_docs.py (README.md, docs/ and mkdocs.yml against the
# repository and the CLI) and test_docs_runnable.py (their runnable blocks against a real server). Every other test
# sits in the folder of what it tests.
ROOT_TESTS = {"test_packaging.py", "test_protos.py", "test_docs.py", "test_docs_runnable.py"}


def _names_imported(source: str, module: str) -> set[str]:
    """The full names that the code of `module` (dotted) imports: `from a.b import c` gives a.b and a.b.c, and a
    relative import is read from `module`'s package."""
    import ast

    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            base = module.split(".")[:-node.level] if node.level else []
            base = ".".join([*base, *([node.module] if node.module else [])])
            names |= {base} | {f"{base}.{a.name}" for a in node.names}
    return names


def _test_layout_offences(module: str, names: set[str]) -> set[str]:
    """What `module` (dotted, under tests) imports that a test folder must not: a test module or a conftest (their
    helpers belong in tests/support; a conftest holds fixtures and hooks, which pytest finds by name), or bench/
    outside tests/bench (which tests the benchmarks)."""
    bad = {n for n in names if n.startswith("tests.")
           and any(p.startswith("test_") or p == "conftest" for p in n.split(".")[1:])}
    bad |= {n for n in names if n == "conftest" or n.startswith("conftest.")}
    if not module.startswith("tests.bench."):
        bad |= {n for n in names if n == "bench" or n.startswith("bench.")}
    return bad


def test_no_test_module_imports_another_or_the_benchmarks():
    offences = {}
    for path in sorted((ROOT / "tests").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if bad := _test_layout_offences(module, _names_imported(path.read_text(), module)):
            offences[module] = sorted(bad)
    assert offences == {}


def test_the_layout_check_finds_a_test_module_imported():
    code = ("from tests.scheduler.test_scheduler import FakeWorker\nfrom . import test_wire\n"
            "import tests.service.test_storms\nfrom bench.load import LocalServer\nfrom tests.support import worker\n"
            "from tests.structured.conftest import VOCAB\nfrom .conftest import EOS\n")
    names = _names_imported(code, "tests.common.test_x")
    assert _test_layout_offences("tests.common.test_x", names) == {
        "tests.scheduler.test_scheduler", "tests.scheduler.test_scheduler.FakeWorker", "tests.common.test_wire",
        "tests.service.test_storms", "bench.load", "bench.load.LocalServer", "tests.structured.conftest",
        "tests.structured.conftest.VOCAB", "tests.common.conftest", "tests.common.conftest.EOS"}
    assert _test_layout_offences("tests.bench.test_x", _names_imported("import bench.load", "tests.bench.test_x")) == set()


def test_the_benchmarks_import_nothing_from_the_tests():
    """bench/ runs from a clone without the test suite's helpers: what a benchmark shares with the tests (the tiny
    served model, the in-process driver, the JSON schemas) lives in pagedserve_cli/bench."""
    offences = {}
    for path in sorted((ROOT / "bench").rglob("*.py")):
        module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
        if bad := {n for n in _names_imported(path.read_text(), module) if n == "tests" or n.startswith("tests.")}:
            offences[module] = sorted(bad)
    assert offences == {}


def test_the_benchmarks_name_no_path_outside_the_repository():
    """A clone has bench/ and bench/peers (the peers' set-up, pinned), not the team's notes beside the repository
    (../shared) or one machine's folders (/work): every benchmark runs from the project's own files."""
    files = [p for p in sorted((ROOT / "bench").rglob("*"))
             if p.is_file() and not {"out", "__pycache__"} & set(p.relative_to(ROOT).parts)]
    offences = [f"{path.relative_to(ROOT)}:{n}: {line.strip()}" for path in files
                for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1)
                if "shared/" in line or "/work/" in line]
    assert offences == []


def test_tests_sit_beside_what_they_test_not_at_the_root():
    assert {p.name for p in (ROOT / "tests").glob("test_*.py")} == ROOT_TESTS
