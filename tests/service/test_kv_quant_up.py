"""`pagedserve up --kv-cache-dtype int8` over the default model, real processes on loopback (one server for the
file): the worker starts with an int8 cache and says so, the scheduler counts its blocks from int8's bytes per
token and shows the cache in GetModelInfo, /v1/models and kv-map, and it serves."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request

import grpc
import pytest

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc
from pagedserve_common.defaults import DEFAULT_MODEL
from pagedserve_common.kv_geometry import KVGeometry
from pagedserve_common.ports import free_port
from tests.support.service import wait_until
from tests.support.processes import stop_all, up, wait_for_line

pytestmark = pytest.mark.slow
KV_MEMORY = 4 << 20  # tests.support.processes.up's --kv-memory
# SmolLM2-135M: 30 layers, 3 kv heads, head_dim 64; int8 codes plus one float32 scale per (token, kv head), K and V
INT8 = KVGeometry(30, 3, 64, "int8", 16)
HANG_GUARD = 300


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    listen, http = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    log = tmp_path_factory.mktemp("kv-quant-up") / "stderr"
    with open(log, "w") as err:
        proc = up(DEFAULT_MODEL, listen, "--kv-cache-dtype", "int8", "--http", http, stderr=err)
    try:
        line = proc.stdout.readline()
        assert line.startswith(f"pagedserve is up: {listen}"), (line, log.read_text()[-2000:])
        yield listen, http, log, proc
    finally:
        stop_all(proc)


def model_info(listen: str) -> pb.GetModelInfoResponse:
    with grpc.insecure_channel(listen) as ch:
        return generate_pb2_grpc.GenerationStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=60)


def test_the_worker_starts_with_an_int8_cache_and_says_so(server):
    listen, _, log, proc = server
    ready = json.loads(wait_for_line(log, '"worker ready"', proc))
    assert (ready["kv_cache_dtype"], ready["dtype"]) == ("int8", "float32")  # the cache's, whatever the weights'
    assert ready["num_blocks"] == INT8.num_blocks_for(KV_MEMORY) == 21
    assert ready["kv_bytes"] == 21 * INT8.bytes_per_block


def test_the_scheduler_shows_the_int8_cache_and_counts_its_blocks(server):
    listen, http, _, _ = server
    wait_until(lambda: len(model_info(listen).workers) == 1)
    (worker,) = model_info(listen).workers
    assert (worker.dtype, worker.num_blocks, worker.block_size) == ("int8", INT8.num_blocks_for(KV_MEMORY), 16)
    models = json.loads(urllib.request.urlopen(f"http://{http}/v1/models", timeout=60).read())
    assert models["data"][0]["kv_cache_dtypes"] == ["int8"]
    done = subprocess.run([sys.executable, "-m", "pagedserve_cli.main", "kv-map", "--server", listen, "--once"],
                          capture_output=True, text=True, timeout=HANG_GUARD)
    assert done.returncode == 0, done.stderr
    assert "block size 16 tokens · 21 blocks · int8 cache (12,240 B/token) · " in done.stdout, done.stdout
    assert INT8.bytes_per_token == 12_240


def test_it_serves_greedy_text_and_gives_every_block_back(server):
    listen, _, _, _ = server
    with grpc.insecure_channel(listen) as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        msgs = list(stub.Generate(pb.GenerateRequest(prompt="The capital of France is", sampling=pb.SamplingParams(
            max_tokens=8, temperature=0)), timeout=HANG_GUARD))
        assert "".join(m.text for m in msgs).startswith(" Paris")
        wait_until(lambda: not stub.GetKVState(pb.GetKVStateRequest(), timeout=60).sequences)
