"""What a pod spec's volumes, securityContext and resources become on Docker (as the kubelet would set them up)."""

from __future__ import annotations

from dataclasses import dataclass, field

from tests.kubernetes.podspec import Cluster, Pod, Unsupported, optional, quantity

SECRET_DEFAULT_MODE = 0o644  # the API's default for secret and configMap volumes
RW_MASK, RO_MASK, DIR_EXEC_MASK = 0o660, 0o440, 0o110  # what fsGroup ownership adds (the kubelet's masks)


# ---- volumes ---------------------------------------------------------------------------------------------------

@dataclass(slots=True)
class File:
    """A file of a Secret or ConfigMap volume: its path in the volume, its bytes and its mode."""

    path: str
    data: bytes
    mode: int


@dataclass(slots=True)
class Volume:
    """A pod volume as Docker provides it: kind is pvc, emptyDir, secret, configMap or hostPath."""

    name: str
    kind: str
    source: str  # the PVC's claim name, the hostPath's path, the Secret's or ConfigMap's name; '' for emptyDir
    read_only: bool = False
    memory: bool = False  # an emptyDir of medium Memory (a tmpfs)
    size_limit: str | None = None
    files: list[File] = field(default_factory=list)


def fs_group_mode(mode: int, read_only: bool, is_dir: bool = False) -> int:
    """A file's mode once the kubelet gave the volume to the pod's fsGroup."""
    mask = RO_MASK if read_only else RW_MASK
    return mode | mask | (0o2000 | DIR_EXEC_MASK if is_dir else 0)


def projected_files(data: dict[str, bytes], source: dict, fs_group: int | None) -> list[File]:
    """The files of a Secret or ConfigMap volume: every key (or the listed items), with defaultMode or the item's
    mode, widened by fsGroup as the kubelet does it (a read-only volume: group read)."""
    default = int(source.get("defaultMode", SECRET_DEFAULT_MODE))
    items = source.get("items") or [{"key": k, "path": k} for k in sorted(data)]
    files = []
    for item in items:
        if item["key"] not in data:
            if source.get("optional"):
                continue
            raise KeyError(f"key {item['key']!r} is not in {source}")
        mode = int(item.get("mode", default))
        files.append(File(item["path"], data[item["key"]], fs_group_mode(mode, True) if fs_group is not None
                          else mode))
    return files


def pod_volumes(pod: Pod, cluster: Cluster) -> dict[str, Volume]:
    fs_group = (pod.spec.get("securityContext") or {}).get("fsGroup")
    claims = {d["metadata"]["name"] for d in cluster.of_kind("PersistentVolumeClaim")}
    out = {}
    for v in pod.spec.get("volumes", []):
        name = v["name"]
        if "persistentVolumeClaim" in v:
            claim = v["persistentVolumeClaim"]["claimName"]
            if claim not in claims:
                raise KeyError(f"{pod.deployment}: volume {name} claims {claim!r}, which is not in the manifests")
            out[name] = Volume(name, "pvc", claim, read_only=bool(v["persistentVolumeClaim"].get("readOnly")))
        elif "emptyDir" in v:
            spec = v["emptyDir"] or {}
            out[name] = Volume(name, "emptyDir", "", memory=spec.get("medium") == "Memory",
                               size_limit=spec.get("sizeLimit"))
        elif "secret" in v:
            src = v["secret"]
            data = optional(src, lambda: cluster.secret(src["secretName"]), {})
            out[name] = Volume(name, "secret", src["secretName"], True, files=projected_files(data, src, fs_group))
        elif "configMap" in v:
            src = v["configMap"]
            data = {k: s.encode() for k, s in optional(src, lambda: cluster.config_map(src["name"]), {}).items()}
            out[name] = Volume(name, "configMap", src["name"], True, files=projected_files(data, src, fs_group))
        elif "hostPath" in v:
            out[name] = Volume(name, "hostPath", v["hostPath"]["path"])
        else:
            raise Unsupported(f"{pod.deployment}: volume {v}")
    return out


@dataclass(slots=True)
class Mount:
    volume: str
    target: str
    read_only: bool


def container_mounts(container: dict, volumes: dict[str, Volume]) -> list[Mount]:
    out = []
    for m in container.get("volumeMounts", []):
        unsupported = {k for k in m if k not in ("name", "mountPath", "readOnly")}
        if unsupported:
            raise Unsupported(f"{container['name']}: volumeMount {m['name']}: {sorted(unsupported)}")
        if m["name"] not in volumes:
            raise KeyError(f"{container['name']} mounts {m['name']!r}, which is not a volume of its pod")
        out.append(Mount(m["name"], m["mountPath"], bool(m.get("readOnly")) or volumes[m["name"]].read_only))
    return out


# ---- users, capabilities, the root filesystem ------------------------------------------------------------------

def security_args(pod: Pod, container: dict, image_user: str) -> list[str]:
    """docker run flags for the pod's and the container's securityContext (the container's fields win)."""
    pod_sc = pod.spec.get("securityContext") or {}
    sc = {**{k: v for k, v in pod_sc.items() if k in ("runAsUser", "runAsGroup", "runAsNonRoot", "seccompProfile")},
          **(container.get("securityContext") or {})}
    known = {"runAsUser", "runAsGroup", "runAsNonRoot", "seccompProfile", "readOnlyRootFilesystem",
             "allowPrivilegeEscalation", "capabilities", "privileged"}
    if set(sc) - known:
        raise Unsupported(f"{container['name']}: securityContext {sorted(set(sc) - known)}")
    unsupported_pod = set(pod_sc) - {"runAsUser", "runAsGroup", "runAsNonRoot", "seccompProfile", "fsGroup",
                                     "supplementalGroups", "fsGroupChangePolicy"}
    if unsupported_pod:
        raise Unsupported(f"{pod.deployment}: pod securityContext {sorted(unsupported_pod)}")
    user = str(sc["runAsUser"]) if "runAsUser" in sc else image_user.partition(":")[0]
    if sc.get("runAsNonRoot") and (not user.isdigit() or int(user) == 0):
        # NOTE: the kubelet's own check: it cannot tell that a named image user is not root
        raise ValueError(f"{container['name']}: runAsNonRoot, but the user is {user or 'root'!r} (not a non-zero uid)")
    args = ["--user", f"{user}:{sc['runAsGroup']}" if "runAsGroup" in sc else user] if user else []
    for gid in ([pod_sc["fsGroup"]] if "fsGroup" in pod_sc else []) + list(pod_sc.get("supplementalGroups", [])):
        args += ["--group-add", str(gid)]
    if sc.get("readOnlyRootFilesystem"):
        args.append("--read-only")
    if sc.get("allowPrivilegeEscalation") is False:
        args += ["--security-opt", "no-new-privileges"]
    if sc.get("privileged"):
        args.append("--privileged")
    caps = sc.get("capabilities") or {}
    args += [a for cap in caps.get("drop", []) for a in ("--cap-drop", cap)]
    args += [a for cap in caps.get("add", []) for a in ("--cap-add", cap)]
    seccomp = (sc.get("seccompProfile") or {}).get("type", "Unconfined")  # NOTE: the kubelet's default
    if seccomp == "Unconfined":
        args += ["--security-opt", "seccomp=unconfined"]
    elif seccomp != "RuntimeDefault":
        raise Unsupported(f"{container['name']}: seccompProfile {seccomp}")
    return args


def resource_args(container: dict) -> list[str]:
    """Limits as Docker's hard limits; the CPU request as CPU shares (the kubelet's 1024 per core)."""
    res = container.get("resources") or {}
    args = []
    if "cpu" in res.get("requests", {}):
        args += ["--cpu-shares", str(max(2, int(quantity(res["requests"]["cpu"]) * 1024)))]
    limits = res.get("limits", {})
    if "cpu" in limits:
        args += ["--cpus", str(float(quantity(limits["cpu"])))]
    if "memory" in limits:
        args += ["--memory", str(int(quantity(limits["memory"])))]
    other = set(limits) - {"cpu", "memory"}
    if other:
        raise Unsupported(f"{container['name']}: resource limits {sorted(other)}")
    return args
