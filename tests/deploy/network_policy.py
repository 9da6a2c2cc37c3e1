"""NetworkPolicy ingress as an enforcing network plugin computes it, over rendered manifests: a pod selected by no
policy (with Ingress in its policyTypes) admits everything; a pod selected by one or more admits the UNION of their
rules (a policy can only add to what another admits, never narrow it). Each rule admits its `from` peers (none: every
source) on its `ports` (none: every port; a named port is the target pod's container port of that name).

A peer is (namespaceSelector, podSelector): without a namespaceSelector it is the policy's own namespace, without a
podSelector every pod of the selected namespaces; `{}` selects everything. An ipBlock is taken as admitting every
source (conservative: this model has no addresses). Sources are sample pods (a namespace and labels), plus one
outside the cluster; a namespace's labels are the one the API server sets, kubernetes.io/metadata.name."""

from __future__ import annotations

from dataclasses import dataclass, field

# Where an overlay puts everything; the base's objects carry no namespace and are applied into one: this one.
APP_NAMESPACE = "pagedserve"
NAMESPACE_NAME = "kubernetes.io/metadata.name"
OTHER_PORT = 65000  # a port no container declares: nothing should reach it either
WORKLOADS = ("Deployment", "StatefulSet", "DaemonSet")


def namespace_of(doc: dict) -> str:
    return doc["metadata"].get("namespace", APP_NAMESPACE)


def selector_matches(selector: dict | None, labels: dict) -> bool:
    """A LabelSelector (matchLabels, matchExpressions) against labels; `{}` selects everything, None nothing."""
    if selector is None:
        return False
    assert set(selector) <= {"matchLabels", "matchExpressions"}, selector
    if any(labels.get(k) != v for k, v in (selector.get("matchLabels") or {}).items()):
        return False
    for e in selector.get("matchExpressions") or []:
        key, op, values = e["key"], e["operator"], e.get("values", [])
        ok = {"In": key in labels and labels[key] in values, "NotIn": labels.get(key) not in values,
              "Exists": key in labels, "DoesNotExist": key not in labels}[op]
        if not ok:
            return False
    return True


@dataclass(frozen=True)
class Source:
    """Whatever opens a connection: a pod (its namespace and labels) or, namespace None, a host outside the cluster."""
    name: str
    namespace: str | None
    labels: dict = field(default_factory=dict, hash=False)

    @property
    def namespace_labels(self) -> dict:
        return {NAMESPACE_NAME: self.namespace}


@dataclass
class Peer:
    """Who one `from` entry (or a rule without `from`) admits."""
    policy: str
    namespace: str  # the policy's: a peer without namespaceSelector is in it
    namespace_selector: dict | None = None  # None: the policy's namespace only
    pod_selector: dict | None = None  # None: every pod of the selected namespaces
    ip_block: dict | None = None
    anywhere: bool = False  # a rule without `from`

    def admits(self, source: Source) -> bool:
        if self.anywhere or self.ip_block is not None:
            return True
        if source.namespace is None:  # outside the cluster: only an ipBlock (or no `from`) admits it
            return False
        if self.namespace_selector is None:
            in_namespace = source.namespace == self.namespace
        else:
            in_namespace = selector_matches(self.namespace_selector, source.namespace_labels)
        return in_namespace and (self.pod_selector is None or selector_matches(self.pod_selector, source.labels))

    @property
    def same_namespace_pods(self) -> bool:
        """Only pods of the policy's own namespace (no namespaceSelector, no ipBlock, a `from`)."""
        return not self.anywhere and self.ip_block is None and self.namespace_selector is None \
            and self.pod_selector is not None


def peers_of(policy: dict, rule: dict) -> list[Peer]:
    name, namespace = policy["metadata"]["name"], namespace_of(policy)
    if not rule.get("from"):  # absent or empty: every source
        return [Peer(name, namespace, anywhere=True)]
    found = []
    for peer in rule["from"]:
        assert set(peer) <= {"namespaceSelector", "podSelector", "ipBlock"}, peer
        found.append(Peer(name, namespace, peer.get("namespaceSelector"), peer.get("podSelector"), peer.get("ipBlock")))
    return found


@dataclass(frozen=True)
class Target:
    """A workload's pods, as a NetworkPolicy sees them."""
    kind: str
    name: str
    namespace: str
    labels: dict = field(hash=False)
    ports: dict = field(hash=False)  # container port name -> number (TCP)

    @property
    def source(self) -> Source:
        return Source(self.name, self.namespace, self.labels)


def targets(docs: list[dict]) -> list[Target]:
    found = []
    for d in docs:
        if d["kind"] in WORKLOADS:
            template = d["spec"]["template"]
            ports = {p.get("name", str(p["containerPort"])): p["containerPort"]
                     for c in template["spec"]["containers"] for p in c.get("ports", [])
                     if p.get("protocol", "TCP") == "TCP"}
            found.append(Target(d["kind"], d["metadata"]["name"], namespace_of(d),
                                template["metadata"].get("labels", {}), ports))
    return found


def policies_selecting(docs: list[dict], target: Target) -> list[dict]:
    """The NetworkPolicies that isolate `target` for ingress."""
    found = []
    for p in docs:
        if p["kind"] != "NetworkPolicy" or namespace_of(p) != target.namespace:
            continue
        types = p["spec"].get("policyTypes") or ["Ingress"]  # absent: Ingress (and Egress if it has egress rules)
        if "Ingress" in types and selector_matches(p["spec"]["podSelector"], target.labels):
            found.append(p)
    return found


def rule_covers(rule: dict, target: Target, port: int) -> bool:
    if not rule.get("ports"):  # absent or empty: every port
        return True
    for p in rule["ports"]:
        if p.get("protocol", "TCP") != "TCP":
            continue
        if "port" not in p:  # every port of the protocol
            return True
        number = target.ports.get(p["port"]) if isinstance(p["port"], str) else p["port"]
        if number is not None and number <= port <= p.get("endPort", number):
            return True
    return False


def ingress_peers(docs: list[dict], target: Target, port: int) -> list[Peer] | None:
    """Who may reach `port` of `target`'s pods: the union over every policy selecting them; None: not isolated
    (every source)."""
    policies = policies_selecting(docs, target)
    if not policies:
        return None
    return [peer for p in policies for rule in p["spec"].get("ingress") or [] if rule_covers(rule, target, port)
            for peer in peers_of(p, rule)]


def admitted(docs: list[dict], target: Target, port: int, source: Source) -> bool:
    peers = ingress_peers(docs, target, port)
    return peers is None or any(peer.admits(source) for peer in peers)


def reachability(docs: list[dict], sources: list[Source]) -> dict[str, list[str]]:
    """{"<workload>:<port name>": the names of the sources that reach it, sorted} for every declared port of every
    workload, and "<workload>:other" for a port none declares."""
    table = {}
    for t in targets(docs):
        for port_name, number in sorted(t.ports.items()) + [("other", OTHER_PORT)]:
            table[f"{t.name}:{port_name}"] = sorted(s.name for s in sources if admitted(docs, t, number, s))
    return table
