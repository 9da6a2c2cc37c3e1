"""`--device cuda:auto`: each worker on a host claims a GPU of its own with a lock file (compose replicas)."""

from __future__ import annotations

import fcntl
import os
from pathlib import Path

# NOTE: the open lock files live as long as the process: the kernel drops a claim when its holder dies, however
# it dies, so a restarted replica finds its GPU free again. Never closed on purpose.
_held: list[int] = []


def claim_gpu(num_gpus: int, lock_dir: str | os.PathLike) -> int:
    """Index of the lowest-numbered GPU no other live process has claimed through `lock_dir`; takes the claim.

    Every worker that shares `lock_dir` (a volume mounted in all replicas) gets a different GPU, so
    `docker compose up --scale worker=N` pins one replica per GPU though compose cannot number replicas.
    """
    if num_gpus < 1:
        raise RuntimeError("--device cuda:auto: no CUDA device is visible")
    path = Path(lock_dir)
    path.mkdir(parents=True, exist_ok=True)
    for index in range(num_gpus):
        fd = os.open(path / f"gpu{index}.lock", os.O_RDWR | os.O_CREAT, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            continue
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        _held.append(fd)
        return index
    raise RuntimeError(f"--device cuda:auto: all {num_gpus} GPUs are claimed by other workers (locks in {path})")


def default_lock_dir() -> Path:
    from worker_svc.model_store import cache_root
    return cache_root() / "gpu-locks"
