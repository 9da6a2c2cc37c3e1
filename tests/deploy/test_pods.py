"""tests/kubernetes/podspec.py: what the Docker run of the manifests takes from a pod spec, as the kubelet reads it
($(VAR) expansion, env precedence, Secret file modes, Service names, users and capabilities, probe defaults)."""

import pathlib

import pytest

from tests.kubernetes.pods import OFFLINE_VOLUME, without_offline
from tests.kubernetes.isolation import pod_volumes, projected_files, security_args
from tests.kubernetes.podspec import (Cluster, Pod, Probe, Unsupported, command_line, container_env,
                                      container_probes, expand, parse, render, service_aliases, service_ports)

ROOT = pathlib.Path(__file__).resolve().parents[2]
VARS = {"A": "1", "B": "two", "EMPTY": ""}


@pytest.fixture(scope="module")
def cpu() -> Cluster:
    return Cluster(render(str(ROOT / "deploy/kubernetes/overlays/cpu")),
                   {"pagedserve-worker-token": {"worker-token": b"token\n"}})


def pod_of(cluster: Cluster, deployment: str) -> Pod:
    return Pod.of(cluster.get("Deployment", deployment), "abcde")


@pytest.mark.parametrize("text, expanded", [
    ("$(A)", "1"),
    ("x$(A)y$(B)z", "x1ytwoz"),
    ("$(EMPTY)|", "|"),
    ("$(UNKNOWN)", "$(UNKNOWN)"),       # an undefined name stays as written
    ("$$(A)", "$(A)"),                  # $$ escapes: the reference is not expanded
    ("$$$(A)", "$1"),
    ("a$$b", "a$b"),
    ("$A ${A}", "$A ${A}"),             # shell syntax is not Kubernetes syntax
    ("$(A", "$(A"),                     # unclosed
    ("cost: 5$", "cost: 5$"),           # a trailing $
    ("$()", "$()"),
])
def test_var_references_expand_as_the_kubelet_does(text, expanded):
    assert expand(text, VARS.get) == expanded


def test_env_from_then_env_in_order_each_value_expanded_over_what_precedes_it():
    cluster = Cluster(parse("""
kind: ConfigMap
metadata: {name: cfg, namespace: ns}
data: {MODEL: m1, PORT: "1"}
"""))
    pod = Pod("p-x-abcde", "ns", "p", {}, {}, {"enableServiceLinks": False})
    container = {"name": "c", "envFrom": [{"configMapRef": {"name": "cfg"}}, {"prefix": "X_",
                                                                             "configMapRef": {"name": "cfg"}}],
                 "env": [{"name": "PORT", "value": "2"},               # env overrides envFrom
                         {"name": "ADDR", "value": "h:$(PORT)/$(LATER)"},  # LATER is defined after: kept literal
                         {"name": "LATER", "value": "l"},
                         {"name": "ME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}}],
                 "command": ["run", "$(MODEL)", "$(X_MODEL)", "$(LATER)", "$$(MODEL)"]}
    env = container_env(pod, container, cluster)
    assert {k: env[k] for k in ("MODEL", "PORT", "X_MODEL", "X_PORT", "ADDR", "LATER", "ME")} == {
        "MODEL": "m1", "PORT": "2", "X_MODEL": "m1", "X_PORT": "1", "ADDR": "h:2/$(LATER)", "LATER": "l",
        "ME": "p-x-abcde"}
    assert env["KUBERNETES_SERVICE_PORT"] == "443"  # the kubelet's `kubernetes` Service variables, always there
    assert command_line(container, env) == (["run", "m1", "m1", "l", "$(MODEL)"], None)


def test_resource_field_refs_round_up_in_units_of_the_divisor():
    pod = Pod("p-x-abcde", "ns", "p", {}, {}, {"enableServiceLinks": False, "containers": [
        {"name": "w", "resources": {"limits": {"cpu": "1500m", "memory": "4Gi"}}}]})
    container = {"name": "c", "env": [
        {"name": "THREADS", "valueFrom": {"resourceFieldRef": {"containerName": "w", "resource": "limits.cpu"}}},
        {"name": "MIB", "valueFrom": {"resourceFieldRef": {"containerName": "w", "resource": "limits.memory",
                                                           "divisor": "1Mi"}}}]}
    env = container_env(pod, container, Cluster([]))
    assert (env["THREADS"], env["MIB"]) == ("2", "4096")


def test_service_links_on_are_refused_not_ignored():
    pod = Pod("p-x-abcde", "ns", "p", {}, {}, {})
    with pytest.raises(Unsupported, match="enableServiceLinks"):
        container_env(pod, {"name": "c"}, Cluster([]))


def test_the_model_pull_init_container_pulls_the_configmaps_model(cpu):
    for deployment in ("pagedserve-scheduler", "pagedserve-worker"):
        pod = pod_of(cpu, deployment)
        init = next(c for c in pod.spec["initContainers"] if c["name"] == "model-pull")
        model = cpu.config_map("pagedserve-config")["PAGEDSERVE_MODEL"]
        assert command_line(init, container_env(pod, init, cpu)) == (["pagedserve", "model", "pull", model], None)


@pytest.mark.parametrize("source, fs_group, modes", [
    ({"defaultMode": 0o400}, 1000, {"worker-token": 0o440}),   # fsGroup adds group read: the pod's user reads it
    ({"defaultMode": 0o400}, None, {"worker-token": 0o400}),   # without, only root could
    ({}, None, {"worker-token": 0o644}),                       # the API's default mode
    ({"defaultMode": 0o400, "items": [{"key": "worker-token", "path": "t", "mode": 0o600}]}, 1000, {"t": 0o640}),
])
def test_secret_files_get_the_default_mode_widened_by_fs_group(source, fs_group, modes):
    files = projected_files({"worker-token": b"x", "other": b"y"} if "items" in source else {"worker-token": b"x"},
                            source, fs_group)
    assert {f.path: f.mode for f in files} == modes


def test_the_pods_worker_token_is_readable_by_the_pods_user_alone(cpu):
    for deployment in ("pagedserve-scheduler", "pagedserve-worker"):
        volume = pod_volumes(pod_of(cpu, deployment), cpu)["worker-token"]
        assert (volume.kind, volume.read_only) == ("secret", True)
        assert [(f.path, f.data, f.mode) for f in volume.files] == [("worker-token", b"token\n", 0o440)]


def test_service_names_resolve_to_the_pods_their_selectors_match(cpu):
    services = cpu.of_kind("Service")
    scheduler, worker = pod_of(cpu, "pagedserve-scheduler"), pod_of(cpu, "pagedserve-worker")
    names = service_aliases(services, scheduler.labels, "pagedserve")
    assert {n for n in names if "." not in n} == {"pagedserve", "pagedserve-metrics", "pagedserve-workers"}
    assert "pagedserve-workers.pagedserve.svc.cluster.local" in names
    assert service_aliases(services, worker.labels, "pagedserve") == []
    assert sorted(service_ports(services, scheduler)) == [
        ("pagedserve", "grpc", 50051), ("pagedserve", "http", 8000), ("pagedserve-metrics", "metrics", 9464),
        ("pagedserve-workers", "worker", 50052)]


def test_a_service_port_other_than_its_target_is_refused():
    pod = Pod("p-x-abcde", "ns", "p", {"app": "a"}, {}, {"containers": [{"name": "c", "ports": [
        {"name": "grpc", "containerPort": 50051}]}]})
    svc = {"metadata": {"name": "s"}, "spec": {"selector": {"app": "a"}, "ports": [{"port": 80, "targetPort": "grpc"}]}}
    with pytest.raises(Unsupported, match="80 -> 50051"):
        service_ports([svc], pod)
    svc["spec"]["ports"][0]["targetPort"] = "http"
    with pytest.raises(ValueError, match="no container"):
        service_ports([svc], pod)


def test_security_context_becomes_docker_flags(cpu):
    pod = pod_of(cpu, "pagedserve-scheduler")
    args = security_args(pod, pod.spec["containers"][0], "pagedserve")
    assert args == ["--user", "1000:1000", "--group-add", "1000", "--read-only", "--security-opt",
                    "no-new-privileges", "--cap-drop", "ALL"]


def test_run_as_non_root_with_a_named_image_user_is_refused_as_the_kubelet_does():
    pod = Pod("p-x-abcde", "ns", "p", {}, {}, {"securityContext": {"runAsNonRoot": True}})
    with pytest.raises(ValueError, match="runAsNonRoot"):
        security_args(pod, {"name": "c"}, "pagedserve")
    assert security_args(pod, {"name": "c"}, "1000")[:2] == ["--user", "1000"]
    # NOTE: no seccompProfile is the kubelet's Unconfined
    assert security_args(pod, {"name": "c"}, "1000")[-2:] == ["--security-opt", "seccomp=unconfined"]


def test_probes_take_the_api_defaults():
    probe = Probe.of({"grpc": {"port": 50051}}, {})
    assert (probe.kind, probe.port, probe.service, probe.period, probe.timeout, probe.failure_threshold) == (
        "grpc", 50051, "", 10, 1, 3)
    assert Probe.of({"tcpSocket": {"port": "http"}}, {"http": 8000}).port == 8000


def test_the_scheduler_is_probed_on_its_liveness_name_and_ready_through_pagedserve_health(cpu):
    pod = pod_of(cpu, "pagedserve-scheduler")
    probes = container_probes(pod.spec["containers"][0], pod)
    assert (probes["startup"].kind, probes["startup"].service) == ("grpc", "liveness")
    assert (probes["liveness"].kind, probes["liveness"].service) == ("grpc", "liveness")
    assert probes["readiness"].command[:2] == ["pagedserve", "health"]


def test_the_offline_overlay_adds_only_the_wheel_folder():
    base = render(str(ROOT / "deploy/kubernetes/overlays/cpu"))
    offline = render(str(ROOT / "tests/kubernetes/offline"))
    assert offline != base
    assert without_offline(offline) == without_offline(base)
    mounts = [m["name"] for d in offline if d["kind"] == "Deployment"
              for c in d["spec"]["template"]["spec"]["initContainers"] for m in c["volumeMounts"]]
    assert OFFLINE_VOLUME in mounts
    # Anything else it changed would be seen: a variable in a (main) container, a label.
    for change in (lambda d: d["spec"]["template"]["spec"]["containers"][0].setdefault("env", []).append(
                       {"name": "PIP_NO_INDEX", "value": "1"}),
                   lambda d: d["metadata"]["labels"].update(other="label")):
        changed = [dict(d) for d in without_offline(offline)]
        change(next(d for d in changed if d["kind"] == "Deployment"))
        assert without_offline(changed) != without_offline(base)
