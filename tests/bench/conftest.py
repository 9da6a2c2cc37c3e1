"""Bench scripts as modules (the real scheduler and worker of the end-to-end bench test are tests/conftest.py's)."""

import importlib.util
import sys
from pathlib import Path

import pytest

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
