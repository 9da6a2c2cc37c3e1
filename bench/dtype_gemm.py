"""bfloat16 against float32 GEMM speed at the default model's shapes, with this CPU's ISA capped to older ones.

    python bench/dtype_gemm.py                 # README "Which dtype `auto` picks"; ~2 min, 1 thread

Why `--dtype auto` picks bfloat16 only where the CPU has avx512_bf16 or amx_bf16: the decoder layers' matmuls
(SmolLM2-135M: 30 layers of fused QKV 576->960, O 576->576, fused gate/up 576->3072, down 1536->576) at M = 64
rows (a decode batch) and 512 (a prefill chunk), one thread, float32 and bfloat16 through
torch.nn.functional.linear, best of 5 passes.
Each run is a child process with oneDNN (torch's bfloat16 GEMM) capped by ONEDNN_MAX_CPU_ISA, and MKL (float32)
by MKL_ENABLE_INSTRUCTIONS, to what an older CPU has: AMX (all), AVX512-BF16 without AMX (Cooper Lake, Zen 4),
AVX-512 without BF16 (Skylake-SP .. Ice Lake), AVX2. A cap above what this CPU has runs what it has. Prints one
`dtype_gemm isa=... m=... f32_ms=... bf16_ms=... bf16_speedup=...` line per case.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

SHAPES = ((576, 960), (576, 576), (576, 3072), (1536, 576))  # (in, out) of one layer's matmuls
CAPS = {  # name: (ONEDNN_MAX_CPU_ISA, MKL_ENABLE_INSTRUCTIONS)
    "amx": ("ALL", "AVX512"),
    "avx512_bf16": ("AVX512_CORE_BF16", "AVX512"),
    "avx512": ("AVX512_CORE", "AVX512"),
    "avx2": ("AVX2", "AVX2"),
}


def model_us(dtype, m: int, num_layers: int) -> float:
    """Microseconds for `num_layers` layers' matmuls at m rows, each layer its own weights (best of 5 passes).
    NOTE: distinct weights per layer, as in the model: 30 layers of them (440 MB in float32) stay out of the
    caches, so a decode batch's pass reads its weights from memory as a real decode step does."""
    import torch

    x = {k: torch.randn(m, k).to(dtype) for k, _ in SHAPES}
    layers = [[(x[k], torch.randn(n, k).to(dtype)) for k, n in SHAPES] for _ in range(num_layers)]

    def one_pass() -> None:
        for layer in layers:
            for a, w in layer:
                torch.nn.functional.linear(a, w)

    one_pass()
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        one_pass()
        best = min(best, time.perf_counter() - t0)
    return best * 1e6


def child(cap: str, ms: list[int], num_layers: int) -> None:
    import torch

    torch.set_num_threads(1)
    for m in ms:
        f32, bf16 = model_us(torch.float32, m, num_layers), model_us(torch.bfloat16, m, num_layers)
        print(f"dtype_gemm isa={cap} m={m} f32_ms={f32 / 1e3:.1f} bf16_ms={bf16 / 1e3:.1f} "
              f"bf16_speedup={f32 / bf16:.2f}",
              flush=True)


def main() -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--caps", default=",".join(CAPS), help=f"comma-separated, of {','.join(CAPS)}")
    ap.add_argument("--m", default="64,512", help="rows per matmul, comma-separated")
    ap.add_argument("--num-layers", type=int, default=30, help="layers of distinct weights (the model's: 30)")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args()
    ms = [int(m) for m in args.m.split(",")]
    if args.child:
        child(args.child, ms, args.num_layers)
        return 0
    for cap in args.caps.split(","):
        onednn, mkl = CAPS[cap]
        env = {**os.environ, "ONEDNN_MAX_CPU_ISA": onednn, "MKL_ENABLE_INSTRUCTIONS": mkl}
        subprocess.run([sys.executable, __file__, "--child", cap, "--m", args.m, "--num-layers", str(args.num_layers)],
                       env=env, check=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
