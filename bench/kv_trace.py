"""Drives the KV block manager over a trace, as bench/peers/vllm_kv.py drives vLLM's KVCacheManager.

Per request: prefix lookup + allocate the prompt, append the decode tokens one at a time, free. One warm-up
run, then --runs timed runs; prints `prefix_hit_tokens=H/T` and, last, `median_wall_s=X`.
usage: python bench/kv_trace.py TRACE.jsonl [--block-size 16] [--num-blocks 8192] [--runs 5]
"""

import argparse
import json
import statistics
import time

from scheduler_svc.kv.manager import KVCacheManager


def read_trace(path: str) -> list[dict]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def run(trace: list[dict], block_size: int, num_blocks: int) -> tuple[float, int, int]:
    mgr = KVCacheManager(num_blocks, block_size)
    t0 = time.perf_counter()
    for i, r in enumerate(trace):
        prompt, rid = r["prompt"], str(i)
        hit = mgr.find_prefix(prompt)
        mgr.record_prefix_query(len(prompt), hit.num_tokens)
        assert mgr.allocate(rid, len(prompt), prompt, hit) is not None
        tokens = list(prompt)
        for tok in r["decode"]:
            tokens.append(tok)
            assert mgr.allocate(rid, len(tokens), tokens) is not None
        mgr.free(rid)
    wall = time.perf_counter() - t0
    assert mgr.pool.num_free_blocks == num_blocks
    return wall, mgr.prefix_hit_tokens, mgr.prefix_query_tokens


def main() -> None:
    p = argparse.ArgumentParser(allow_abbrev=False)
    p.add_argument("trace")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=8192)
    p.add_argument("--runs", type=int, default=5)
    a = p.parse_args()
    trace = read_trace(a.trace)
    run(trace, a.block_size, a.num_blocks)  # warm-up
    walls = []
    for _ in range(a.runs):
        wall, hit, total = run(trace, a.block_size, a.num_blocks)
        walls.append(wall)
    print(f"pagedserve KVCacheManager runs={['%.3f' % w for w in walls]}")
    print(f"prefix_hit_tokens={hit}/{total}")
    print(f"median_wall_s={statistics.median(walls):.4f}")


if __name__ == "__main__":
    main()
