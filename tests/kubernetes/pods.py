"""The rendered Deployments' pods on a Docker engine, as a kubelet would run them: a sandbox per pod, init
containers to completion, the containers, then their probes (tests/kubernetes/run.sh calls one step at a time)."""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from tests.kubernetes.engine import LABEL, Docker, Failed, container_name, log, sandbox, side_by_side  # noqa: E402
from tests.kubernetes.isolation import (Volume, container_mounts, fs_group_mode, pod_volumes,  # noqa: E402
                                        resource_args, security_args)
from tests.kubernetes.podspec import (Cluster, Pod, Unsupported, command_line, container_env, parse,  # noqa: E402
                                      selects, service_aliases, service_ports)
from tests.kubernetes.probing import Prober  # noqa: E402

POD_NAME_CHARS = "bcdfghjklmnpqrstvwxz2456789"  # the alphabet of a ReplicaSet's pod name suffix
CONTAINER_FIELDS = {"name", "image", "imagePullPolicy", "command", "args", "env", "envFrom", "ports", "volumeMounts",
                    "securityContext", "resources", "startupProbe", "readinessProbe", "livenessProbe", "lifecycle",
                    "workingDir", "terminationMessagePath", "terminationMessagePolicy"}
# NOTE: where a pod is placed and which account it runs as mean nothing on one Docker host: accepted, not emulated.
SCHEDULING_FIELDS = {"nodeSelector", "affinity", "tolerations", "topologySpreadConstraints", "priorityClassName",
                     "serviceAccountName", "dnsPolicy"}
POD_FIELDS = {"containers", "initContainers", "volumes", "securityContext", "terminationGracePeriodSeconds",
              "automountServiceAccountToken", "enableServiceLinks", "restartPolicy", *SCHEDULING_FIELDS}
# What tests/kubernetes/offline adds to the cpu overlay (CI's containers reach no package index): nothing else.
OFFLINE_ENV = {"PIP_NO_INDEX", "PIP_FIND_LINKS"}
OFFLINE_VOLUME = "model-wheels"


class Kubelet:
    """Pods of one rendered overlay on one Docker engine; state (the Secrets made out of band) under `state`."""

    def __init__(self, manifests: str, state: str, docker: str) -> None:
        self.cluster = Cluster(parse(Path(manifests).read_text()))
        self.ns = self.cluster.namespace
        self.network = f"k8srun-{self.ns}"
        self.state = Path(state)
        self.docker = Docker(docker)
        self.prober = Prober(self.docker)
        self.users: dict[str, str] = {}
        secrets = self.state / "secrets"
        for d in sorted(secrets.iterdir()) if secrets.is_dir() else []:
            self.cluster.secrets[d.name] = {f.name: f.read_bytes() for f in d.iterdir()}

    # ---- pods ----------------------------------------------------------------------------------------------------

    def pods(self, deployment: str | None = None) -> list[Pod]:
        """The running pods (of `deployment`), oldest first."""
        filters = [f"label={LABEL}={self.ns}", f"label={LABEL}.role=sandbox"]
        if deployment:
            filters.append(f"label={LABEL}.deployment={deployment}")
        out = []
        for name in self.docker.names(*filters):
            labels = json.loads(self.docker.inspect(name, "{{json .Config.Labels}}"))
            pod = Pod.of(self.cluster.get("Deployment", labels[f"{LABEL}.deployment"]),
                         labels[f"{LABEL}.pod"].rpartition("-")[2])
            if pod.name != labels[f"{LABEL}.pod"]:
                raise Failed(f"{labels[f'{LABEL}.pod']} runs another template than the manifests' {pod.name}")
            pod.ip = self.ip(pod.name)
            out.append((int(labels[f"{LABEL}.created"]), pod))
        return [p for _, p in sorted(out, key=lambda t: t[0])]

    def ip(self, pod: str) -> str:
        network = f'(index .NetworkSettings.Networks "{self.network}")'
        return self.docker.inspect(sandbox(pod), f"{{{{{network}.IPAddress}}}}")

    def labels(self, pod: Pod, role: str, container: str) -> list[str]:
        pairs = {LABEL: self.ns, f"{LABEL}.pod": pod.name, f"{LABEL}.deployment": pod.deployment,
                 f"{LABEL}.role": role, f"{LABEL}.container": container, f"{LABEL}.created": str(time.time_ns())}
        return [a for k, v in pairs.items() for a in ("--label", f"{k}={v}")]

    def image_user(self, image: str) -> str:
        if image not in self.users:
            if not self.docker("image", "ls", "--quiet", image):
                raise Failed(f"image {image} is not on this engine (nothing is pulled: tag the built image as it)")
            self.users[image] = self.docker.inspect(image, "{{.Config.User}}")
        return self.users[image]

    def create(self, deployment: dict) -> Pod:
        """A pod of `deployment`: its sandbox (hostname, network, the Services' names), volumes, init containers
        run to completion in order, then its containers started."""
        suffix = "".join(random.choices(POD_NAME_CHARS, k=5))
        pod = Pod.of(deployment, suffix)
        check_fields(pod)
        services = self.cluster.of_kind("Service")
        volumes = pod_volumes(pod, self.cluster)
        self.prepare_volumes(pod, volumes)
        aliases = service_aliases(services, pod.labels, self.ns)
        ports = service_ports(services, pod)
        image = pod.spec["containers"][0]["image"]
        self.image_user(image)
        # NOTE: the sandbox holds the pod's network and IPC namespaces and its hostname (the pod's name), as the
        # pause container does; the published ports stand for `kubectl port-forward service/...`.
        self.docker("run", "--detach", "--name", sandbox(pod.name), "--hostname", pod.name, "--network", self.network,
                    *[a for n in aliases for a in ("--network-alias", n)],
                    *[a for p in sorted({p for _, _, p in ports}) for a in ("--publish", f"127.0.0.1::{p}")],
                    "--ipc", "shareable", "--read-only", "--cap-drop", "ALL", "--security-opt", "no-new-privileges",
                    "--user", "65535:65535", "--pull", "never", *self.labels(pod, "sandbox", "POD"),
                    "--entrypoint", "sleep", image, "infinity")
        pod.ip = self.ip(pod.name)
        log(f"pod {pod.name}: ip {pod.ip}, Service names {', '.join(a for a in aliases if '.' not in a) or 'none'}")
        for c in pod.spec.get("initContainers", []):
            started = time.monotonic()
            out = subprocess.run([self.docker.binary, "run", *self.container_args(pod, c, volumes, "init")],
                                 capture_output=True, text=True)
            if out.returncode != 0:
                raise Failed(f"{pod.name}: init container {c['name']} exited {out.returncode}:\n"
                             f"{(out.stdout + out.stderr)[-3000:]}")
            self.docker("rm", container_name(pod.name, c["name"]))
            log(f"pod {pod.name}: init container {c['name']} completed in {time.monotonic() - started:.0f} s")
        for c in pod.spec["containers"]:
            self.docker("run", "--detach", *self.container_args(pod, c, volumes, "main"))
        log(f"pod {pod.name}: started {', '.join(c['name'] for c in pod.spec['containers'])}")
        return pod

    def container_args(self, pod: Pod, c: dict, volumes: dict[str, Volume], role: str) -> list[str]:
        """`docker run` arguments for container `c` of `pod`: exactly its image, command, args, env, mounts, user
        and capabilities, in the pod's namespaces."""
        env = container_env(pod, c, self.cluster)
        command, args = command_line(c, env)
        mounts = []
        for m in container_mounts(c, volumes):
            v = volumes[m.volume]
            if v.kind in ("secret", "configMap", "hostPath"):
                src = v.source if v.kind == "hostPath" else str(self.volume_dir(pod, v))
                spec = f"type=bind,source={src},target={m.target}"
            else:
                spec = f"type=volume,source={self.volume_name(pod, v)},target={m.target},volume-nocopy"
            mounts += ["--mount", spec + (",readonly" if m.read_only else "")]
        positional = [*(command[1:] if command else []), *(args or [])]
        return ["--name", container_name(pod.name, c["name"]), "--network", f"container:{sandbox(pod.name)}",
                "--ipc", f"container:{sandbox(pod.name)}", "--pull", "never", "--stop-timeout", str(pod.grace_seconds),
                *self.labels(pod, role, c["name"]), *security_args(pod, c, self.image_user(c["image"])),
                *resource_args(c), *mounts, *[a for k, v in env.items() for a in ("--env", f"{k}={v}")],
                *(["--workdir", c["workingDir"]] if "workingDir" in c else []),
                *(["--entrypoint", command[0]] if command else []), c["image"], *positional]

    # ---- volumes -------------------------------------------------------------------------------------------------

    def volume_name(self, pod: Pod, v: Volume) -> str:
        return f"k8srun-{self.ns}-{v.source}" if v.kind == "pvc" else f"k8srun-{pod.name}-{v.name}"

    def volume_dir(self, pod: Pod, v: Volume) -> Path:
        return self.state / "volumes" / pod.name / v.name

    def bind_claim(self, claim: str, directory: str) -> None:
        """A PersistentVolume for `claim` made in advance: the host directory `directory` (as a hostPath PV)."""
        name = f"k8srun-{self.ns}-{claim}"
        if not self.docker.names(f"name=^{name}$", volumes=True):
            self.docker("volume", "create", "--label", f"{LABEL}={self.ns}", "--label", f"{LABEL}.static=1",
                        "--opt", "type=none", "--opt", "o=bind", "--opt", f"device={os.path.abspath(directory)}", name)

    def prepare_volumes(self, pod: Pod, volumes: dict[str, Volume]) -> None:
        """Volumes as the kubelet hands them over: a new claim's volume (root 0755) and an emptyDir (0777) given to
        the fsGroup (group-owned, setgid, group rw); Secret and ConfigMap files written with their modes, behind
        the ..data symlink the kubelet's atomic writer makes."""
        fs_group = (pod.spec.get("securityContext") or {}).get("fsGroup")
        mounts, commands = [], []
        for v in volumes.values():
            if v.kind in ("secret", "configMap"):
                self.write_files(pod, v, fs_group)
                continue
            if v.kind == "hostPath":
                continue
            name = self.volume_name(pod, v)
            if self.docker.names(f"name=^{name}$", volumes=True):
                if self.docker.inspect(name, f'{{{{index .Labels "{LABEL}.static"}}}}') == "1":
                    continue  # NOTE: a hostPath PV: the kubelet leaves its ownership alone
            else:
                owner = ["--label", f"{LABEL}.pod={pod.name}"] if v.kind == "emptyDir" else []
                tmpfs = ["--opt", "type=tmpfs", "--opt", "device=tmpfs",
                         "--opt", f"o=size={v.size_limit}" if v.size_limit else "o=mode=0777"] if v.memory else []
                self.docker("volume", "create", "--label", f"{LABEL}={self.ns}", *owner, *tmpfs, name)
            target = f"/v/{v.name}"
            mounts += ["--mount", f"type=volume,source={name},target={target},volume-nocopy"]
            if v.kind == "emptyDir":
                commands.append(f"chmod 0777 {target}")
            if fs_group is not None:
                files, dirs = ("ug+r", "ug+rx,g+s") if v.read_only else ("ug+rw", "ug+rwx,g+s")
                commands.append(f"find {target} -exec chgrp {fs_group} {{}} + && find {target} -type d -exec chmod "
                                f"{dirs} {{}} + && find {target} -type f -exec chmod {files} {{}} +")
        if commands:
            self.docker("run", "--rm", "--user", "0", "--network", "none", "--pull", "never", *mounts,
                        "--entrypoint", "sh", pod.spec["containers"][0]["image"], "-c", " && ".join(commands))

    def write_files(self, pod: Pod, v: Volume, fs_group: int | None) -> None:
        root = self.volume_dir(pod, v)
        shutil.rmtree(root, ignore_errors=True)
        stamp = time.strftime("..%Y_%m_%d_%H_%M_%S.", time.gmtime()) + str(time.time_ns() % 10**9)
        (root / stamp).mkdir(parents=True)
        group = fs_group if fs_group is not None else 0
        for f in v.files:
            path = root / stamp / f.path
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_bytes(f.data)
            os.chown(path, 0, group)
            path.chmod(f.mode)
        (root / "..data").symlink_to(stamp)
        for top in sorted({f.path.split("/")[0] for f in v.files}):
            (root / top).symlink_to(f"..data/{top}")
        for d, mode in ((root / stamp, 0o755), (root, 0o1777)):  # NOTE: the volume is a tmpfs of mode 1777
            os.chown(d, 0, group)
            d.chmod(fs_group_mode(mode, True, is_dir=True) if fs_group is not None else mode)

    # ---- steps ---------------------------------------------------------------------------------------------------

    def up(self, timeout: float) -> None:
        if not self.docker("network", "ls", "--quiet", "--filter", f"name=^{self.network}$"):
            self.docker("network", "create", "--label", f"{LABEL}={self.ns}", self.network)
        deployments = self.cluster.of_kind("Deployment")
        self.scale_all([(d, int(d["spec"].get("replicas", 1))) for d in deployments], timeout)

    def scale_all(self, wanted: list[tuple[dict, int]], timeout: float) -> None:
        """Pods created side by side (as the ReplicaSets do it), then probed."""
        created = side_by_side([(d["metadata"]["name"], lambda d=d: self.create(d)) for d, n in wanted
                                for _ in range(n - len(self.pods(d["metadata"]["name"])))])
        self.prober.start_probes(created, timeout)

    def scale(self, deployment: str, replicas: int, timeout: float) -> None:
        pods = self.pods(deployment)
        if replicas >= len(pods):
            self.scale_all([(self.cluster.get("Deployment", deployment), replicas)], timeout)
        for pod in reversed(pods[replicas:]):  # NOTE: as a ReplicaSet scales down: the newest pods first
            self.stop(pod, drain_probes=False)
        log(f"{deployment}: {len(self.pods(deployment))} pod(s): {', '.join(p.name for p in self.pods(deployment))}")

    def stop(self, pod: Pod, drain_probes: bool) -> None:
        """The kubelet deleting a pod: preStop hooks, SIGTERM to every container, SIGKILL after
        terminationGracePeriodSeconds (which must not be needed). With `drain_probes`: while the pod drains, its
        liveness probe still passes and its readiness probe fails (the Services stop sending it requests)."""
        grace = pod.grace_seconds
        started = time.monotonic()
        for c in pod.spec["containers"]:
            pre_stop = ((c.get("lifecycle") or {}).get("preStop")) or {}
            if "exec" in pre_stop:
                self.docker("exec", container_name(pod.name, c["name"]), *pre_stop["exec"]["command"], timeout=grace)
            elif "sleep" in pre_stop:
                time.sleep(int(pre_stop["sleep"]["seconds"]))
            elif pre_stop:
                raise Unsupported(f"{c['name']}: preStop {pre_stop}")
        names = [container_name(pod.name, c["name"]) for c in pod.spec["containers"]]
        left = max(1, int(grace - (time.monotonic() - started)))
        stops = [subprocess.Popen([self.docker.binary, "stop", "--time", str(left), n], stdout=subprocess.DEVNULL)
                 for n in names]
        if drain_probes:
            self.prober.probe_draining(pod)
        for s in stops:
            s.wait()
        took = time.monotonic() - started
        for n in names:
            code = int(self.docker.inspect(n, "{{.State.ExitCode}}"))
            if code != 0:
                raise Failed(f"{n} exited {code} after {took:.0f} s (137: killed at the end of the {grace} s grace "
                             f"period):\n{self.docker.logs(n)}")
        log(f"pod {pod.name}: every container exited 0 within {took:.0f} s of the {grace} s grace period")
        self.delete(pod)

    def remove(self, label: str) -> None:
        """Removes the containers, then the volumes, that carry `label` (KEY=VALUE)."""
        names = self.docker.names(f"label={label}")
        if names:
            self.docker("rm", "--force", *names)
        volumes = self.docker.names(f"label={label}", volumes=True)
        if volumes:
            self.docker("volume", "rm", *volumes)

    def delete(self, pod: Pod) -> None:
        self.remove(f"{LABEL}.pod={pod.name}")
        shutil.rmtree(self.state / "volumes" / pod.name, ignore_errors=True)

    def down(self) -> None:
        self.remove(f"{LABEL}={self.ns}")
        if self.docker("network", "ls", "--quiet", "--filter", f"name=^{self.network}$"):
            self.docker("network", "rm", self.network)
        shutil.rmtree(self.state / "volumes", ignore_errors=True)

    def port(self, service: str, port_name: str) -> str:
        """HOST:PORT on this machine of a Service's port (as `kubectl port-forward service/NAME` gives it)."""
        svc = self.cluster.get("Service", service)
        for pod in self.pods():
            if selects(svc, pod.labels):
                for name, pname, target in service_ports([svc], pod):
                    if pname == port_name:
                        return self.docker("port", sandbox(pod.name), f"{target}/tcp").splitlines()[0]
        raise Failed(f"no running pod behind Service {service} port {port_name}")


def check_fields(pod: Pod) -> None:
    """Every field of the pod spec is one this emulation carries out (or, for placement, knowingly leaves out)."""
    extra = set(pod.spec) - POD_FIELDS
    if extra:
        raise Unsupported(f"{pod.deployment}: pod spec fields {sorted(extra)}")
    if pod.spec.get("automountServiceAccountToken", True) is not False:
        raise Unsupported(f"{pod.deployment}: automountServiceAccountToken is not false (no API server here to "
                          f"issue the token)")
    if pod.spec.get("restartPolicy", "Always") != "Always":
        raise Unsupported(f"{pod.deployment}: restartPolicy {pod.spec['restartPolicy']}")
    for c in pod.spec.get("initContainers", []) + pod.spec["containers"]:
        if set(c) - CONTAINER_FIELDS:
            raise Unsupported(f"{c['name']}: container fields {sorted(set(c) - CONTAINER_FIELDS)}")
        for kind in ("postStart",):
            if kind in (c.get("lifecycle") or {}):
                raise Unsupported(f"{c['name']}: lifecycle {kind}")


def without_offline(docs: list[dict]) -> list[dict]:
    """The rendered docs less what tests/kubernetes/offline adds (the wheel folder, for the init containers'
    `model pull`)."""
    out = []
    for doc in json.loads(json.dumps(docs)):
        if doc["kind"] == "PersistentVolumeClaim" and doc["metadata"]["name"].endswith(OFFLINE_VOLUME):
            continue
        if doc["kind"] == "Deployment":
            spec = doc["spec"]["template"]["spec"]
            spec["volumes"] = [v for v in spec.get("volumes", []) if v["name"] != OFFLINE_VOLUME]
            for c in spec.get("initContainers", []):
                for key, keep in (("env", lambda e: e["name"] not in OFFLINE_ENV),
                                  ("volumeMounts", lambda m: m["name"] != OFFLINE_VOLUME)):
                    if key in c:
                        c[key] = [x for x in c[key] if keep(x)]
                        if not c[key]:
                            del c[key]
        out.append(doc)
    return out


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    p.add_argument("--manifests", required=True, help="the rendered overlay (kubectl kustomize's output)")
    p.add_argument("--state", required=True, help="a folder for the Secrets and the pods' Secret volumes")
    p.add_argument("--docker", default=os.environ.get("DOCKER", "docker"))
    sub = p.add_subparsers(dest="step", required=True)
    sub.add_parser("images", help="print the images the pods run, one a line")
    ov = sub.add_parser("check-offline", help="--manifests equals BASE but for tests/kubernetes/offline's additions")
    ov.add_argument("base")
    sec = sub.add_parser("create-secret", help="as `kubectl create secret generic NAME --from-file=KEY=PATH`")
    sec.add_argument("name")
    sec.add_argument("--from-file", action="append", required=True, metavar="KEY=PATH")
    up = sub.add_parser("up", help="every Deployment's replicas, run until each pod is ready")
    up.add_argument("--pv", action="append", default=[], metavar="CLAIM=DIR", help="bind CLAIM to host DIR")
    up.add_argument("--timeout", type=float, default=600, help="seconds for the pods to become ready")
    sc = sub.add_parser("scale", help="as `kubectl scale deployment NAME --replicas N`")
    sc.add_argument("deployment")
    sc.add_argument("replicas", type=int)
    sc.add_argument("--timeout", type=float, default=600)
    sub.add_parser("probes", help="every running container's readiness and liveness probes pass")
    st = sub.add_parser("stop", help="delete every pod of a Deployment (SIGTERM, its grace period)")
    st.add_argument("deployment")
    st.add_argument("--drain-probes", action="store_true", help="liveness passes, readiness fails while draining")
    pt = sub.add_parser("port", help="HOST:PORT of a Service port on this machine")
    pt.add_argument("service")
    pt.add_argument("port_name")
    sub.add_parser("down", help="remove every pod, volume and the network")
    args = p.parse_args()
    if args.step == "check-offline":
        base, offline = parse(Path(args.base).read_text()), parse(Path(args.manifests).read_text())
        if without_offline(offline) != without_offline(base):
            raise SystemExit("the offline overlay changes more than the model-pull wheel folder")
        log("the offline overlay adds only the wheel folder for model pull to the cpu overlay")
        return
    k = Kubelet(args.manifests, args.state, args.docker)
    try:
        if args.step == "images":
            print("\n".join(sorted({c["image"] for d in k.cluster.of_kind("Deployment")
                                    for c in d["spec"]["template"]["spec"].get("initContainers", [])
                                    + d["spec"]["template"]["spec"]["containers"]})))
        elif args.step == "create-secret":
            d = k.state / "secrets" / args.name
            d.mkdir(parents=True, exist_ok=True, mode=0o700)
            for item in args.from_file:
                key, _, path = item.partition("=")
                (d / key).write_bytes(Path(path).read_bytes())
                (d / key).chmod(0o600)
            log(f"Secret {args.name}: keys {', '.join(sorted(f.name for f in d.iterdir()))}")
        elif args.step == "up":
            for item in args.pv:
                claim, _, directory = item.partition("=")
                k.bind_claim(claim, directory)
            k.up(args.timeout)
        elif args.step == "scale":
            k.scale(args.deployment, args.replicas, args.timeout)
        elif args.step == "probes":
            k.prober.check_probes(k.pods())
        elif args.step == "stop":
            for pod in k.pods(args.deployment):
                k.stop(pod, args.drain_probes)
        elif args.step == "port":
            print(k.port(args.service, args.port_name))
        elif args.step == "down":
            k.down()
    except (Failed, Unsupported, KeyError) as e:
        print(f"[pods] FAILED: {e}", file=sys.stderr, flush=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
