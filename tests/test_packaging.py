"""Packaging and layering: every package is installed, and the scheduler stays free of torch and cupy."""

import subprocess
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_every_python_package_is_listed_in_pyproject():
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    dirs = cfg["package-dir"]
    found = set()
    for top in ("scheduler_svc", "worker_svc", "pagedserve_cli"):
        found |= {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / top).rglob("__init__.py")}
    for name, where in dirs.items():
        found |= {".".join((name, *p.parent.relative_to(ROOT / where).parts))
                  for p in (ROOT / where).rglob("__init__.py")}
    assert found == set(cfg["packages"])


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
