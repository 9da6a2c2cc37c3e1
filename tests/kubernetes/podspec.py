"""A rendered pod spec as the kubelet reads it: the objects, the pod, its containers' environment and command line
($(VAR) expansion), the Services that select it, its probes."""

from __future__ import annotations

import hashlib
import json
import math
import re
import subprocess
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Callable

import yaml

# NOTE: the `kubernetes` Service of the default namespace, which the kubelet puts into every container's environment
# (enableServiceLinks: false drops only the namespace's own Services); its ClusterIP is the conventional first one.
KUBERNETES_SERVICE_IP = "10.96.0.1"
KUBERNETES_SERVICE_ENV = {
    "KUBERNETES_SERVICE_HOST": KUBERNETES_SERVICE_IP,
    "KUBERNETES_SERVICE_PORT": "443",
    "KUBERNETES_SERVICE_PORT_HTTPS": "443",
    "KUBERNETES_PORT": f"tcp://{KUBERNETES_SERVICE_IP}:443",
    "KUBERNETES_PORT_443_TCP": f"tcp://{KUBERNETES_SERVICE_IP}:443",
    "KUBERNETES_PORT_443_TCP_PROTO": "tcp",
    "KUBERNETES_PORT_443_TCP_PORT": "443",
    "KUBERNETES_PORT_443_TCP_ADDR": KUBERNETES_SERVICE_IP,
}
CLUSTER_DOMAIN = "cluster.local"


class Unsupported(ValueError):
    """A field of the pod spec that this emulation cannot carry out on Docker (never silently dropped)."""


def render(kustomization: str) -> list[dict]:
    """`kubectl kustomize DIR`, parsed: every object of the overlay."""
    out = subprocess.run(["kubectl", "kustomize", kustomization], capture_output=True, text=True, check=True)
    return parse(out.stdout)


def parse(text: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all(text) if doc]


@dataclass(slots=True)
class Cluster:
    """The objects of one rendered overlay (one namespace), and the Secrets made out of band (name -> key -> bytes)."""

    docs: list[dict]
    secrets: dict[str, dict[str, bytes]] = field(default_factory=dict)

    @property
    def namespace(self) -> str:
        names = {d["metadata"].get("namespace", "default") for d in self.docs}
        if len(names) != 1:
            raise Unsupported(f"objects in more than one namespace: {sorted(names)}")
        return names.pop()

    def of_kind(self, kind: str) -> list[dict]:
        return [d for d in self.docs if d["kind"] == kind]

    def get(self, kind: str, name: str) -> dict:
        for d in self.of_kind(kind):
            if d["metadata"]["name"] == name:
                return d
        raise KeyError(f"no {kind} {name!r} in the rendered manifests")

    def config_map(self, name: str) -> dict[str, str]:
        return dict(self.get("ConfigMap", name).get("data") or {})

    def secret(self, name: str) -> dict[str, bytes]:
        if name not in self.secrets:
            raise KeyError(f"Secret {name!r} is not given (a pod that mounts it would wait in ContainerCreating)")
        return self.secrets[name]


# ---- $(VAR) references: Kubernetes' expansion rules ----------------------------------------------------------------

def expand(text: str, lookup: Callable[[str], str | None]) -> str:
    """`text` with each $(NAME) replaced by lookup(NAME) as the kubelet does it: $$ is a literal $ (so $$(NAME) stays
    $(NAME)), an unknown NAME and an unclosed $( stay as written, a $ before anything else is kept."""
    out, i = [], 0
    while i < len(text):
        c = text[i]
        if c != "$" or i + 1 == len(text):
            out.append(c)
            i += 1
            continue
        nxt = text[i + 1]
        if nxt == "$":
            out.append("$")
            i += 2
        elif nxt == "(":
            close = text.find(")", i + 2)
            if close < 0:
                out.append("$(")
                i += 2
            else:
                name = text[i + 2:close]
                value = lookup(name)
                out.append(f"$({name})" if value is None else value)
                i = close + 1
        else:
            out.append("$" + nxt)
            i += 2
    return "".join(out)


# ---- the pod and its containers' environment -------------------------------------------------------------------------

@dataclass(slots=True)
class Pod:
    """One pod of a Deployment: its name (the hostname), metadata and spec, and its IP once its sandbox runs."""

    name: str
    namespace: str
    deployment: str
    labels: dict[str, str]
    annotations: dict[str, str]
    spec: dict
    uid: str = ""
    ip: str = ""
    node_name: str = "k8srun"

    @classmethod
    def of(cls, deployment: dict, suffix: str) -> Pod:
        """A pod of `deployment` named as a ReplicaSet names it: DEPLOYMENT-TEMPLATEHASH-SUFFIX."""
        template = deployment["spec"]["template"]
        name = f"{deployment['metadata']['name']}-{template_hash(template)}-{suffix}"
        meta = template.get("metadata") or {}
        return cls(name=name, namespace=deployment["metadata"].get("namespace", "default"),
                   deployment=deployment["metadata"]["name"], labels=dict(meta.get("labels") or {}),
                   annotations=dict(meta.get("annotations") or {}), spec=template["spec"],
                   uid=hashlib.sha256(name.encode()).hexdigest()[:32])

    @property
    def grace_seconds(self) -> int:
        return int(self.spec.get("terminationGracePeriodSeconds", 30))

    def container_ports(self) -> dict[str, int]:
        """{port name: containerPort} over the pod's containers."""
        return {p["name"]: int(p["containerPort"]) for c in self.spec.get("containers", [])
                for p in c.get("ports", []) if "name" in p}


def template_hash(template: dict) -> str:
    """A stable short hash of a pod template (the ReplicaSet part of a pod's name)."""
    return hashlib.sha256(json.dumps(template, sort_keys=True).encode()).hexdigest()[:10]


def service_env(pod: Pod) -> dict[str, str]:
    if pod.spec.get("enableServiceLinks", True) is not False:
        raise Unsupported(f"{pod.deployment}: enableServiceLinks is not false: the kubelet would add every Service's "
                          f"*_SERVICE_HOST/*_PORT variables, which need ClusterIPs this emulation does not have")
    return dict(KUBERNETES_SERVICE_ENV)


def container_env(pod: Pod, container: dict, cluster: Cluster) -> dict[str, str]:
    """The container's environment as the kubelet computes it: envFrom in order, then env in order (later wins),
    each env value's $(VAR) expanded over what is defined before it and the service variables."""
    services = service_env(pod)
    env: dict[str, str] = {}

    def lookup(name: str) -> str | None:
        return env.get(name, services.get(name))

    for source in container.get("envFrom", []):
        prefix = source.get("prefix", "")
        if "configMapRef" in source:
            ref = source["configMapRef"]
            data = optional(ref, lambda: cluster.config_map(ref["name"]), {})
        elif "secretRef" in source:
            ref = source["secretRef"]
            data = {k: v.decode() for k, v in optional(ref, lambda: cluster.secret(ref["name"]), {}).items()}
        else:
            raise Unsupported(f"envFrom {source}")
        for key, value in data.items():
            env[prefix + key] = value
    for var in container.get("env", []):
        if "valueFrom" in var:
            value = value_from(var["valueFrom"], pod, container, cluster)
            if value is None:
                continue  # an optional reference that is missing: the variable is not set
        else:
            value = expand(var.get("value", ""), lookup)
        env[var["name"]] = value
    return {**{k: v for k, v in services.items() if k not in env}, **env}


def optional(ref: dict, get: Callable, missing):
    try:
        return get()
    except KeyError:
        if ref.get("optional"):
            return missing
        raise


def value_from(source: dict, pod: Pod, container: dict, cluster: Cluster) -> str | None:
    if "configMapKeyRef" in source:
        ref = source["configMapKeyRef"]
        return optional(ref, lambda: cluster.config_map(ref["name"])[ref["key"]], None)
    if "secretKeyRef" in source:
        ref = source["secretKeyRef"]
        value = optional(ref, lambda: cluster.secret(ref["name"])[ref["key"]], None)
        return None if value is None else value.decode()
    if "fieldRef" in source:
        return field_ref(source["fieldRef"]["fieldPath"], pod)
    if "resourceFieldRef" in source:
        return resource_field(source["resourceFieldRef"], pod, container)
    raise Unsupported(f"valueFrom {source}")


def field_ref(path: str, pod: Pod) -> str:
    """The downward API's pod fields."""
    simple = {"metadata.name": pod.name, "metadata.namespace": pod.namespace, "metadata.uid": pod.uid,
              "spec.nodeName": pod.node_name, "spec.serviceAccountName": pod.spec.get("serviceAccountName", "default"),
              "status.podIP": pod.ip, "status.podIPs": pod.ip, "status.hostIP": pod.ip, "status.hostIPs": pod.ip}
    if path in simple:
        return simple[path]
    m = re.fullmatch(r"metadata\.(labels|annotations)\['([^']+)'\]", path)
    if m:
        return (pod.labels if m[1] == "labels" else pod.annotations).get(m[2], "")
    raise Unsupported(f"fieldRef {path}")


QUANTITY_SUFFIXES = {"m": Fraction(1, 1000), "": Fraction(1), "k": Fraction(10**3), "M": Fraction(10**6),
                     "G": Fraction(10**9), "T": Fraction(10**12), "Ki": Fraction(2**10), "Mi": Fraction(2**20),
                     "Gi": Fraction(2**30), "Ti": Fraction(2**40)}


def quantity(text: str | int | float) -> Fraction:
    """A resource quantity ('500m', '2', '4Gi', '1e3') as an exact number."""
    m = re.fullmatch(r"([0-9.]+(?:[eE][-+]?[0-9]+)?)(m|k|M|G|T|Ki|Mi|Gi|Ti)?", str(text))
    if not m:
        raise Unsupported(f"resource quantity {text!r}")
    return Fraction(m[1]) * QUANTITY_SUFFIXES[m[2] or ""]


def resource_field(ref: dict, pod: Pod, container: dict) -> str:
    """limits.cpu and the like (of `containerName`, else this container), in units of the divisor, rounded up as the
    kubelet does it. NOTE: an unset limit would be the node's allocatable amount, which this emulation does not
    model."""
    if "containerName" in ref:
        container = next(c for c in pod.spec["containers"] if c["name"] == ref["containerName"])
    kind, _, resource = ref["resource"].partition(".")
    value = (container.get("resources") or {}).get(kind, {}).get(resource)
    if value is None:
        raise Unsupported(f"resourceFieldRef {ref['resource']} with no {ref['resource']} set (the node's "
                          f"allocatable amount)")
    return str(math.ceil(quantity(value) / quantity(ref.get("divisor", "1"))))


def command_line(container: dict, env: dict[str, str]) -> tuple[list[str] | None, list[str] | None]:
    """(command, args) with $(VAR) expanded over the container's environment; None keeps the image's ENTRYPOINT/CMD."""
    command, args = container.get("command"), container.get("args")
    exp = [None if part is None else [expand(s, env.get) for s in part] for part in (command, args)]
    return exp[0], exp[1]


# ---- Services: names that resolve to the pods they select -------------------------------------------------------

def selects(service: dict, labels: dict[str, str]) -> bool:
    selector = (service.get("spec") or {}).get("selector") or {}
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


def service_aliases(services: list[dict], labels: dict[str, str], namespace: str) -> list[str]:
    """The DNS names that lead to a pod with `labels`: every name of each Service whose selector matches."""
    out = []
    for svc in services:
        if selects(svc, labels):
            name = svc["metadata"]["name"]
            out += [name, f"{name}.{namespace}", f"{name}.{namespace}.svc", f"{name}.{namespace}.svc.{CLUSTER_DOMAIN}"]
    return out


def service_ports(services: list[dict], pod: Pod) -> list[tuple[str, str, int]]:
    """(service, port name, container port) for each port of the Services that select `pod`. A Service port that
    differs from its target is Unsupported: a network alias does not translate ports."""
    named = pod.container_ports()
    out = []
    for svc in services:
        if not selects(svc, pod.labels):
            continue
        for port in svc["spec"].get("ports", []):
            target = port.get("targetPort", port["port"])
            if isinstance(target, str):
                if target not in named:
                    raise ValueError(f"Service {svc['metadata']['name']} targets port {target!r}, which no container "
                                     f"of {pod.deployment} names (it has {sorted(named)})")
                target = named[target]
            if int(target) != int(port["port"]):
                raise Unsupported(f"Service {svc['metadata']['name']}: port {port['port']} -> {target}")
            out.append((svc["metadata"]["name"], port.get("name", str(port["port"])), int(target)))
    return out


# ---- probes ----------------------------------------------------------------------------------------------------

@dataclass(slots=True)
class Probe:
    """One probe with the API's defaults. kind: exec (command), grpc (port, service), httpGet (port, path),
    tcpSocket (port)."""

    kind: str
    command: list[str] = field(default_factory=list)
    port: int = 0
    service: str = ""
    path: str = "/"
    initial_delay: float = 0
    period: float = 10
    timeout: float = 1
    success_threshold: int = 1
    failure_threshold: int = 3

    @classmethod
    def of(cls, probe: dict, ports: dict[str, int]) -> Probe:
        timing = dict(initial_delay=probe.get("initialDelaySeconds", 0), period=probe.get("periodSeconds", 10),
                      timeout=probe.get("timeoutSeconds", 1), success_threshold=probe.get("successThreshold", 1),
                      failure_threshold=probe.get("failureThreshold", 3))
        if "exec" in probe:
            return cls("exec", command=list(probe["exec"]["command"]), **timing)
        if "grpc" in probe:
            return cls("grpc", port=int(probe["grpc"]["port"]), service=probe["grpc"].get("service", ""), **timing)
        for kind in ("httpGet", "tcpSocket"):
            if kind in probe:
                port = probe[kind]["port"]
                return cls(kind, port=ports[port] if isinstance(port, str) else int(port),
                           path=probe[kind].get("path", "/"), **timing)
        raise Unsupported(f"probe {probe}")

    def describe(self) -> str:
        if self.kind == "exec":
            return "exec " + " ".join(self.command)
        return f"{self.kind} :{self.port}" + (f" {self.service!r}" if self.kind == "grpc" else "")


def container_probes(container: dict, pod: Pod) -> dict[str, Probe]:
    """{'startup'|'readiness'|'liveness': Probe} of the container."""
    ports = pod.container_ports()
    return {kind: Probe.of(container[f"{kind}Probe"], ports) for kind in ("startup", "readiness", "liveness")
            if f"{kind}Probe" in container}
