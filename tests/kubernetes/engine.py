"""The Docker CLI as tests/kubernetes uses it, and the names of a pod's containers on it."""

from __future__ import annotations

import subprocess
import threading
from collections.abc import Callable

LABEL = "k8srun"  # every container and volume made here carries it (value: the namespace), and `down` removes them


def log(msg: str) -> None:
    print(f"[pods] {msg}", flush=True)


class Failed(RuntimeError):
    """The pods did not run as the manifests say they should."""


def side_by_side(jobs: list[tuple[str, Callable[[], object]]]) -> list:
    """Runs each (what, job) in a thread of its own (as the kubelet does pods and probes); returns their results,
    in order, or, once every one ended, raises Failed with each error, prefixed by its `what` when given."""
    results: list = [None] * len(jobs)
    errors: list[str] = []

    def run(i: int, what: str, job: Callable[[], object]) -> None:
        try:
            results[i] = job()
        except Exception as e:  # NOTE: reported with the others, after every thread ended
            errors.append(f"{what}: {e}" if what else str(e))

    threads = [threading.Thread(target=run, args=(i, *j)) for i, j in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise Failed("\n".join(errors))
    return results


class Docker:
    def __init__(self, binary: str) -> None:
        self.binary = binary

    def __call__(self, *args: str, check: bool = True, timeout: float | None = None) -> str:
        out = subprocess.run([self.binary, *args], capture_output=True, text=True, timeout=timeout)
        if check and out.returncode != 0:
            raise Failed(f"docker {' '.join(args[:3])} ...: {out.stderr.strip() or out.stdout.strip()}")
        return out.stdout.strip()

    def inspect(self, name: str, fmt: str) -> str:
        return self("inspect", "-f", fmt, name)

    def names(self, *filters: str, volumes: bool = False) -> list[str]:
        flags = [a for f in filters for a in ("--filter", f)]
        if volumes:
            return self("volume", "ls", "--quiet", *flags).split()
        return self("ps", "--all", "--format", "{{.Names}}", *flags).split()

    def logs(self, name: str, tail: int = 40) -> str:
        out = subprocess.run([self.binary, "logs", "--tail", str(tail), name], capture_output=True, text=True)
        return (out.stdout + out.stderr).strip()


def sandbox(pod: str) -> str:
    return f"k8s_POD_{pod}"


def container_name(pod: str, container: str) -> str:
    return f"k8s_{container}_{pod}"
