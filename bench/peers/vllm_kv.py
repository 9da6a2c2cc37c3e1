"""vLLM's V1 KVCacheManager (0.33) driven over a trace, one request after another, on the CPU: the peer of
bench/kv_trace.py, which drives our block manager the same way.

Per request: prefix-cache lookup + allocate for the prompt, append the decode tokens one at a time (allocating a
block when needed), free. One warm-up run, then --runs timed runs; prints each run's wall time and the prefix hits,
and last `median_wall_s=X`. Needs the venv of bench/peers/setup_vllm_core.sh.
usage: VENV/bin/python bench/peers/vllm_kv.py TRACE.jsonl [--block-size 16] [--num-blocks 8192]
                                              [--hash sha256|xxhash] [--runs 5]
"""
import argparse
import statistics
import sys
import time
import os

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from trace import read_trace  # noqa: E402

import torch  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.v1.request import Request  # noqa: E402
from vllm.v1.core.kv_cache_manager import KVCacheManager  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.kv_cache_interface import KVCacheConfig, KVCacheGroupSpec, FullAttentionSpec  # noqa: E402
from vllm.utils.hashing import get_hash_fn_by_name  # noqa: E402

p = argparse.ArgumentParser()
p.add_argument("trace")
p.add_argument("--block-size", type=int, default=16)
p.add_argument("--num-blocks", type=int, default=8192)
p.add_argument("--hash", default="sha256")
p.add_argument("--runs", type=int, default=5)
a = p.parse_args()

hash_fn = get_hash_fn_by_name(a.hash)
init_none_hash(hash_fn)
hasher = get_request_block_hasher(a.block_size, hash_fn)
spec = FullAttentionSpec(block_size=a.block_size, num_kv_heads=2, head_size=64, dtype=torch.float16)
cfg = KVCacheConfig(num_blocks=a.num_blocks, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
trace = read_trace(a.trace)
max_len = max(len(r["prompt"]) + len(r["decode"]) for r in trace) + a.block_size


def run():
    mgr = KVCacheManager(cfg, max_model_len=max_len, scheduler_block_size=a.block_size,
                         hash_block_size=a.block_size, enable_caching=True)
    hit = total = 0
    t0 = time.perf_counter()
    for i, r in enumerate(trace):
        prompt = r["prompt"]
        req = Request(str(i), prompt, SamplingParams(max_tokens=len(r["decode"])), None, block_hasher=hasher)
        blocks, n_hit, _ = mgr.get_computed_blocks(req)
        hit += n_hit
        total += len(prompt)
        assert mgr.allocate_slots(req, len(prompt) - n_hit, n_hit, blocks) is not None
        req.num_computed_tokens = len(prompt)
        for tok in r["decode"]:
            req.append_output_token_ids(tok)
            assert mgr.allocate_slots(req, 1) is not None
            req.num_computed_tokens += 1
        mgr.free(req)
    wall = time.perf_counter() - t0
    assert mgr.block_pool.get_num_free_blocks() == a.num_blocks - 1  # block 0 is vLLM's null block
    return wall, hit, total


run()  # warm-up: the first run in a process is slower
walls = []
for _ in range(a.runs):
    wall, hit, total = run()
    walls.append(wall)
print(f"vllm-0.33 KVCacheManager[{a.hash}] runs={['%.3f' % w for w in walls]} prefix_hit_tokens={hit}/{total}")
print(f"median_wall_s={statistics.median(walls):.4f}")
