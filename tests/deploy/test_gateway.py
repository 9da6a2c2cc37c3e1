"""The gateway-inference-extension overlay: rendered by kubectl, validated against the Kubernetes schemas and the
published CRDs (InferencePool, Gateway, HTTPRoute), and checked as a fleet: cells, pool, endpoint picker."""

import copy
import re
import shutil
import subprocess
import textwrap

import pytest
import yaml

from tests.deploy import crd_schema, manifests
from tests.deploy.rendered import (GATEWAY_OVERLAY, KUBERNETES, by_command, container, env, epp_config,
                                   epp_metric_specs, named, of_kind, pod_labels, render, selects, tool)

KUBERNETES_VERSION = "1.34.0"  # the version the project validates against (tests/deploy/test_kubernetes.py too)
CRDS = {("inference.networking.k8s.io/v1", "InferencePool"): "inference.networking.k8s.io_inferencepools.yaml",
        ("gateway.networking.k8s.io/v1", "Gateway"): "gateway.networking.k8s.io_gateways.yaml",
        ("gateway.networking.k8s.io/v1", "HTTPRoute"): "gateway.networking.k8s.io_httproutes.yaml"}
# What pagedserve's /metrics exposes of the model-server protocol (scheduler_svc/metrics.py): the EPP may read these.
PROTOCOL_METRICS = {"vllm:num_requests_waiting", "vllm:num_requests_running", "vllm:kv_cache_usage_perc",
                    "vllm:cache_config_info"}
CACHE_INFO_LABELS = {"block_size", "num_gpu_blocks"}
# The EPP refuses these flags (llm-d-router >= v0.9: "configure metrics via engineConfigs").
DEPRECATED_EPP_FLAGS = ("--total-queued-requests-metric", "--total-running-requests-metric",
                        "--kv-cache-usage-percentage-metric", "--lora-info-metric", "--cache-info-metric")
CELL = "app.kubernetes.io/instance"
SCHEDULER, WORKER = ["pagedserve", "scheduler"], ["pagedserve", "worker"]
PROBES = {"startupProbe", "readinessProbe", "livenessProbe"}


@pytest.fixture(scope="module")
def docs() -> list[dict]:
    return render(GATEWAY_OVERLAY)


def crd(doc: dict) -> dict:
    return crd_schema.load(CRDS[doc["apiVersion"], doc["kind"]])


def kubernetes_validate(tmp_path, docs: list[dict]) -> subprocess.CompletedProcess:
    path = tmp_path / "rendered.yaml"
    path.write_text(yaml.safe_dump_all(docs))
    return subprocess.run([tool("kubernetes-validate"), "--strict", "-k", KUBERNETES_VERSION, str(path)],
                          capture_output=True, text=True, timeout=120)


def host_port(address: str) -> tuple[str, int]:
    host, port = address.rsplit(":", 1)
    return host, int(port)


def flag(args: list[str], name: str) -> str:
    [value] = [a.split("=", 1)[1] for a in args if a.startswith(f"{name}=")]
    return value


# -- the spec checks: each returns what is wrong (empty: nothing), so a test can show it catches a broken fleet --
def service_port_to(docs: list[dict], service_name: str, port: int, pods: list[dict]) -> list[str]:
    """Service `service_name` exists, selects exactly `pods` (Deployments), and its `port` lands on a container port
    of theirs (by name or number)."""
    found = [s for s in of_kind(docs, "Service") if s["metadata"]["name"] == service_name]
    if not found:
        return [f"no Service {service_name}"]
    service = found[0]
    selected = [d["metadata"]["name"] for d in of_kind(docs, "Deployment")
                if selects(service["spec"].get("selector", {}), pod_labels(d))]
    problems = [] if selected == [p["metadata"]["name"] for p in pods] else \
        [f"Service {service_name} selects {selected}, not {[p['metadata']['name'] for p in pods]}"]
    ports = [p for p in service["spec"]["ports"] if p["port"] == port]
    if not ports:
        return problems + [f"Service {service_name} has no port {port}"]
    target = ports[0].get("targetPort", port)
    for pod in pods:
        container_ports = pod["spec"]["template"]["spec"]["containers"][0].get("ports", [])
        if not any(target in (p["containerPort"], p.get("name")) for p in container_ports):
            problems.append(f"Service {service_name}:{port} -> {target}: no such port on {pod['metadata']['name']}")
    return problems


def cell_problems(docs: list[dict]) -> list[str]:
    """Every cell is one scheduler and its workers: the workers dial their own cell's worker Service, and their
    probes ask their own cell's client Service."""
    problems = []
    schedulers = {pod_labels(d).get(CELL): d for d in by_command(docs, SCHEDULER)}
    for worker in by_command(docs, WORKER):
        cell = pod_labels(worker).get(CELL)
        if cell not in schedulers:
            problems.append(f"{worker['metadata']['name']}: no scheduler in its cell {cell!r}")
            continue
        scheduler = schedulers[cell]
        listen = env(container(scheduler, "scheduler"))["PAGEDSERVE_WORKER_LISTEN"]
        host, port = host_port(env(container(worker, "worker"))["PAGEDSERVE_SCHEDULER"])
        if port != host_port(listen)[1]:
            problems.append(f"{worker['metadata']['name']} dials port {port}, its scheduler listens on {listen}")
        problems += service_port_to(docs, host, port, [scheduler])
        for probe in PROBES & container(worker, "worker").keys():
            command = container(worker, "worker")[probe]["exec"]["command"][-1]
            server = re.search(r"--server (\S+)", command).group(1)
            problems += service_port_to(docs, *host_port(server), [scheduler])
    return problems


def pool_problems(docs: list[dict]) -> list[str]:
    """The InferencePool selects every cell's scheduler pod template and nothing else (no worker, no EPP), on the
    port where each scheduler serves its HTTP API."""
    [pool] = of_kind(docs, "InferencePool")
    selector = pool["spec"]["selector"]["matchLabels"]
    selected = {d["metadata"]["name"] for d in of_kind(docs, "Deployment") if selects(selector, pod_labels(d))}
    schedulers = {d["metadata"]["name"] for d in by_command(docs, SCHEDULER)}
    problems = [] if selected == schedulers else [f"the pool selects {sorted(selected)}, not {sorted(schedulers)}"]
    ports = [p["number"] for p in pool["spec"]["targetPorts"]]
    for name in sorted(schedulers):
        scheduler = container(named(docs, "Deployment", name), "scheduler")
        http = env(scheduler).get("PAGEDSERVE_HTTP", "")
        if not http or ports != [host_port(http)[1]]:
            problems.append(f"{name}: the pool targets {ports}, the scheduler serves HTTP on {http!r}")
        if not any(p["containerPort"] in ports for p in scheduler["ports"]):
            problems.append(f"{name}: no containerPort in {ports} (the EPP then skips the pod)")
    return problems


# -- rendering and schemas ----------------------------------------------------------------------------------------
def test_native_kinds_pass_kubernetes_validate_strict_and_the_rest_are_the_crds_kinds(docs, tmp_path):
    native = [d for d in docs if (d["apiVersion"], d["kind"]) not in CRDS]
    out = kubernetes_validate(tmp_path, native)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "WARN" not in out.stdout + out.stderr and "ERROR" not in out.stdout + out.stderr, out.stdout + out.stderr
    for doc in native:
        assert f"passed for resource {doc['kind'].lower()}/{doc['metadata']['name']}" in out.stdout
    assert sorted(d["kind"] for d in docs if (d["apiVersion"], d["kind"]) in CRDS) == \
        ["Gateway", "HTTPRoute", "InferencePool"]
    assert {d["metadata"]["namespace"] for d in docs} == {"pagedserve"}


def test_kubernetes_validate_rejects_an_unknown_field(docs, tmp_path):
    epp = copy.deepcopy(named(docs, "Deployment", "pagedserve-epp"))
    epp["spec"]["template"]["spec"]["containers"][0]["metricsPort"] = 9464
    out = kubernetes_validate(tmp_path, [epp])
    assert out.returncode != 0 and "metricsPort" in out.stdout + out.stderr


def test_custom_resources_validate_against_the_published_crds_schema_and_cel_rules(docs):
    for doc in docs:
        if (doc["apiVersion"], doc["kind"]) in CRDS:
            assert crd_schema.errors(crd(doc), doc) == [], doc["kind"]
            assert crd_schema.cel_failures(crd(doc), doc) == [], doc["kind"]


def broken(doc: dict, change) -> dict:
    out = copy.deepcopy(doc)
    change(out["spec"])
    return out


@pytest.mark.parametrize("kind, change, schema_error", [
    ("InferencePool", lambda s: s.update(metricsPort=9464), "'metricsPort' was unexpected"),
    ("InferencePool", lambda s: s.update(targetPorts=[]), "should be non-empty"),
    ("InferencePool", lambda s: s["endpointPickerRef"].update(failureMode="Sometimes"), "'Sometimes' is not one of"),
    ("InferencePool", lambda s: s["selector"].pop("matchLabels"), "'matchLabels' is a required property"),
    ("InferencePool", lambda s: s.update(selector={"app": "x"}), "'app' was unexpected"),
    ("Gateway", lambda s: s["listeners"][0].pop("protocol"), "'protocol' is a required property"),
    ("HTTPRoute", lambda s: s["rules"][0]["backendRefs"][0].update(weight=-1), "less than the minimum"),
])
def test_the_schema_validation_rejects_what_the_crd_forbids(docs, kind, change, schema_error):
    [doc] = of_kind(docs, kind)
    assert any(schema_error in e for e in crd_schema.errors(crd(doc), broken(doc, change)))


@pytest.mark.parametrize("kind, change, message", [
    ("InferencePool", lambda s: s["endpointPickerRef"].pop("port"), "port is required when kind is 'Service'"),
    ("InferencePool", lambda s: s["targetPorts"].append({"number": 8000}), "port number must be unique"),
    ("Gateway", lambda s: s["listeners"].append(dict(s["listeners"][0])), "Listener name must be unique"),
    ("HTTPRoute", lambda s: s["rules"][0]["matches"][0]["path"].update(value="v1"), "must be an absolute path"),
    ("HTTPRoute", lambda s: s["rules"][0]["timeouts"].update(backendRequest="1h"),
     "backendRequest timeout cannot be longer than request timeout"),
])
def test_the_cel_rules_reject_what_the_crd_forbids(docs, kind, change, message):
    [doc] = of_kind(docs, kind)
    bad = broken(doc, change)
    assert crd_schema.errors(crd(doc), bad) == []  # NOTE: only CEL catches these
    assert any(message in f for f in crd_schema.cel_failures(crd(doc), bad)), crd_schema.cel_failures(crd(doc), bad)


def test_the_vendored_crds_name_their_source_version_and_license():
    for file in CRDS.values():
        head = crd_schema.header(file)
        assert head["Source"].startswith("https://raw.githubusercontent.com/kubernetes-sigs/"), file
        assert head["Source"].endswith(file) and f"/{head['Version'].split()[0]}/" in head["Source"], file
        assert head["License"].startswith("Apache License 2.0"), file
        annotations = crd_schema.load(file)["metadata"]["annotations"]
        bundle = {v for k, v in annotations.items() if k.endswith("/bundle-version")}
        assert bundle == {head["Version"].split()[0]}, file


# -- the fleet ----------------------------------------------------------------------------------------------------
def test_every_cell_is_a_scheduler_and_its_workers_with_names_of_their_own(docs):
    schedulers, workers = by_command(docs, SCHEDULER), by_command(docs, WORKER)
    cells = sorted(pod_labels(d)[CELL] for d in schedulers)
    assert cells == ["pagedserve-a", "pagedserve-b"]
    assert sorted(pod_labels(d)[CELL] for d in workers) == cells
    for deployment in schedulers + workers:
        # NOTE: the Deployment's own selector carries the cell too, so two cells' ReplicaSets never adopt each other
        assert deployment["spec"]["selector"]["matchLabels"][CELL] == pod_labels(deployment)[CELL]
        suffix = pod_labels(deployment)[CELL].removeprefix("pagedserve")
        assert deployment["metadata"]["name"].endswith(suffix)
        spec = deployment["spec"]["template"]["spec"]
        assert {v["persistentVolumeClaim"]["claimName"] for v in spec["volumes"] if "persistentVolumeClaim" in v} \
            == {f"pagedserve-model-cache{suffix}"}
        refs = {c["configMapRef"]["name"] for k in spec["containers"] + spec["initContainers"]
                for c in k.get("envFrom", [])}
        assert "pagedserve-config" + suffix in refs
        for ref in refs:
            assert ref.endswith(suffix) and named(docs, "ConfigMap", ref), ref
    # One model behind the pool: every cell's configuration is the same.
    configs = {}
    for config in of_kind(docs, "ConfigMap"):
        name = config["metadata"]["name"]
        if name.startswith("pagedserve-") and name.endswith(("-a", "-b")):
            configs.setdefault(name[:-2], []).append(config["data"])
    assert "pagedserve-config" in configs
    for name, data in configs.items():
        assert len(data) == 2 and data[0] == data[1], name


def test_each_cells_workers_dial_their_own_cells_worker_service(docs):
    assert cell_problems(docs) == []
    worker = container(named(docs, "Deployment", "pagedserve-worker-a"), "worker")
    assert env(worker)["PAGEDSERVE_SCHEDULER"] == "pagedserve-workers-a:50052"


def test_the_cell_check_catches_a_worker_dialling_another_cell(docs):
    crossed = copy.deepcopy(docs)
    worker = container(named(crossed, "Deployment", "pagedserve-worker-b"), "worker")
    [entry] = [e for e in worker["env"] if e["name"] == "PAGEDSERVE_SCHEDULER"]
    entry["value"] = "pagedserve-workers-a:50052"
    assert cell_problems(crossed) == [
        "Service pagedserve-workers-a selects ['pagedserve-scheduler-a'], not ['pagedserve-scheduler-b']"]
    probe = worker["readinessProbe"]["exec"]["command"]
    probe[-1] = probe[-1].replace("pagedserve-b:", "pagedserve:")
    assert "no Service pagedserve" in cell_problems(crossed)


def test_the_workers_readiness_is_the_bases_with_the_cells_service_and_nothing_kills_them(docs):
    # NOTE: the cells restate the base's readiness command with their own Service name; this keeps it the base's.
    base = container(named(render(KUBERNETES / "base"), "Deployment", "pagedserve-worker"), "worker")
    for cell in ("a", "b"):
        worker = container(named(docs, "Deployment", f"pagedserve-worker-{cell}"), "worker")
        expected = copy.deepcopy(base["readinessProbe"])
        expected["exec"]["command"][-1] = expected["exec"]["command"][-1].replace(
            "--server pagedserve:", f"--server pagedserve-{cell}:")
        assert worker["readinessProbe"] == expected, cell
        assert PROBES & worker.keys() == {"readinessProbe"}, cell  # a probe of a worker asks the scheduler


def test_the_pool_selects_exactly_every_cells_scheduler_on_its_http_port(docs):
    assert pool_problems(docs) == []
    [pool] = of_kind(docs, "InferencePool")
    assert pool["spec"]["targetPorts"] == [{"number": 8000}]
    for scheduler in by_command(docs, SCHEDULER):
        assert env(container(scheduler, "scheduler"))["PAGEDSERVE_HTTP"] == "0.0.0.0:8000"


def test_the_pool_check_catches_a_selector_that_takes_workers_or_misses_a_cell(docs):
    wide = copy.deepcopy(docs)
    [pool] = of_kind(wide, "InferencePool")
    pool["spec"]["selector"]["matchLabels"] = {"app.kubernetes.io/part-of": "pagedserve"}
    assert pool_problems(wide) == ["the pool selects [], not ['pagedserve-scheduler-a', 'pagedserve-scheduler-b']"]
    pool["spec"]["selector"]["matchLabels"] = {CELL: "pagedserve-a"}
    assert pool_problems(wide)[0].startswith("the pool selects ['pagedserve-scheduler-a', 'pagedserve-worker-a']")
    pool["spec"]["selector"]["matchLabels"] = {"app.kubernetes.io/component": "scheduler"}
    pool["spec"]["targetPorts"] = [{"number": 50051}]
    assert "pagedserve-scheduler-a: the pool targets [50051], the scheduler serves HTTP on '0.0.0.0:8000'" \
        in pool_problems(wide)


def test_the_route_and_the_pool_reach_the_endpoint_picker(docs):
    [gateway], [route], [pool] = of_kind(docs, "Gateway"), of_kind(docs, "HTTPRoute"), of_kind(docs, "InferencePool")
    assert [p["name"] for p in route["spec"]["parentRefs"]] == [gateway["metadata"]["name"]]
    assert route["spec"]["rules"][0]["backendRefs"] == [
        {"group": "inference.networking.k8s.io", "kind": "InferencePool", "name": pool["metadata"]["name"]}]
    epp = named(docs, "Deployment", "pagedserve-epp")
    ref = pool["spec"]["endpointPickerRef"]
    assert service_port_to(docs, ref["name"], ref["port"]["number"], [epp]) == []
    args = container(epp, "epp")["args"]
    assert int(flag(args, "--grpc-port")) == ref["port"]["number"]
    assert flag(args, "--pool-name") == pool["metadata"]["name"]
    assert flag(args, "--pool-group") == pool["apiVersion"].split("/")[0]


def test_the_endpoint_picker_scrapes_each_schedulers_metrics_port(docs):
    config = epp_config(docs)
    assert config["apiVersion"] == "llm-d.ai/v1alpha1" and config["kind"] == "EndpointPickerConfig"
    [source] = [p for p in config["plugins"] if p["type"] == "metrics-data-source"]
    # NOTE: the plugin's name must be its type, or the EPP adds a default source (scraping the target port) too.
    assert "name" not in source and config["dataLayer"]["sources"] == [
        {"pluginRef": "metrics-data-source", "extractors": [{"pluginRef": "core-metrics-extractor"}]}]
    for scheduler in by_command(docs, SCHEDULER):
        ports = {p["name"]: p["containerPort"] for p in container(scheduler, "scheduler")["ports"]}
        assert source["parameters"]["port"] == ports["metrics"]
        metrics = env(container(scheduler, "scheduler"))["PAGEDSERVE_METRICS"]
        assert host_port(metrics) == ("0.0.0.0", ports["metrics"])
    assert source["parameters"]["path"] == "/metrics" and source["parameters"]["scheme"] == "http"


def test_the_endpoint_picker_reads_metric_names_our_metrics_expose(docs):
    specs = epp_metric_specs(docs)
    assert specs == {"queuedRequestsSpec": "vllm:num_requests_waiting",
                     "runningRequestsSpec": "vllm:num_requests_running",
                     "kvUsageSpec": "vllm:kv_cache_usage_perc", "cacheInfoSpec": "vllm:cache_config_info"}
    for spec in specs.values():
        assert re.fullmatch(r"[a-zA-Z_:][a-zA-Z0-9_:]*", spec) and spec in PROTOCOL_METRICS, spec
    [extractor] = [p for p in epp_config(docs)["plugins"] if p["type"] == "core-metrics-extractor"]
    [engine] = extractor["parameters"]["engineConfigs"]
    assert {engine["cacheBlockSizeLabelName"], engine["cacheNumBlocksLabelName"]} == CACHE_INFO_LABELS
    assert engine["loraSpec"] == ""  # no vllm:lora_requests_info: pagedserve serves no adapters
    args = container(named(docs, "Deployment", "pagedserve-epp"), "epp")["args"]
    assert not [a for a in args if a.startswith(DEPRECATED_EPP_FLAGS)]


def test_the_endpoint_pickers_scorers_are_in_its_profile(docs):
    config = epp_config(docs)
    names = {p.get("name", p["type"]) for p in config["plugins"]}
    [profile] = config["schedulingProfiles"]
    refs = {p["pluginRef"]: p.get("weight") for p in profile["plugins"]}
    assert set(refs) <= names
    assert refs == {"prefix-cache-scorer": 3, "queue-scorer": 2, "kv-cache-utilization-scorer": 2,
                    "max-score-picker": None}


def test_the_endpoint_picker_may_watch_its_pool_and_pods_and_runs_locked_down(docs):
    epp = named(docs, "Deployment", "pagedserve-epp")
    spec = epp["spec"]["template"]["spec"]
    [binding] = [b for b in of_kind(docs, "RoleBinding")
                 if ("ServiceAccount", spec["serviceAccountName"], epp["metadata"]["namespace"]) in
                 [(s["kind"], s["name"], s.get("namespace")) for s in b["subjects"]]]
    role = named(docs, binding["roleRef"]["kind"], binding["roleRef"]["name"])
    granted = {(group, resource): set(r["verbs"]) for r in role["rules"] for group in r["apiGroups"]
               for resource in r["resources"]}
    for needed in (("inference.networking.k8s.io", "inferencepools"), ("", "pods")):
        assert granted[needed] >= {"get", "list", "watch"}, needed
    assert not [verbs for verbs in granted.values() if verbs - {"get", "list", "watch"}]  # read only
    assert spec["securityContext"]["runAsNonRoot"] is True
    security = container(epp, "epp")["securityContext"]
    assert security["readOnlyRootFilesystem"] is True and security["capabilities"]["drop"] == ["ALL"]
    assert security["allowPrivilegeEscalation"] is False


def admits(policy: dict, to: dict, from_labels: dict, port: int) -> bool:
    """Whether a NetworkPolicy lets a pod with from_labels (same namespace) reach `port` on Deployment `to`'s pods:
    a rule without `from` admits every source, a named port is the pod's container port of that name."""
    if not selects(policy["spec"]["podSelector"].get("matchLabels", {}), pod_labels(to)):
        return False
    named_ports = {p.get("name"): p["containerPort"] for c in to["spec"]["template"]["spec"]["containers"]
                   for p in c.get("ports", [])}
    return any(any(named_ports.get(p["port"], p["port"]) == port for p in rule.get("ports", [])) and
               ("from" not in rule or any(selects(peer.get("podSelector", {}).get("matchLabels", {}), from_labels)
                                          for peer in rule["from"] if "namespaceSelector" not in peer))
               for rule in policy["spec"].get("ingress", []))


def test_network_policies_let_the_picker_reach_metrics_and_the_gateway_reach_the_pool(docs):
    policies = of_kind(docs, "NetworkPolicy")
    [gateway] = of_kind(docs, "Gateway")
    gateway_pod = {"gateway.networking.k8s.io/gateway-name": gateway["metadata"]["name"]}
    epp_pod = pod_labels(named(docs, "Deployment", "pagedserve-epp"))
    assert all(p["spec"]["policyTypes"] == ["Ingress"] for p in policies)  # egress stays open (the API server)
    for scheduler in by_command(docs, SCHEDULER):
        assert any(admits(p, scheduler, epp_pod, 9464) for p in policies), scheduler["metadata"]["name"]
        assert any(admits(p, scheduler, gateway_pod, 8000) for p in policies), scheduler["metadata"]["name"]
        assert not any(admits(p, scheduler, gateway_pod, 9464) for p in policies)
    epp = named(docs, "Deployment", "pagedserve-epp")
    assert any(admits(p, epp, gateway_pod, 9002) for p in policies)
    assert not any(admits(p, epp, gateway_pod, 9090) for p in policies)  # its metrics: the monitoring namespace


def test_the_policy_check_sees_the_picker_and_the_gateway_shut_out_without_the_overlays_patch(docs):
    # NOTE: a cell rendered on its own is the base's policy, unpatched: it admits neither
    [gateway] = of_kind(docs, "Gateway")
    gateway_pod = {"gateway.networking.k8s.io/gateway-name": gateway["metadata"]["name"]}
    epp_pod = pod_labels(named(docs, "Deployment", "pagedserve-epp"))
    for cell in "ab":
        alone = render(GATEWAY_OVERLAY / "cells" / cell)
        [scheduler] = by_command(alone, SCHEDULER)
        assert not any(admits(p, scheduler, epp_pod, 9464) for p in of_kind(alone, "NetworkPolicy"))
        assert not any(admits(p, scheduler, gateway_pod, 8000) for p in of_kind(alone, "NetworkPolicy"))
        patched = named(docs, "Deployment", scheduler["metadata"]["name"])
        assert any(admits(p, patched, epp_pod, 9464) for p in of_kind(docs, "NetworkPolicy"))


def docs_add_a_cell() -> str:
    """docs/deployment.md's "Add a cell" commands (the fenced block that makes cells/c), as written there."""
    page = (KUBERNETES.parents[1] / "docs" / "deployment.md").read_text()
    section = page.split("### A fleet behind the Gateway API Inference Extension", 1)[1].split("\n## ", 1)[0]
    [block] = [b for b in re.findall(r"```bash\n(.*?)```", section, re.S) if "cells/c" in b]
    return textwrap.dedent(block)


def test_the_docs_recipe_adds_a_third_cell_that_passes_the_same_checks(tmp_path):
    shutil.copytree(KUBERNETES, tmp_path / "deploy" / "kubernetes")
    out = subprocess.run(["bash", "-euo", "pipefail", "-c", docs_add_a_cell()], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    grown = render(tmp_path / GATEWAY_OVERLAY.relative_to(KUBERNETES.parents[1]))
    assert sorted(pod_labels(d)[CELL] for d in by_command(grown, SCHEDULER)) == \
        ["pagedserve-a", "pagedserve-b", "pagedserve-c"]
    assert cell_problems(grown) == [] and pool_problems(grown) == []
    worker = container(named(grown, "Deployment", "pagedserve-worker-c"), "worker")
    assert env(worker)["PAGEDSERVE_SCHEDULER"] == "pagedserve-workers-c:50052"
    assert "--server pagedserve-c:50051" in worker["readinessProbe"]["exec"]["command"][-1]


def test_every_cells_pagedserve_variables_are_flags_of_their_commands_and_graces_exceed_the_drain():
    # NOTE: the base's CLI checks (tests/deploy/test_kubernetes.py) over every cell's containers: the overlay's own
    # patches (each cell's PAGEDSERVE_SCHEDULER, the pool's PAGEDSERVE_HTTP and _METRICS) are flags too
    rendered = manifests.kustomize(GATEWAY_OVERLAY)
    pods = [manifests.Container("gateway", d, spec, init, manifests.resolved_env(rendered, spec))
            for d in rendered.of_kind("Deployment") for init, key in ((True, "initContainers"), (False, "containers"))
            for spec in d["spec"]["template"]["spec"].get(key, []) if spec.get("command", [""])[0] == "pagedserve"]
    assert {c.deployment["metadata"]["name"] for c in pods} == {
        f"pagedserve-{role}-{cell}" for role in ("scheduler", "worker") for cell in "ab"}
    drains = {}
    for c in pods:
        variables = {n for n in manifests.manifest_variables(rendered, c.spec) if n.startswith(manifests.PREFIX)}
        referenced = set(re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", " ".join(c.spec["command"])))
        assert variables - manifests.flag_variables(manifests.command_parser(c.argv)) - referenced == set(), c.name
        args = c.args()  # every value parses
        if c.argv[:2] == SCHEDULER:
            drains[c.deployment["metadata"]["name"][-1]] = args.drain_timeout
    for c in pods:
        grace = c.pod["terminationGracePeriodSeconds"]
        assert grace >= drains[c.deployment["metadata"]["name"][-1]] + manifests.AFTER_DRAIN_S, c.name
