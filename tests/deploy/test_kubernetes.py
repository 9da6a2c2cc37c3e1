"""deploy/kubernetes as `kubectl kustomize` renders each overlay: valid against the Kubernetes API schemas
(kubernetes-validate --strict) and KEDA's published ScaledObject schema, and in agreement with the CLI it runs."""

from __future__ import annotations

import copy
import os
import re
import shlex
from pathlib import Path

import jsonschema
import pytest
import yaml

from pagedserve_cli.env import PREFIX
from scheduler_svc.server import LIVENESS
from tests.deploy.manifests import (AFTER_DRAIN_S, BIN, IMAGE_ENV, KUBERNETES, ROOT, Render, command_parser,
                                    containers, cpu_cores, flag_variables, kustomize, main_container,
                                    manifest_variables, parse, run)

KUBERNETES_VERSION = "1.34.0"  # the version docs/deployment.md "Run on Kubernetes" names
# The overlays, and the image tag each runs; "all" is every component in one kustomization (they compose).
IMAGE_TAGS = {"cpu": "latest", "gpu": "gpu", "tls": "latest", "autoscale": "latest", "all": "gpu"}
COMPONENTS = ("gpu", "tls", "autoscale")
# Custom resources (kubernetes-validate knows native kinds only): checked against their published schemas.
CRD_SCHEMAS = {("keda.sh/v1alpha1", "ScaledObject"): Path(__file__).with_name("data") /
               "keda-scaledobject-v1alpha1.schema.yaml"}
# The scheduler's container ports and the flag that listens on each.
LISTENERS = {"grpc": "listen", "http": "http", "metrics": "metrics", "worker": "worker_listen"}
SERVICES = {"pagedserve": {"grpc", "http"}, "pagedserve-metrics": {"metrics"}, "pagedserve-workers": {"worker"}}
FILE_FLAGS = ("tls_cert", "tls_key", "tls_ca", "api_key_file", "worker_token_file")
HOST = "worker-pod-7f9c"  # what $(hostname) prints in a probe's shell


@pytest.fixture(scope="module")
def renders(tmp_path_factory) -> dict[str, Render]:
    """Each overlay rendered once; "all" from a kustomization of every component together."""
    combined = tmp_path_factory.mktemp("all")

    def rel(path: Path) -> str:  # NOTE: kustomize takes no absolute path
        return os.path.relpath(path, combined)
    (combined / "kustomization.yaml").write_text(yaml.safe_dump({
        "apiVersion": "kustomize.config.k8s.io/v1beta1", "kind": "Kustomization", "namespace": "pagedserve",
        "resources": [rel(KUBERNETES / "base")],
        "components": [rel(KUBERNETES / "components" / c) for c in COMPONENTS]}))
    paths = {o: KUBERNETES / "overlays" / o for o in IMAGE_TAGS if o != "all"} | {"all": combined}
    return {name: kustomize(path) for name, path in paths.items()}


OVERLAYS = pytest.mark.parametrize("overlay", list(IMAGE_TAGS))


def probe_argv(probe: dict) -> list[str]:
    """An exec probe's command as argv: a `sh -c` one must be one plain command ($(hostname) its only expansion)."""
    command = probe["exec"]["command"]
    if command[:2] != ["sh", "-c"]:
        return command
    script = command[2].replace('"$(hostname)"', HOST)
    assert not re.search(r"[;&|<>`$]", script), f"not one plain command: {command[2]}"
    return shlex.split(script)


def probes(spec: dict) -> dict[str, dict]:
    return {kind: spec[kind] for kind in ("startupProbe", "readinessProbe", "livenessProbe") if kind in spec}


def host_port(address: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    return host, int(port)


# -- schemas -----------------------------------------------------------------------------------------------------
@OVERLAYS
def test_every_overlay_renders_and_validates_strictly(renders, overlay, tmp_path):
    render = renders[overlay]
    path = tmp_path / f"{overlay}.yaml"
    path.write_text(render.text)
    out = run(str(BIN / "kubernetes-validate"), "--strict", "-k", KUBERNETES_VERSION, str(path))
    assert out.returncode == 0, out.stdout + out.stderr
    custom = [o for o in render.objects if (o["apiVersion"], o["kind"]) in CRD_SCHEMAS]
    assert out.stdout.count("passed for resource") == len(render.objects) - len(custom), out.stdout
    assert out.stdout.count("Couldn't find schema") == len(custom), out.stdout


def strict(schema):
    """A CRD's openAPIV3Schema as the API server applies it with strict field validation (kubectl's default): an
    object with `properties` takes no other field, unless it preserves unknown fields. NOTE: the CEL rules
    (x-kubernetes-validations) are not checked here."""
    if isinstance(schema, list):
        return [strict(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: strict(v) for k, v in schema.items()}
    if "properties" in out and "additionalProperties" not in out \
            and not out.get("x-kubernetes-preserve-unknown-fields"):
        out["additionalProperties"] = False
    return out


def crd_validator(api_version: str, kind: str) -> jsonschema.Draft7Validator:
    return jsonschema.Draft7Validator(strict(yaml.safe_load(CRD_SCHEMAS[api_version, kind].read_text())))


@pytest.mark.parametrize("overlay", ["autoscale", "all"])
def test_custom_resources_match_their_published_schemas(renders, overlay):
    custom = [o for o in renders[overlay].objects if (o["apiVersion"], o["kind"]) in CRD_SCHEMAS]
    assert custom
    for o in custom:
        crd_validator(o["apiVersion"], o["kind"]).validate(o)


@pytest.mark.parametrize("change, error", [
    (lambda so: so["spec"]["triggers"][0].pop("type"), "'type' is a required property"),
    (lambda so: so["spec"]["triggers"][0]["metadata"].update(threshold=16), "16 is not of type 'string'"),
    (lambda so: so["spec"].update(coolDownPeriod=300), "'coolDownPeriod' was unexpected")],
    ids=["a trigger without its type", "a number in metadata", "a misspelt field"])
def test_the_keda_schema_refuses_a_broken_scaled_object(renders, change, error):
    scaled = copy.deepcopy(renders["autoscale"].one("ScaledObject", "pagedserve-worker"))
    change(scaled)
    with pytest.raises(jsonschema.ValidationError, match=error):
        crd_validator("keda.sh/v1alpha1", "ScaledObject").validate(scaled)


# -- the CLI: variables, values, commands, images -------------------------------------------------------------------
@OVERLAYS
def test_every_pagedserve_variable_is_a_flag_of_the_command_it_reaches(renders, overlay):
    for c in containers(renders[overlay], overlay):
        variables = {n for n in manifest_variables(renders[overlay], c.spec) if n.startswith(PREFIX)}
        referenced = set(re.findall(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", " ".join(c.spec["command"])))
        assert variables - flag_variables(command_parser(c.argv)) - referenced == set(), c.name
        # NOTE: nor any other name (a misspelt PAGEDSERVE_ one would be ignored without a word)
        assert not [n for n in manifest_variables(renders[overlay], c.spec) if not n.startswith(PREFIX)], c.name
        c.args()  # and every value parses (a bad one is a usage error naming the variable)


@OVERLAYS
def test_image_and_command_per_overlay(renders, overlay):
    render = renders[overlay]
    commands = {(c.deployment["metadata"]["name"], c.spec["name"]): c.argv[:3] for c in containers(render, overlay)}
    assert commands == {("pagedserve-scheduler", "model-pull"): ["pagedserve", "model", "pull"],
                        ("pagedserve-scheduler", "scheduler"): ["pagedserve", "scheduler"],
                        ("pagedserve-worker", "model-pull"): ["pagedserve", "model", "pull"],
                        ("pagedserve-worker", "worker"): ["pagedserve", "worker"]}
    tag = IMAGE_TAGS[overlay]
    assert {c.spec["image"] for c in containers(render, overlay)} == {f"pagedserve:{tag}"}
    assert re.search(rf"^FROM \S+ AS {'gpu' if tag == 'gpu' else 'cpu'}$", (ROOT / "Dockerfile").read_text(), re.M)
    worker = main_container(render, overlay, "pagedserve-worker")
    gpus = {kind: worker.spec["resources"][kind].get("nvidia.com/gpu") for kind in ("requests", "limits")}
    assert (worker.args().device, gpus) == (("cuda", {"requests": 1, "limits": 1}) if tag == "gpu" else
                                            ("cpu", {"requests": None, "limits": None}))
    if tag != "gpu":  # NOTE: the compute threads a CPU worker runs are its CPU limit
        assert worker.args().threads == cpu_cores(worker.spec["resources"]["limits"]["cpu"])


@OVERLAYS
def test_each_pod_pulls_the_model_its_server_loads(renders, overlay):
    for name in ("pagedserve-scheduler", "pagedserve-worker"):
        cs = [c for c in containers(renders[overlay], overlay) if c.deployment["metadata"]["name"] == name]
        pulls, [main] = [c.args() for c in cs if c.init], [c.args() for c in cs if not c.init]
        assert [(p.name, p.revision) for p in pulls] == [(main.model, main.revision)], name
        # into the one cache they all read ($PAGEDSERVE_CACHE in the image)
        caches = [c.mounted_from(IMAGE_ENV["PAGEDSERVE_CACHE"]) for c in cs]
        assert [v["persistentVolumeClaim"]["claimName"] for v in caches] == ["pagedserve-model-cache"] * len(cs)


# -- ports, Services, probes -----------------------------------------------------------------------------------------
@OVERLAYS
def test_ports_agree_between_the_scheduler_its_services_and_its_workers(renders, overlay):
    render = renders[overlay]
    scheduler = main_container(render, overlay, "pagedserve-scheduler")
    args = scheduler.args()
    ports = {p["name"]: p["containerPort"] for p in scheduler.spec["ports"]}
    assert ports == {name: host_port(getattr(args, flag))[1] for name, flag in LISTENERS.items()}
    assert {host_port(getattr(args, flag))[0] for flag in LISTENERS.values()} == {"0.0.0.0"}
    labels = scheduler.deployment["spec"]["template"]["metadata"]["labels"]
    services = {s["metadata"]["name"]: s for s in render.of_kind("Service")}
    assert {name: {p["targetPort"] for p in s["spec"]["ports"]} for name, s in services.items()} == SERVICES
    for s in services.values():
        assert s["spec"]["selector"].items() <= labels.items()
        assert all(p["port"] == ports[p["targetPort"]] for p in s["spec"]["ports"]), s["metadata"]["name"]
    for d in render.of_kind("Deployment"):  # a Service selects the scheduler's pods only
        if d is not scheduler.deployment:
            pod_labels = d["spec"]["template"]["metadata"]["labels"]
            assert not any(s["spec"]["selector"].items() <= pod_labels.items() for s in services.values())
    annotations = services["pagedserve-metrics"]["metadata"]["annotations"]
    assert (annotations["prometheus.io/port"], annotations["prometheus.io/path"]) == (str(ports["metrics"]), "/metrics")
    worker = main_container(render, overlay, "pagedserve-worker")
    assert worker.args().scheduler == f"pagedserve-workers:{ports['worker']}"


@OVERLAYS
def test_probes_ask_the_right_service_on_the_right_port(renders, overlay):
    render = renders[overlay]
    scheduler = main_container(render, overlay, "pagedserve-scheduler")
    args = scheduler.args()
    listen_port = host_port(args.listen)[1]
    asked = {}
    for kind, probe in probes(scheduler.spec).items():
        if "grpc" in probe:  # NOTE: Kubernetes' gRPC probe speaks plaintext only
            assert args.tls_cert is None, f"{scheduler.name}: a gRPC {kind} on a TLS port"
            assert probe["grpc"]["port"] == listen_port
            asked[kind] = probe["grpc"].get("service", "")
        else:
            health = parse(probe_argv(probe), scheduler.env)
            assert health.func.__module__ == "pagedserve_cli.health_cmd"
            assert health.server == f"127.0.0.1:{listen_port}" and health.worker is None
            assert health.tls_ca == args.tls_ca  # the scheduler's CA signed its own certificate too
            asked[kind] = health.service
    # alive with no worker and while draining; ready (in the Services) with a worker and not draining
    assert asked == {"startupProbe": LIVENESS, "livenessProbe": LIVENESS, "readinessProbe": ""}

    worker = main_container(render, overlay, "pagedserve-worker")
    # NOTE: no liveness or startup probe: any probe of a worker asks the scheduler (see worker.yaml)
    assert list(probes(worker.spec)) == ["readinessProbe"]
    health = parse(probe_argv(worker.spec["readinessProbe"]), worker.env)
    assert health.func.__module__ == "pagedserve_cli.health_cmd"
    grpc_port = next(p["port"] for p in render.one("Service", "pagedserve")["spec"]["ports"] if p["name"] == "grpc")
    assert (health.server, health.worker) == (f"pagedserve:{grpc_port}", HOST)
    assert bool(health.tls_ca) == bool(args.tls_cert)  # TLS to a TLS scheduler, with a CA in the worker's pod
    if args.api_key_file:  # --worker asks GetModelInfo, which then needs a key
        assert health.api_key_file or health.api_key


@OVERLAYS
def test_every_key_and_certificate_a_command_reads_comes_from_a_secret(renders, overlay):
    for c in containers(renders[overlay], overlay):
        commands = [c.args()] + [parse(probe_argv(p), c.env) for p in probes(c.spec).values() if "exec" in p]
        for parsed in commands:
            for flag in FILE_FLAGS:
                if getattr(parsed, flag, None):
                    assert "secret" in c.mounted_from(getattr(parsed, flag)), f"{c.name}: --{flag} not from a Secret"


@OVERLAYS
def test_worker_tls_is_mutual_when_the_scheduler_serves_tls(renders, overlay):
    scheduler = main_container(renders[overlay], overlay, "pagedserve-scheduler").args()
    worker = main_container(renders[overlay], overlay, "pagedserve-worker").args()
    if scheduler.tls_cert:
        assert scheduler.tls_ca and scheduler.api_key_file
        assert worker.tls_ca and worker.tls_cert and worker.tls_key
    else:
        assert (worker.tls_ca, worker.tls_cert) == (None, None)
    assert scheduler.worker_token_file and worker.worker_token_file  # a token on top of mutual TLS


@OVERLAYS
def test_grace_periods_exceed_the_drain_timeout(renders, overlay):
    # NOTE: the scheduler's drain, and a leaving worker's wait (the scheduler lets its requests finish as long)
    drain = main_container(renders[overlay], overlay, "pagedserve-scheduler").args().drain_timeout
    for d in renders[overlay].of_kind("Deployment"):
        grace = d["spec"]["template"]["spec"]["terminationGracePeriodSeconds"]
        assert grace >= drain + AFTER_DRAIN_S, d["metadata"]["name"]


@OVERLAYS
def test_workers_roll_without_losing_capacity_and_are_evicted_one_at_a_time(renders, overlay):
    render = renders[overlay]
    worker = render.one("Deployment", "pagedserve-worker")
    assert worker["spec"]["strategy"]["rollingUpdate"] == {"maxSurge": 1, "maxUnavailable": 0}
    assert render.one("Deployment", "pagedserve-scheduler")["spec"]["strategy"] == {"type": "Recreate"}
    [budget] = render.of_kind("PodDisruptionBudget")
    assert budget["spec"]["selector"] == worker["spec"]["selector"] and budget["spec"]["maxUnavailable"] == 1


@OVERLAYS
def test_worker_pods_are_guaranteed_whole_cores(renders, overlay):
    # NOTE: every container's requests = its limits (init containers included), or the pod is Burstable
    for c in containers(renders[overlay], overlay):
        if c.deployment["metadata"]["name"] == "pagedserve-worker":
            requests, limits = c.spec["resources"]["requests"], c.spec["resources"]["limits"]
            assert requests == limits and cpu_cores(limits["cpu"]).is_integer(), c.name


# -- NetworkPolicy and security --------------------------------------------------------------------------------------
@OVERLAYS
def test_network_policy_admits_labelled_clients_workers_and_monitoring_each_to_its_port(renders, overlay):
    render = renders[overlay]
    scheduler = main_container(render, overlay, "pagedserve-scheduler")
    worker_pod = render.one("Deployment", "pagedserve-worker")["spec"]["template"]["metadata"]["labels"]
    scheduler_pod = scheduler.deployment["spec"]["template"]["metadata"]["labels"]

    def policies_of(labels: dict) -> list[dict]:
        return [p for p in render.of_kind("NetworkPolicy")
                if p["spec"]["podSelector"]["matchLabels"].items() <= labels.items()]
    [policy] = policies_of(scheduler_pod)
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    numbers = {p["name"]: p["containerPort"] for p in scheduler.spec["ports"]}
    sources = {}  # port name -> the `from` of every rule naming it (tests/deploy/test_network_policy.py: the union)
    for rule in policy["spec"]["ingress"]:
        for port in rule["ports"]:
            name = next(n for n, number in numbers.items() if port["port"] in (n, number))
            sources.setdefault(name, []).append(rule["from"])
    clients = [{"podSelector": {"matchLabels": {"pagedserve-client": "true"}}}]
    worker_only = [{"podSelector": {"matchLabels": {"app.kubernetes.io/name": "pagedserve-worker"}}}]
    # NOTE: a worker's readiness probe asks the client API (pagedserve health --worker): workers reach 50051 too
    assert sources == {"grpc": [clients, worker_only], "http": [clients], "worker": [worker_only], "metrics": [
        [{"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "monitoring"}}}]]}
    peer = worker_only[0]["podSelector"]["matchLabels"]
    assert peer.items() <= worker_pod.items() and not peer.items() <= scheduler_pod.items()
    [closed] = policies_of(worker_pod)  # a worker listens on nothing: nothing reaches it
    assert (closed["spec"]["policyTypes"], closed["spec"]["ingress"]) == (["Ingress"], [])


@OVERLAYS
def test_every_container_runs_locked_down(renders, overlay):
    uid = int(re.search(r"useradd .*--uid (\d+)", (ROOT / "Dockerfile").read_text()).group(1))
    writable = {"/tmp", "/home/pagedserve", IMAGE_ENV["PAGEDSERVE_CACHE"]}  # /tmp, HOME, the cache
    for c in containers(renders[overlay], overlay):
        pod = c.pod
        assert pod["automountServiceAccountToken"] is False and pod["enableServiceLinks"] is False, c.name
        assert not any(pod.get(k) for k in ("hostNetwork", "hostPID", "hostIPC")), c.name
        assert pod["securityContext"] == {"runAsNonRoot": True, "runAsUser": uid, "runAsGroup": uid, "fsGroup": uid,
                                          "seccompProfile": {"type": "RuntimeDefault"}}, c.name
        assert c.spec["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                             "capabilities": {"drop": ["ALL"]}}, c.name
        mounts = {m["mountPath"]: m for m in c.spec["volumeMounts"]}
        assert all(path in mounts and not mounts[path].get("readOnly") for path in writable), c.name
        assert all(m.get("readOnly") for path, m in mounts.items() if path not in writable), c.name


# -- autoscale -------------------------------------------------------------------------------------------------------
@OVERLAYS
def test_autoscale_scales_the_worker_deployment_on_the_queue(renders, overlay):
    render = renders[overlay]
    scaled = render.of_kind("ScaledObject")
    worker = render.one("Deployment", "pagedserve-worker")
    if overlay not in ("autoscale", "all"):
        assert (scaled, worker["spec"]["replicas"]) == ([], 1)
        return
    [so] = scaled
    assert so["spec"]["scaleTargetRef"] == {"apiVersion": "apps/v1", "kind": "Deployment",
                                            "name": worker["metadata"]["name"]}
    assert "replicas" not in worker["spec"]  # NOTE: or each `kubectl apply` resets what the autoscaler set
    assert 1 <= so["spec"]["minReplicaCount"] <= so["spec"]["maxReplicaCount"]
    [trigger] = so["spec"]["triggers"]
    assert trigger["type"] == "prometheus" and float(trigger["metadata"]["threshold"]) > 0
    # the metrics helper's Prometheus test runs this query against a real Prometheus
    assert "sum(vllm:num_requests_waiting)" in trigger["metadata"]["query"]
