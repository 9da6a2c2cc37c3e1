"""Long-context decode attention on the C++ CPU kernel: ms per layer for float32, int8 (dequant), int8 (VNNI Q.K), fp8.

    python bench/kv_attention_long.py [--iters 5] [--contexts 4096,16384,32768] [--batches 1,16] [--threads N]
                                      [--clock wall|cpu]

One layer of the default model's shape (9 query heads, 3 kv heads, head_dim 64, block 16), every sequence decoding
one token at the given context over scattered blocks. Prints a table, then one machine-readable line per case:
`kv_attention_long context=C batch=B cache=NAME ms_per_layer=X gbps=Y` (gbps: K/V bytes read, scales included,
per second). int8 (VNNI Q.K) is skipped where the kernel was built for a CPU without VNNI.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker_svc.attention import AttentionMetadata  # noqa: E402
from worker_svc.attention.cpu_backend import CpuAttentionBackend, int8_qk_width, load_library  # noqa: E402
from worker_svc.attention.quant import quantize  # noqa: E402

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 9, 3, 64, 16
CASES = ("float32", "int8 (dequant)", "int8 (VNNI Q.K)", "fp8_e4m3")


def timed(fn, iters: int, clock=time.perf_counter) -> float:
    """Fastest of `iters` timed calls of fn() after one warm-up call (NOTE: the minimum, not the median: on a
    shared, loaded box the other processes only ever add time)."""
    fn()
    times = []
    for _ in range(iters):
        t = clock()
        fn()
        times.append(clock() - t)
    return min(times)


def bench_point(lib, context: int, batch: int, iters: int, rng: np.random.Generator,
                clock=time.perf_counter) -> dict[str, tuple[float, int]]:
    """{case: (seconds per layer, K/V bytes read)} at one (context, batch)."""
    blocks_per_seq = context // BLOCK
    num_blocks = batch * blocks_per_seq
    ids = rng.permutation(num_blocks)  # scattered: no sequence's blocks are contiguous
    tables = [ids[i * blocks_per_seq:(i + 1) * blocks_per_seq].tolist() for i in range(batch)]
    meta = AttentionMetadata.build([1] * batch, [context] * batch, tables, BLOCK)
    query = torch.randn(batch, HEADS, HEAD_DIM)
    scale = 1.0 / math.sqrt(HEAD_DIM)
    pool = torch.randn(2, num_blocks, BLOCK, KV_HEADS, HEAD_DIM)
    layers = {"float32": (pool, None)}
    for name, dtype in (("int8", torch.int8), ("fp8_e4m3", torch.float8_e4m3fn)):
        layers[name] = quantize(pool, dtype)
    dequant, vnni = CpuAttentionBackend(lib), CpuAttentionBackend(lib, int8_qk=True) if int8_qk_width(lib) else None
    runs = {"float32": (dequant, "float32"), "int8 (dequant)": (dequant, "int8"), "int8 (VNNI Q.K)": (vnni, "int8"),
            "fp8_e4m3": (dequant, "fp8_e4m3")}
    results = {}
    for case, (backend, layer) in runs.items():
        if backend is None:
            continue
        kv, scales = layers[layer]
        nbytes = kv.numel() * kv.element_size() + (0 if scales is None else scales.numel() * 4)
        results[case] = (timed(lambda: backend.forward(query, kv, meta, scale, scales), iters, clock), nbytes)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--contexts", default="4096,16384,32768")
    ap.add_argument("--batches", default="1,16")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--clock", choices=("wall", "cpu"), default="wall",
                    help="cpu: the calling thread's CPU time (with --threads 1 the kernel runs on it): what a loaded, "
                         "shared box cannot inflate by descheduling us")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.clock == "cpu" and torch.get_num_threads() != 1:
        ap.error("--clock cpu needs --threads 1 (other threads' CPU time is not the caller's)")
    clock = time.thread_time if args.clock == "cpu" else time.perf_counter
    lib = load_library()
    rng = np.random.default_rng(0)
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        for context in (int(c) for c in args.contexts.split(",")):
            rows.append((context, batch, bench_point(lib, context, batch, args.iters, rng, clock)))
    print(f"decode attention, one layer ({HEADS} heads, {KV_HEADS} kv heads, head_dim {HEAD_DIM}, block {BLOCK}), "
          f"ms per layer ({args.clock} clock), best of {args.iters}, {torch.get_num_threads()} threads, int8 Q.K width "
          f"{int8_qk_width(lib)}")
    print(f"{'context':>8} {'batch':>5} " + " ".join(f"{c:>16}" for c in CASES))
    for context, batch, res in rows:
        cells = [f"{res[c][0] * 1e3:16.2f}" if c in res else f"{'-':>16}" for c in CASES]
        print(f"{context:>8} {batch:>5} " + " ".join(cells))
    for context, batch, res in rows:
        for case, (secs, nbytes) in res.items():
            name = case.replace(" (dequant)", "_dequant").replace(" (VNNI Q.K)", "_vnni")
            print(f"kv_attention_long context={context} batch={batch} cache={name} ms_per_layer={secs * 1e3:.3f} "
                  f"gbps={nbytes / secs / 1e9:.2f}")


if __name__ == "__main__":
    main()
