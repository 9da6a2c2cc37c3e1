"""Who reaches which port of which pod, in every overlay as `kubectl kustomize` renders it: the union of every
NetworkPolicy selecting a pod (tests/deploy/network_policy.py), evaluated for sample sources. The scheduler's client
API (gRPC 50051) and HTTP API (8000) admit no other namespace: by default the pods of its own namespace labelled
`pagedserve-client: "true"` (and the workers on 50051, which their readiness probe asks); under the gateway overlay
only the Gateway's pods reach 8000. The worker port admits only the workers (of the same cell), metrics only the
`monitoring` namespace (and the endpoint picker under the gateway overlay). An overlay narrows by patching the base's
policy: policies add up, so one added beside it could only admit more."""

from __future__ import annotations

import os
import re
import shutil
from pathlib import Path

import pytest
import yaml

from tests.deploy.network_policy import (APP_NAMESPACE, OTHER_PORT, Source, admitted, ingress_peers,
                                         policies_selecting, reachability, selector_matches, targets)
from tests.deploy.rendered import GATEWAY_OVERLAY, KUBERNETES, ROOT, of_kind, render

NAME, CELL = "app.kubernetes.io/name", "app.kubernetes.io/instance"
SCHEDULER, WORKER, EPP = "pagedserve-scheduler", "pagedserve-worker", "pagedserve-epp"
CLIENT_LABEL = {"pagedserve-client": "true"}  # the base's default clients (docs/deployment.md)
GATEWAY_NAME = "gateway.networking.k8s.io/gateway-name"  # on a Gateway's in-cluster pods (GEP-1762)
CLIENT_PORTS = ("grpc", "http")
COMPONENTS = ("gpu", "tls", "autoscale")
OVERLAYS = ("base", "cpu", "gpu", "tls", "autoscale", "all", "gateway-inference-extension", "cells/a", "cells/b")


@pytest.fixture(scope="module")
def renders(tmp_path_factory) -> dict[str, list[dict]]:
    """Every overlay rendered once; "all" is every component in one kustomization (as test_kubernetes.py does)."""
    combined = tmp_path_factory.mktemp("all")

    def rel(path: Path) -> str:  # NOTE: kustomize takes no absolute path
        return os.path.relpath(path, combined)
    (combined / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": APP_NAMESPACE,
        "resources": [rel(KUBERNETES / "base")],
        "components": [rel(KUBERNETES / "components" / c) for c in COMPONENTS]}))
    paths = {"base": KUBERNETES / "base", "all": combined, "gateway-inference-extension": GATEWAY_OVERLAY,
             "cells/a": GATEWAY_OVERLAY / "cells" / "a", "cells/b": GATEWAY_OVERLAY / "cells" / "b"}
    paths |= {o: KUBERNETES / "overlays" / o for o in ("cpu", "gpu", "tls", "autoscale")}
    return {o: render(paths[o]) for o in OVERLAYS}


def gateway_name(docs: list[dict]) -> str:
    gateways = of_kind(docs, "Gateway")
    return gateways[0]["metadata"]["name"] if gateways else "pagedserve"


def sources(docs: list[dict]) -> list[Source]:
    """Sample sources: pods of this namespace, of another and of `monitoring`, one outside the cluster, the Gateway's
    pods, and every rendered workload's pods (by their names)."""
    gateway = {GATEWAY_NAME: gateway_name(docs)}
    return [Source("outside the cluster", None),
            Source("elsewhere", "elsewhere"),
            Source("elsewhere, labelled a client", "elsewhere", CLIENT_LABEL),
            Source("elsewhere, labelled a worker", "elsewhere", {NAME: WORKER}),
            Source("elsewhere, labelled the gateway", "elsewhere", gateway),
            Source("neighbour", APP_NAMESPACE),
            Source("client", APP_NAMESPACE, CLIENT_LABEL),
            Source("monitoring", "monitoring"),
            Source("gateway", APP_NAMESPACE, gateway)] + [t.source for t in targets(docs)] + \
        [Source(f"client of {cell}", APP_NAMESPACE, CLIENT_LABEL | {CELL: cell}) for cell in cells(docs)]


def cells(docs: list[dict]) -> list[str]:
    """The cells' instance labels (none outside the gateway overlay)."""
    return sorted({t.labels[CELL] for t in targets(docs) if CELL in t.labels})


def behind_gateway(docs: list[dict]) -> bool:
    return bool(of_kind(docs, "InferencePool"))


def expected(docs: list[dict]) -> dict[str, list[str]]:
    """What each port of each pod should admit (the table reachability() computes)."""
    workloads = targets(docs)
    gateway = behind_gateway(docs)
    table = {}
    for t in workloads:
        role = t.labels[NAME]
        workers = [w.name for w in workloads if w.labels[NAME] == WORKER and w.labels.get(CELL) == t.labels.get(CELL)]
        want = {"other": []}
        if role == SCHEDULER and gateway:
            want |= {"grpc": workers, "http": ["gateway"], "worker": workers, "metrics": [EPP, "monitoring"]}
        elif role == SCHEDULER:
            # NOTE: a cell on its own (kustomize's `labels` with includeSelectors) selects only its own clients;
            # only the gateway overlay deploys cells, and it replaces that rule
            clients = [f"client of {t.labels[CELL]}"] if CELL in t.labels else ["client"]
            want |= {"grpc": clients + workers, "http": clients, "worker": workers, "metrics": ["monitoring"]}
        elif role == EPP:
            want |= {"grpc-ext-proc": ["gateway"], "grpc-health": [], "metrics": ["monitoring"]}
        else:
            assert role == WORKER and t.ports == {}, t  # a worker listens on nothing
        table |= {f"{t.name}:{port}": sorted(names) for port, names in want.items()}
    return table


def schedulers(docs: list[dict]):
    return [t for t in targets(docs) if t.labels[NAME] == SCHEDULER]


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_who_reaches_each_port_of_each_pod(renders, overlay):
    docs = renders[overlay]
    assert schedulers(docs), "no scheduler rendered"
    assert reachability(docs, sources(docs)) == expected(docs)


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_client_ports_admit_no_other_namespace(renders, overlay):
    docs = renders[overlay]
    for t in schedulers(docs):
        for port in CLIENT_PORTS:
            peers = ingress_peers(docs, t, t.ports[port])
            assert peers is not None, f"{t.name}: selected by no NetworkPolicy"
            # every peer: pods of the policy's own namespace, picked by a pod selector
            assert [p for p in peers if not p.same_namespace_pods] == [], f"{t.name}:{port}"
            assert all(p.pod_selector not in ({}, {"matchLabels": {}}) for p in peers), f"{t.name}:{port}: every pod"
            outsiders = [s.name for s in sources(docs)
                         if s.namespace != t.namespace and admitted(docs, t, t.ports[port], s)]
            assert outsiders == [], f"{t.name}:{port}"


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_the_worker_port_admits_only_the_workers_of_its_cell(renders, overlay):
    docs = renders[overlay]
    for t in schedulers(docs):
        peers = ingress_peers(docs, t, t.ports["worker"])
        assert peers and all(p.same_namespace_pods for p in peers), t.name
        cell = {k: v for k, v in t.labels.items() if k == CELL}
        for p in peers:
            picked = {k: v for k, v in p.pod_selector["matchLabels"].items() if k in (NAME, CELL)}
            assert picked == {NAME: WORKER} | cell, (t.name, p)
        admitted_workloads = {w.name for w in targets(docs) if admitted(docs, t, t.ports["worker"], w.source)}
        assert admitted_workloads == {w.name for w in targets(docs)
                                      if w.labels[NAME] == WORKER and w.labels.get(CELL) == t.labels.get(CELL)}


def test_behind_the_gateway_only_the_gateway_reaches_the_http_api_and_the_picker_the_metrics(renders):
    docs = renders["gateway-inference-extension"]
    gateway = {GATEWAY_NAME: gateway_name(docs)}
    [epp] = [t for t in targets(docs) if t.labels[NAME] == EPP]
    assert len(schedulers(docs)) == 2
    for t in schedulers(docs):
        [peer] = ingress_peers(docs, t, t.ports["http"])
        assert peer.same_namespace_pods and peer.pod_selector == {"matchLabels": gateway}
        # the gRPC client API: no client behind the gateway, only the cell's workers (their readiness probe)
        assert all(selector_matches(p.pod_selector, {NAME: WORKER, CELL: t.labels[CELL]})
                   for p in ingress_peers(docs, t, t.ports["grpc"]))
        assert admitted(docs, t, t.ports["metrics"], epp.source)
        assert not admitted(docs, t, t.ports["http"], epp.source)
        assert not admitted(docs, t, t.ports["metrics"], Source("gateway", APP_NAMESPACE, gateway))


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_each_pod_is_selected_by_exactly_one_policy(renders, overlay):
    # NOTE: policies add up: a second one selecting a pod could only admit more, so an overlay that narrows what
    # the base admits patches the base's policy instead of adding one beside it
    docs = renders[overlay]
    for t in targets(docs):
        assert len(names := [p["metadata"]["name"] for p in policies_selecting(docs, t)]) == 1, (t.name, names)


def dialled(docs: list[dict], spec: dict) -> list[tuple[str, int]]:
    """HOST:PORT addresses a container dials that name a rendered Service: its env values and its probes' commands
    (PAGEDSERVE_SCHEDULER, `pagedserve health --server ...`)."""
    texts = [e["value"] for e in spec.get("env", []) if "value" in e]
    texts += [" ".join(probe["exec"]["command"]) for kind in ("startupProbe", "readinessProbe", "livenessProbe")
              if "exec" in (probe := spec.get(kind) or {})]
    services = {s["metadata"]["name"] for s in of_kind(docs, "Service")}
    found = [(host, int(port)) for text in texts for host, port in re.findall(r"([A-Za-z0-9.-]+):(\d+)", text)]
    return [(host, port) for host, port in found if host.split(".")[0] in services]


def service_target(docs: list[dict], host: str, port: int) -> tuple[list, int]:
    """The workloads a Service address leads to, and the container port number it forwards to."""
    [service] = [s for s in of_kind(docs, "Service") if s["metadata"]["name"] == host.split(".")[0]]
    [service_port] = [p for p in service["spec"]["ports"] if p["port"] == port]
    pods = [t for t in targets(docs) if selector_matches({"matchLabels": service["spec"]["selector"]}, t.labels)]
    assert pods, f"{host}:{port}: selects no pod"
    target_port = service_port.get("targetPort", port)
    numbers = {t.ports[target_port] if isinstance(target_port, str) else target_port for t in pods}
    [number] = numbers
    return pods, number


@pytest.mark.parametrize("overlay", OVERLAYS)
def test_every_service_address_a_pod_dials_admits_it(renders, overlay):
    # NOTE: a worker dials the worker Service, and its readiness probe asks the client API (GetModelInfo): a policy
    # that shut it out of 50051 would keep every worker unready
    docs = renders[overlay]
    dials = 0
    for d in of_kind(docs, "Deployment"):
        [source] = [t for t in targets(docs) if t.name == d["metadata"]["name"]]
        for spec in d["spec"]["template"]["spec"]["containers"]:
            for host, port in dialled(docs, spec):
                pods, number = service_target(docs, host, port)
                for pod in pods:
                    assert admitted(docs, pod, number, source.source), f"{source.name} -> {host}:{port} ({pod.name})"
                dials += 1
    assert dials >= 2 * len([t for t in targets(docs) if t.labels[NAME] == WORKER])  # the worker port and the probe


def docs_client_patch() -> str:
    """docs/deployment.md's kustomization that names the clients' namespace (Run on Kubernetes), as written there."""
    page = (ROOT / "docs" / "deployment.md").read_text()
    section = page.split("## Run on Kubernetes", 1)[1].split("\n## ", 1)[0]
    [block] = [b for b in re.findall(r"```yaml\n(.*?)```", section, re.S) if "kind: NetworkPolicy" in b]
    return block


def test_the_docs_patch_admits_the_clients_namespace_it_names_and_no_other(tmp_path):
    shutil.copytree(KUBERNETES, tmp_path / "deploy" / "kubernetes")
    text = docs_client_patch()
    [path] = re.findall(r"^# (deploy/kubernetes/\S+/kustomization\.yaml)", text, re.M)
    (tmp_path / path).parent.mkdir(parents=True)
    (tmp_path / path).write_text(text)
    [namespace] = re.findall(r"kubernetes\.io/metadata\.name: (\S+)", text)
    docs = render((tmp_path / path).parent)
    [scheduler] = schedulers(docs)
    [worker] = [t for t in targets(docs) if t.labels[NAME] == WORKER]
    for port in CLIENT_PORTS:
        number = scheduler.ports[port]
        assert admitted(docs, scheduler, number, Source("app", namespace))
        assert not admitted(docs, scheduler, number, Source("elsewhere", "elsewhere", CLIENT_LABEL))
    assert admitted(docs, scheduler, scheduler.ports["grpc"], worker.source)
    assert admitted(docs, scheduler, scheduler.ports["worker"], worker.source)
    assert not admitted(docs, scheduler, scheduler.ports["worker"], Source("app", namespace, {NAME: WORKER}))
    assert not admitted(docs, scheduler, OTHER_PORT, Source("app", namespace))
