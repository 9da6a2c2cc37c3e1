"""What a worker announces when it dials in (pagedserve.v1.WorkerRegistration on the wire)."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve_common.kv_geometry import KVGeometry


@dataclass(slots=True, frozen=True)
class WorkerRegistration:
    model_id: str  # must match the scheduler's
    max_model_len: int  # the longest sequence the worker's model accepts
    device: str  # "cpu", "cuda:0", ...
    kv_geometry: KVGeometry  # its pool's shape: block_size and dtype among it
    num_blocks: int  # KV blocks in its pool
    num_cpu_blocks: int = 0  # CPU swap blocks (--swap-space); 0: a preempted sequence is recomputed
    name: str = ""  # HOST:PID, for logs. NOTE: each registration is a new worker with an empty pool

    @property
    def block_size(self) -> int:
        return self.kv_geometry.block_size

    @property
    def dtype(self) -> str:
        return self.kv_geometry.dtype
