"""A worker started without --dtype, real processes on loopback: it loads the model in the dtype `auto` picks on this
CPU, says which and why in its start-up line, registers its cache in that dtype (the scheduler counts its blocks
from it) and serves."""

from __future__ import annotations

import json
from pathlib import Path

import grpc

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc
from pagedserve_cli.bench.local_server import LocalServer
from pagedserve_common.kv_geometry import KVGeometry
from tests.support.service import KV_MEMORY, metric_value, scrape
from tests.support.processes import wait_for_line
from worker_svc.models import resolve_dtype

TINY_SHAPE = dict(num_layers=2, num_kv_heads=2, head_dim=16, block_size=16)  # tests.support.worker.TINY's pool


def test_a_worker_without_dtype_runs_registers_and_logs_what_auto_picks_here(tiny_served_model, tmp_path):
    config = json.loads(Path(tiny_served_model, "config.json").read_text())
    want = resolve_dtype("auto", "cpu", config)  # from this machine's /proc/cpuinfo
    server = LocalServer.start(tiny_served_model, tmp_path, worker_args=("--kv-memory", str(KV_MEMORY)))
    try:
        ready = json.loads(wait_for_line(tmp_path / "worker.log", '"worker ready"', server.procs[0]))
        assert (ready["dtype"], ready["dtype_reason"], ready["kv_cache_dtype"]) == (want.name, want.reason,
                                                                                    want.name)
        blocks = KVGeometry(**TINY_SHAPE, dtype=want.name).num_blocks_for(KV_MEMORY)
        assert blocks == 40 * 4 // want.dtype.itemsize  # KV_MEMORY is 40 float32 blocks
        assert ready["num_blocks"] == blocks
        with grpc.insecure_channel(server.address) as ch:
            stub = generate_pb2_grpc.GenerationStub(ch)
            (worker,) = stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=60).workers
            assert (worker.dtype, worker.num_blocks) == (want.name, blocks)
            out = list(stub.Generate(pb.GenerateRequest(prompt="The capital of France is", sampling=pb.SamplingParams(
                max_tokens=4, temperature=0, ignore_eos=True)), timeout=300))
        assert sum(len(m.token_ids) for m in out) == 4 and out[-1].finish_reason == pb.FINISH_REASON_LENGTH
        assert metric_value(scrape(server.metrics), "pagedserve_kv_blocks_total") == blocks
    finally:
        server.stop()
