"""Device benchmark of cuda/paged_attention.cu (issue #5): decode bandwidth and prefill TFLOP/s vs torch SDPA.

    python bench/gpu_kernels.py            # one run takes well under 5 minutes on an H100/H200

Decode: batch {1, 32, 128} x context {512, 4k, 32k}, 32 query heads, 8 kv heads, head_dim 128, block 16,
float16 and bfloat16. Achieved bandwidth = (K/V bytes read + q/out bytes) / time (CUDA events, median of many
warm launches, the GPU kept busy ahead of each timed launch so host launch latency is not measured), shown as a
fraction of the measured device-to-device copy bandwidth, next to SDPA on the same KV laid out contiguously
(the GQA group folded into the query length, so SDPA runs its flash kernel without repeating K/V).
Targets: >= 80% of copy bandwidth at context >= 4k; faster than SDPA at every decode point.
Prefill: a 512-token chunk over 4k cached tokens, TFLOP/s vs SDPA with a bottom-right causal mask.
Then a sweep of the decode split size (CupyAttentionBackend's min_partition) at batch 1 and 32, contexts 4k and
32k, float16, so that one GPU run also tells how to tune the default, next to batch_invariant's one split (the cost
of batch invariance in attention: issue 48).
8-bit caches (issue 25; int8, fp8_e4m3, fp8_e5m2, float16 queries): the quantising write (4096 tokens), decode at
batch {1, 32, 128} x context {4k, 32k} and the same prefill, each with its achieved bandwidth = bytes of codes +
scales read (written, for the write) per second, the decode next to the float16 cache's time at the same point
(the 8-bit cache reads ~half the bytes, so at long contexts it should be faster), and the relative error against
SDPA over the dequantised cache.
Notes: ptxas registers/spills for sm_90 (nvcc -Xptxas -v), when nvcc is on PATH (also without a GPU).
"""

from __future__ import annotations

import math
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker_svc.attention import AttentionMetadata  # noqa: E402
from worker_svc.attention.cupy_backend import CUDA_DIR, KERNEL_SOURCE, CupyAttentionBackend  # noqa: E402
from pagedserve_common.kv_geometry import QUANT_MAX  # noqa: E402
from worker_svc.attention.quant import STORAGE, dequantize, raw  # noqa: E402

H, KVH, HD, BLOCK = 32, 8, 128, 16
BATCHES, CONTEXTS = (1, 32, 128), (512, 4096, 32768)
SWEEP_POINTS = ((1, 4096), (1, 32768), (32, 4096), (32, 32768))
PREFILL_CHUNK, PREFILL_CACHED = 512, 4096
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
CACHES = ("int8", "fp8_e4m3", "fp8_e5m2")
QUANT_CONTEXTS = (4096, 32768)
WRITE_TOKENS = 4096


def timed(fn, iters: int, warmup: int = 3) -> float:
    """Median seconds of fn() on the current stream, each launch queued behind a GPU sleep."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(1_000_000)  # keep the GPU busy while the host queues the timed work
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def copy_bandwidth() -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    n = 2 << 30
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    t = timed(lambda: dst.copy_(src), 20)
    return 2 * n / t  # NOTE: the 4 GiB of buffers go with this frame


def ptxas_notes() -> None:
    nvcc = shutil.which("nvcc")
    if not nvcc:
        print("notes: nvcc not on PATH; no ptxas report")
        return
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [nvcc, "-std=c++17", "-arch=sm_90", "-cubin", "-Xptxas", "-v", f"-I{CUDA_DIR}", str(KERNEL_SOURCE),
               "-o", f"{tmp}/k.cubin"]  # fmt: skip
        proc = subprocess.run(cmd, capture_output=True, text=True)
    log = proc.stdout + proc.stderr
    if proc.returncode:
        print("notes: nvcc failed:\n" + log[-2000:])
        return
    print("notes: ptxas -v, sm_90 (registers / spills / shared memory):")
    entry = None
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '(\w+)'", line)
        if m:
            entry = m.group(1)
        elif entry and ("spill" in line or "registers" in line):
            if ("_d128" in entry and "_f32" not in entry) or entry.startswith(("write_kv", "copy_blocks")):
                print(f"  {entry:32s} {line.strip()}")


def decode_case(be, dtype, batch, ctx, copy_bw, rng):
    nb = batch * ctx // BLOCK
    pool = torch.empty((2, nb, BLOCK, KVH, HD), dtype=dtype, device="cuda").normal_()
    ids = rng.permutation(nb).reshape(batch, ctx // BLOCK)  # scattered blocks
    meta = AttentionMetadata.build([1] * batch, [ctx] * batch, ids.tolist(), BLOCK, device="cuda")
    q = torch.randn(batch, H, HD, device="cuda", dtype=dtype)
    out = torch.empty_like(q)
    scale = 1 / math.sqrt(HD)
    iters = 50 if ctx * batch <= 1 << 20 else 20
    t = timed(lambda: be.forward(q, pool, meta, scale, out=out), iters)
    # Check one result against SDPA (cheap sanity check, not the float64 reference).
    k = pool[0][torch.from_numpy(ids).cuda()].reshape(batch, ctx, KVH, HD).transpose(1, 2).contiguous()
    v = pool[1][torch.from_numpy(ids).cuda()].reshape(batch, ctx, KVH, HD).transpose(1, 2).contiguous()
    del pool
    qg = q.view(batch, KVH, H // KVH, HD)  # GQA group as query rows: plain MHA over kv heads
    sdpa = lambda: F.scaled_dot_product_attention(qg, k, v, scale=scale)  # noqa: E731
    t_sdpa = timed(sdpa, iters)
    err = ((out.float() - sdpa().reshape(batch, H, HD).float()).norm() / sdpa().float().norm()).item()
    nbytes = 2 * batch * ctx * KVH * HD * q.element_size()  # K and V
    nbytes += 2 * q.numel() * q.element_size()
    bw = nbytes / t
    del k, v
    torch.cuda.empty_cache()
    return t, t_sdpa, bw, bw / copy_bw, err


def prefill_case(be, dtype, rng, batch=1):
    chunk, cached = PREFILL_CHUNK, PREFILL_CACHED
    s = cached + chunk
    nb = batch * (-(-s // BLOCK))
    pool = torch.empty((2, nb, BLOCK, KVH, HD), dtype=dtype, device="cuda").normal_()
    ids = rng.permutation(nb).reshape(batch, -1)
    meta = AttentionMetadata.build([chunk] * batch, [s] * batch, ids.tolist(), BLOCK, device="cuda")
    q = torch.randn(batch * chunk, H, HD, device="cuda", dtype=dtype)
    out = torch.empty_like(q)
    scale = 1 / math.sqrt(HD)
    t = timed(lambda: be.forward(q, pool, meta, scale, out=out), 10)
    flops = 4 * batch * H * HD * sum(cached + j + 1 for j in range(chunk))
    idx = torch.from_numpy(ids).cuda()
    k = pool[0][idx].reshape(batch, -1, KVH, HD)[:, :s].transpose(1, 2).repeat_interleave(H // KVH, 1).contiguous()
    v = pool[1][idx].reshape(batch, -1, KVH, HD)[:, :s].transpose(1, 2).repeat_interleave(H // KVH, 1).contiguous()
    qs = q.view(batch, chunk, H, HD).transpose(1, 2).contiguous()
    from torch.nn.attention.bias import causal_lower_right

    mask = causal_lower_right(chunk, s)
    sdpa = lambda: F.scaled_dot_product_attention(qs, k, v, attn_mask=mask, scale=scale)  # noqa: E731
    t_sdpa = timed(sdpa, 10)
    ref = sdpa().transpose(1, 2).reshape(batch * chunk, H, HD).float()
    err = ((out.float() - ref).norm() / ref.norm()).item()
    del pool, k, v
    torch.cuda.empty_cache()
    return flops / t / 1e12, flops / t_sdpa / 1e12, err


def cache_bytes(num_tokens: int, cache: str) -> int:
    """Bytes of an 8-bit cache's K and V for num_tokens tokens: codes plus one float32 scale per (token, kv head)."""
    return 2 * num_tokens * KVH * (HD * torch.tensor([], dtype=STORAGE[cache]).element_size() + 4)


def random_quant_pool(cache: str, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Codes [2, nb, BLOCK, KVH, HD] (what quantising N(0, 1) rows gives, no NaN codes) and scales ~ 1/QUANT_MAX."""
    shape = (2, num_blocks, BLOCK, KVH)
    if cache == "int8":
        codes = torch.randint(-127, 128, (*shape, HD), dtype=torch.int8, device="cuda")
    else:
        codes = torch.empty((*shape, HD), dtype=STORAGE[cache], device="cuda")
        qmax = QUANT_MAX[cache]  # NOTE: torch turns a float past the fp8 max into NaN, not the max
        for i in range(2):  # NOTE: one half at a time: the float16 staging is twice the codes' size
            x = torch.randn(shape[1:] + (HD,), dtype=torch.float16, device="cuda") * 64
            codes[i] = x.clamp_(-qmax, qmax).to(STORAGE[cache])
    scales = torch.rand(shape, device="cuda") * 0.01 + 0.005
    return codes, scales


def quant_write_case(be, cache):
    """The quantising write of WRITE_TOKENS float16 tokens: (seconds, GB/s of codes + scales written, GB/s all)."""
    nb = WRITE_TOKENS // BLOCK
    codes, scales = random_quant_pool(cache, nb)
    key = torch.randn(WRITE_TOKENS, KVH, HD, dtype=torch.float16, device="cuda")
    value = torch.randn_like(key)
    slots = torch.randperm(nb * BLOCK, device="cuda")
    t = timed(lambda: be.write_kv(codes, key, value, slots, kv_scales=scales), 50)
    written = cache_bytes(WRITE_TOKENS, cache)
    return t, written / t, (written + 2 * key.numel() * key.element_size()) / t


def quant_decode_case(be, cache, batch, ctx, rng):
    """(seconds, GB/s of codes + scales read, rel. error vs SDPA over the dequantised cache, NaN past 1M tokens:
    the float staging of the check would not fit beside the pool)."""
    nb = batch * ctx // BLOCK
    codes, scales = random_quant_pool(cache, nb)
    ids = rng.permutation(nb).reshape(batch, ctx // BLOCK)
    meta = AttentionMetadata.build([1] * batch, [ctx] * batch, ids.tolist(), BLOCK, device="cuda")
    q = torch.randn(batch, H, HD, device="cuda", dtype=torch.float16)
    out = torch.empty_like(q)
    scale = 1 / math.sqrt(HD)
    small = ctx * batch <= 1 << 20
    t = timed(lambda: be.forward(q, codes, meta, scale, kv_scales=scales, out=out), 50 if small else 20)
    if not small:
        del codes, scales
        torch.cuda.empty_cache()
        return t, cache_bytes(batch * ctx, cache) / t, float("nan")
    idx = torch.from_numpy(ids).cuda()
    # NOTE: float8 gathers go as bytes (raw), as everywhere in the project.
    kv = dequantize(raw(codes)[:, idx].view(codes.dtype), scales[:, idx], torch.float16)
    del codes, scales
    k, v = (kv[i].reshape(batch, ctx, KVH, HD).transpose(1, 2).contiguous() for i in range(2))
    del kv
    ref = F.scaled_dot_product_attention(q.view(batch, KVH, H // KVH, HD), k, v, scale=scale).reshape(batch, H, HD)
    err = ((out.float() - ref.float()).norm() / ref.float().norm()).item()
    del k, v
    torch.cuda.empty_cache()
    return t, cache_bytes(batch * ctx, cache) / t, err


def quant_prefill_case(be, cache, rng):
    """Chunk PREFILL_CHUNK over PREFILL_CACHED tokens: (TFLOP/s, GB/s of the cache's codes + scales per call)."""
    s = PREFILL_CACHED + PREFILL_CHUNK
    nb = -(-s // BLOCK)
    codes, scales = random_quant_pool(cache, nb)
    meta = AttentionMetadata.build([PREFILL_CHUNK], [s], [rng.permutation(nb).tolist()], BLOCK, device="cuda")
    q = torch.randn(PREFILL_CHUNK, H, HD, device="cuda", dtype=torch.float16)
    out = torch.empty_like(q)
    t = timed(lambda: be.forward(q, codes, meta, 1 / math.sqrt(HD), kv_scales=scales, out=out), 10)
    flops = 4 * H * HD * sum(PREFILL_CACHED + j + 1 for j in range(PREFILL_CHUNK))
    return flops / t / 1e12, cache_bytes(s, cache) / t


def quant_section(be, rng, float16_times: dict) -> int:
    """The 8-bit caches' write, decode and prefill; returns the number of failed points."""
    failed = 0
    print(f"\n8-bit caches (float16 queries): the quantising write of {WRITE_TOKENS} tokens")
    for cache in CACHES:
        try:
            t, bw_codes, bw_all = quant_write_case(be, cache)
            print(f"{cache:9s} write {t * 1e6:8.1f} us   codes+scales written {bw_codes / 1e9:6.0f} GB/s   "
                  f"(with the float16 K/V read: {bw_all / 1e9:6.0f} GB/s)")  # fmt: skip
        except Exception as exc:  # noqa: BLE001 - report and go on
            print(f"{cache:9s} write FAILED: {type(exc).__name__}: {exc}")
            failed += 1
        torch.cuda.empty_cache()
    print("\n8-bit decode: achieved bandwidth = bytes of codes + scales read / time; vs the float16 cache's time")
    print(f"{'cache':9s} {'batch':>5s} {'ctx':>6s} {'us':>9s} {'GB/s':>7s} {'f16 us':>9s} {'speedup':>7s} "
          f"{'rel.err':>8s}")  # fmt: skip
    for cache in CACHES:
        for batch in BATCHES:
            for ctx in QUANT_CONTEXTS:
                try:
                    t, bw, err = quant_decode_case(be, cache, batch, ctx, rng)
                except Exception as exc:  # noqa: BLE001
                    print(f"{cache:9s} {batch:5d} {ctx:6d}  FAILED: {type(exc).__name__}: {exc}")
                    failed += 1
                    torch.cuda.empty_cache()
                    continue
                t16 = float16_times.get((batch, ctx))
                ref = f"{t16 * 1e6:9.1f} {t16 / t:7.2f}" if t16 else f"{'-':>9s} {'-':>7s}"
                print(f"{cache:9s} {batch:5d} {ctx:6d} {t * 1e6:9.1f} {bw / 1e9:7.0f} {ref} {err:8.1e}")
    print(f"\n8-bit prefill: chunk {PREFILL_CHUNK} over {PREFILL_CACHED} cached tokens, batch 1")
    for cache in CACHES:
        try:
            tflops, bw = quant_prefill_case(be, cache, rng)
            print(f"{cache:9s} {tflops:6.1f} TFLOP/s   codes+scales {bw / 1e9:6.0f} GB/s (once per call)")
        except Exception as exc:  # noqa: BLE001
            print(f"{cache:9s} FAILED: {type(exc).__name__}: {exc}")
            failed += 1
        torch.cuda.empty_cache()
    return failed


def main() -> int:
    if not torch.cuda.is_available():
        print("bench/gpu_kernels.py needs a CUDA device (torch.cuda.is_available() is False); nothing to measure.")
        ptxas_notes()  # the one part that runs without a GPU
        return 2
    try:
        import cupy  # noqa: F401
    except ImportError:
        print("bench/gpu_kernels.py needs cupy (cupy-cuda12x / cupy-cuda13x); nothing to measure.")
        return 2
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  cupy {cupy.__version__}")
    be = CupyAttentionBackend()
    rng = np.random.default_rng(0)
    copy_bw = copy_bandwidth()
    print(f"device-to-device copy bandwidth: {copy_bw / 1e9:.0f} GB/s")
    print(f"\ndecode: H={H} KVH={KVH} head_dim={HD} block={BLOCK}")
    print(f"{'dtype':9s} {'batch':>5s} {'ctx':>6s} {'ours us':>9s} {'GB/s':>7s} {'%copy':>6s} {'sdpa us':>9s} "
          f"{'speedup':>7s} {'rel.err':>8s}  targets")  # fmt: skip
    misses = 0
    float16_times = {}
    for name, dtype in DTYPES.items():
        for batch in BATCHES:
            for ctx in CONTEXTS:
                try:
                    t, t_sdpa, bw, frac, err = decode_case(be, dtype, batch, ctx, copy_bw, rng)
                except Exception as exc:  # noqa: BLE001 - report and go on with the other points
                    print(f"{name:9s} {batch:5d} {ctx:6d}  FAILED: {type(exc).__name__}: {exc}")
                    misses += 1
                    torch.cuda.empty_cache()
                    continue
                if dtype == torch.float16:
                    float16_times[(batch, ctx)] = t
                ok = (frac >= 0.8 or ctx < 4096) and t < t_sdpa
                misses += not ok
                print(f"{name:9s} {batch:5d} {ctx:6d} {t * 1e6:9.1f} {bw / 1e9:7.0f} {frac:6.1%} {t_sdpa * 1e6:9.1f} "
                      f"{t_sdpa / t:7.2f} {err:8.1e}  {'ok' if ok else 'MISS'}")  # fmt: skip
    print(f"\nprefill: chunk {PREFILL_CHUNK} over {PREFILL_CACHED} cached tokens, batch 1")
    for name, dtype in DTYPES.items():
        try:
            ours, theirs, err = prefill_case(be, dtype, rng)
            print(f"{name:9s} ours {ours:6.1f} TFLOP/s   sdpa {theirs:6.1f} TFLOP/s   rel.err {err:.1e}")
        except Exception as exc:  # noqa: BLE001
            print(f"{name:9s} FAILED: {type(exc).__name__}: {exc}")
    quant_failed = quant_section(be, rng, float16_times)
    print("\ndecode split sweep (float16): us per call by min_partition (keys per split, at least); invariant: "
          "batch_invariant, one split (the worker's default)")
    sweep = (128, 256, 512, 1024, "invariant")
    print(f"{'batch':>5s} {'ctx':>6s} " + " ".join(f"{m:>9}" for m in sweep))
    for batch, ctx in SWEEP_POINTS:
        cells = []
        for m in sweep:
            try:
                # one compiled module for all
                sweep_be = CupyAttentionBackend(be.launcher, batch_invariant=True) if m == "invariant" else \
                    CupyAttentionBackend(be.launcher, min_partition=m)
                t = decode_case(sweep_be, torch.float16, batch, ctx, copy_bw, rng)[0]
                cells.append(f"{t * 1e6:9.1f}")
            except Exception as exc:  # noqa: BLE001
                cells.append(f"{type(exc).__name__[:9]:>9s}")
                torch.cuda.empty_cache()
        print(f"{batch:5d} {ctx:6d} " + " ".join(cells))
    print()
    ptxas_notes()
    print(f"\n{misses} decode point(s) missed a target; {quant_failed} 8-bit point(s) failed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
