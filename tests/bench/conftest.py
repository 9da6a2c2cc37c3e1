"""The real scheduler+worker fixtures of tests/service, reused by the end-to-end bench test; bench scripts as modules."""

import importlib.util
import sys
from pathlib import Path

import pytest

from tests.service.conftest import service, tiny_served_model  # noqa: F401  (pytest finds fixtures by name)


BENCH = Path(__file__).resolve().parents[2] / "bench"


@pytest.fixture(scope="module")
def bench_script(request):
    """bench/{the test module's BENCH_SCRIPT}.py as a module: bench/ is scripts, not a package, so the file itself
    is loaded (and unloaded after the module's tests)."""
    name = request.module.BENCH_SCRIPT
    spec = importlib.util.spec_from_file_location(f"bench_{name}", BENCH / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is created
    spec.loader.exec_module(mod)
    yield mod
    sys.modules.pop(spec.name, None)
