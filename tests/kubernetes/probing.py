"""Probes as the kubelet runs them: exec in the container, gRPC health, HTTP or TCP to the pod's IP, with their
periods, timeouts and thresholds."""

from __future__ import annotations

import json
import socket
import subprocess
import time
import urllib.request

from tests.kubernetes.engine import Docker, Failed, container_name, log, side_by_side
from tests.kubernetes.podspec import Pod, Probe, container_probes


class Prober:
    """The kubelet's prober for pods on `docker`."""

    def __init__(self, docker: Docker) -> None:
        self.docker = docker

    def probe(self, pod: Pod, container: str, probe: Probe) -> tuple[bool, str]:
        """One probe as the kubelet runs it: exec in the container, or gRPC/HTTP/TCP to the pod's IP."""
        try:
            if probe.kind == "exec":
                out = subprocess.run([self.docker.binary, "exec", container_name(pod.name, container),
                                      *probe.command], capture_output=True, text=True, timeout=probe.timeout)
                return out.returncode == 0, (out.stdout + out.stderr).strip()
            if probe.kind == "grpc":
                return grpc_health(f"{pod.ip}:{probe.port}", probe.service, probe.timeout)
            if probe.kind == "httpGet":
                with urllib.request.urlopen(f"http://{pod.ip}:{probe.port}{probe.path}", timeout=probe.timeout) as r:
                    return 200 <= r.status < 400, str(r.status)
            with socket.create_connection((pod.ip, probe.port), timeout=probe.timeout):
                return True, "connected"
        except subprocess.TimeoutExpired:
            return False, f"timed out after {probe.timeout} s"
        except OSError as e:
            return False, str(e)

    def running(self, pod: Pod, container: str) -> None:
        name = container_name(pod.name, container)
        state = json.loads(self.docker.inspect(name, "{{json .State}}"))
        if not state["Running"]:
            raise Failed(f"{name} exited ({state['ExitCode']}, OOM killed: {state['OOMKilled']}):\n"
                         f"{self.docker.logs(name)}")

    def until(self, pod: Pod, container: str, kind: str, probe: Probe, deadline: float) -> None:
        """Probe at its period until it passes (successThreshold in a row). A startup or liveness probe fails the
        run at failureThreshold failures in a row (the kubelet would restart the container); readiness at
        `deadline`."""
        started, ok_run, failures, tries, out = time.monotonic(), 0, 0, 0, ""
        time.sleep(probe.initial_delay)
        while True:
            self.running(pod, container)
            ok, out = self.probe(pod, container, probe)
            tries += 1
            ok_run, failures = (ok_run + 1, 0) if ok else (0, failures + 1)
            if ok_run >= (probe.success_threshold if kind == "readiness" else 1):
                log(f"{pod.name}/{container}: {kind} probe ({probe.describe()}) passed after "
                    f"{time.monotonic() - started:.0f} s, {tries} tr{'y' if tries == 1 else 'ies'}")
                return
            if kind != "readiness" and failures >= probe.failure_threshold:
                raise Failed(f"{pod.name}/{container}: {kind} probe ({probe.describe()}) failed {failures} times in "
                             f"a row (the kubelet restarts the container): {out}")
            if time.monotonic() > deadline:
                raise Failed(f"{pod.name}/{container}: not ready after {time.monotonic() - started:.0f} s: {out}")
            time.sleep(probe.period)

    def start_probes(self, pods: list[Pod], timeout: float) -> None:
        """Each container's probes as the kubelet sequences them: startup until it passes, then readiness and
        liveness; every pod must become ready."""
        deadline = time.monotonic() + timeout

        def one(pod: Pod, c: dict) -> None:
            probes = container_probes(c, pod)
            for kind in ("startup", "readiness", "liveness"):
                if kind in probes:
                    self.until(pod, c["name"], kind, probes[kind], deadline)
            if "readiness" not in probes:
                log(f"{pod.name}/{c['name']}: no readiness probe: ready once started")

        side_by_side([("", lambda p=p, c=c: one(p, c)) for p in pods for c in p.spec["containers"]])

    def check_probes(self, pods: list[Pod]) -> None:
        """Every running container still ready and alive: each probe passes within failureThreshold tries."""
        for pod in pods:
            for c in pod.spec["containers"]:
                for kind, probe in container_probes(c, pod).items():
                    if kind == "startup":
                        continue
                    for attempt in range(probe.failure_threshold):
                        self.running(pod, c["name"])
                        ok, out = self.probe(pod, c["name"], probe)
                        if ok:
                            break
                        time.sleep(probe.period)
                    else:
                        raise Failed(f"{pod.name}/{c['name']}: {kind} probe failed {probe.failure_threshold} times: "
                                     f"{out}")
                    log(f"{pod.name}/{c['name']}: still {'ready' if kind == 'readiness' else 'alive'}")

    def probe_draining(self, pod: Pod) -> None:
        time.sleep(0.5)  # NOTE: docker stop has sent SIGTERM by then
        for c in pod.spec["containers"]:
            probes = container_probes(c, pod)
            results = {kind: self.probe(pod, c["name"], probes[kind]) for kind in ("liveness", "readiness")
                       if kind in probes}
            self.running(pod, c["name"])  # NOTE: else the probes ran after the drain, and prove nothing
            if "liveness" in results and not results["liveness"][0]:
                raise Failed(f"{pod.name}/{c['name']}: the liveness probe fails while draining (the kubelet would "
                             f"kill it mid-drain): {results['liveness'][1]}")
            if "readiness" in results and results["readiness"][0]:
                raise Failed(f"{pod.name}/{c['name']}: still ready while draining (its Services keep sending "
                             f"requests): {results['readiness'][1]}")
            log(f"{pod.name}/{c['name']}: while draining, " + ", ".join(
                f"{kind} {'passes' if ok else 'fails'} ({out.splitlines()[-1] if out else ''})"
                for kind, (ok, out) in results.items()))


def grpc_health(target: str, service: str, timeout: float) -> tuple[bool, str]:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with grpc.insecure_channel(target, options=[("grpc.enable_http_proxy", 0)]) as ch:
        try:
            reply = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=service),
                                                         timeout=timeout)
        except grpc.RpcError as e:
            return False, f"{e.code().name}: {e.details()}"
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    return reply.status == health_pb2.HealthCheckResponse.SERVING, status
