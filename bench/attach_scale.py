"""Attach time and scheduler RSS for one worker registering N KV blocks; then a GetKVState snapshot of its pool.

    python bench/attach_scale.py [--num-blocks 10000000]

The engine runs in this process, as in the scheduler (no gRPC): attach_worker() is what the Attach handler runs
on the event loop, so its time is how long the loop stalls. Runs against older trees too (for a before/after:
PYTHONPATH=OLD_TREE:OLD_TREE/protos): a bound it does not know is not passed.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import os
import time

from pagedserve_common.kv_geometry import KVGeometry
from pagedserve_common.registration import WorkerRegistration
from scheduler_svc.core.kv_snapshot import snapshot
from scheduler_svc.engine import Engine, EngineConfig


def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


async def main(num_blocks: int) -> None:
    cfg = dict(model_id="m", max_model_len=2048, vocab_size=49152)
    if "max_worker_blocks" in {f.name for f in dataclasses.fields(EngineConfig)}:
        cfg["max_worker_blocks"] = num_blocks  # NOTE: this figure is above the default bound on purpose
    engine = Engine(EngineConfig(**cfg))
    reg = WorkerRegistration("m", 2048, "cpu", KVGeometry(30, 3, 64, "float32", 16), num_blocks)
    before = rss_mb()
    t0 = time.perf_counter()
    w = engine.attach_worker(reg)
    attach_s = time.perf_counter() - t0
    after = rss_mb()
    t0 = time.perf_counter()
    snap = snapshot(w.worker_id, w.scheduler)
    snapshot_s = time.perf_counter() - t0
    assert len(snap.ref_counts) == num_blocks
    engine.detach(w)
    await w.task
    print(f"attach_blocks={num_blocks} attach_s={attach_s:.3f} snapshot_s={snapshot_s:.3f} "
          f"rss_before_mb={before:.0f} rss_after_mb={after:.0f} rss_delta_mb={after - before:.0f}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    p.add_argument("--num-blocks", type=int, default=10_000_000)
    asyncio.run(main(p.parse_args().num_blocks))
