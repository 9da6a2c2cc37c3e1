"""Decode attention on the CPU: how fast the kernel reads a batch's KV, against a plain read of the same bytes.

A decode step of B sequences at one context length over the default model's attention shape (30 layers, 9 query
heads over 3 kv heads, head_dim 64, 16-token blocks), each layer's pool its own tensor (so the KV comes from
memory, as in a real step, not from cache): ms per step of the 30 layers' kernel calls, the KV bytes read per
second, and the same bytes read by a plain vectorised reduction (torch's max over them), the memory's pace for
one pass. The ratio of the two says how far the kernel is from that bound.

    python bench/attention_cpu.py [--threads 1] [--ctx 192] [--batch 64] [--dtype bfloat16] [--steps 5]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from worker_svc.attention import AttentionMetadata  # noqa: E402
from worker_svc.attention.cpu_backend import CpuAttentionBackend, load_library  # noqa: E402

LAYERS, BLOCK, HEADS, KV_HEADS, HEAD_DIM = 30, 16, 9, 3, 64


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--ctx", type=int, default=192)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--lib", help="a built kernel library to time (default: this source's build)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    per_seq = -(-args.ctx // BLOCK)
    num_blocks = args.batch * per_seq + 1
    pools = [torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM).to(dtype) for _ in range(LAYERS)]
    tables = [list(range(1 + i * per_seq, 1 + (i + 1) * per_seq)) for i in range(args.batch)]
    meta = AttentionMetadata.build([1] * args.batch, [args.ctx] * args.batch, tables, BLOCK)
    query = torch.randn(args.batch, HEADS, HEAD_DIM).to(dtype)
    backend = CpuAttentionBackend(load_library(Path(args.lib)) if args.lib else None)
    as_ints = torch.int16 if dtype == torch.bfloat16 else torch.int32

    def step_kernel() -> None:
        for pool in pools:
            backend.forward(query, pool, meta, HEAD_DIM ** -0.5)

    def step_read() -> None:
        for pool in pools:
            pool.view(as_ints).max()

    # KV the step reads: each sequence's context, K and V (the pool's spare block and padding never).
    kv_bytes = LAYERS * 2 * args.batch * args.ctx * KV_HEADS * HEAD_DIM * pools[0].element_size()
    pool_bytes = sum(p.numel() * p.element_size() for p in pools)
    for name, fn, nbytes in (("kernel", step_kernel, kv_bytes), ("plain read", step_read, pool_bytes)):
        fn()
        times = []
        for _ in range(args.steps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        best = min(times)
        print(f"{name:<10} {best * 1e3:8.2f} ms a step  {nbytes / best / 1e9:6.1f} GB/s", flush=True)
    print(f"threads={args.threads} ctx={args.ctx} batch={args.batch} dtype={args.dtype}")


if __name__ == "__main__":
    main()
