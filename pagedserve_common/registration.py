"""What a worker announces when it dials in (pagedserve.v1.WorkerRegistration on the wire), and the bounds of its
name, which both ends apply (the worker when it makes one, the scheduler when it reads one)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from pagedserve_common.kv_geometry import KVGeometry

# NOTE: a name becomes the `worker` label of a few dozen series, a log field and a GetModelInfo entry: bounded, so
# that a registration cannot grow /metrics or the log (8 KB names once grew /metrics to 136 MB). 80 characters hold
# HOST:PID whole for any Linux host: a host name (at most 64: HOST_NAME_MAX, Kubernetes' 63 included) + ":" + a
# PID (at most 7 digits), so `pagedserve health --worker HOST` still matches it.
MAX_NAME_CHARS = 80
NAME_CHARS = "A-Za-z0-9._:@/#-"  # a host name's, plus what HOST:PID and a duplicate's #2 add
_VALID_NAME = re.compile(f"[{NAME_CHARS}]*")
_OTHER_CHARS = re.compile(f"[^{NAME_CHARS}]")


@dataclass(slots=True, frozen=True)
class WorkerRegistration:
    model_id: str  # must match the scheduler's
    max_model_len: int  # the longest sequence the worker's model accepts
    device: str  # "cpu", "cuda:0", ...
    kv_geometry: KVGeometry  # its pool's shape: block_size and dtype among it
    num_blocks: int  # KV blocks in its pool
    num_cpu_blocks: int = 0  # CPU swap blocks (--swap-space); 0: a preempted sequence is recomputed
    name: str = ""  # HOST:PID, for logs (name_error). NOTE: each registration is a new worker with an empty pool

    @property
    def block_size(self) -> int:
        return self.kv_geometry.block_size

    @property
    def dtype(self) -> str:
        return self.kv_geometry.dtype


def name_error(name: str) -> str | None:
    """Why `name` cannot be a worker's name (None when it can: at most MAX_NAME_CHARS characters of NAME_CHARS;
    "" is fine, the scheduler then names the worker by its id). NOTE: says what is wrong without quoting it whole."""
    if len(name) > MAX_NAME_CHARS:
        return f"it has {len(name):,} characters, more than {MAX_NAME_CHARS}"
    if not _VALID_NAME.fullmatch(name):
        bad = _OTHER_CHARS.search(name).group()
        return f"it has {bad!r}, not one of {NAME_CHARS}"
    return None


def default_name(host: str, pid: int) -> str:
    """HOST:PID within the bounds of name_error: a character of `host` outside NAME_CHARS becomes "-", and a host
    too long for MAX_NAME_CHARS loses its end (never on Linux: see MAX_NAME_CHARS)."""
    suffix = f":{pid}"
    return _OTHER_CHARS.sub("-", host)[:MAX_NAME_CHARS - len(suffix)] + suffix
