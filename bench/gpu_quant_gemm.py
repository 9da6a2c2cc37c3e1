"""Device benchmark of cuda/quant_gemm.cu: the quantised-weight matmul against torch's dequantise-then-matmul.

    python bench/gpu_quant_gemm.py         # well under a minute on an H100/H200

For Q4_0, Q8_0, Q4_K and Q6_K weights of Llama-8B-like shapes (4096 x 4096, 14336 x 4096) and M in {1, 8, 64, 512}
rows of bfloat16 activations: the kernel's time (CUDA events, median of warm launches) next to torch's matmul of the
same weight dequantised at load to bfloat16 (what a GPU worker ran before: `x @ W.T`, cuBLAS), and the kernel's
achieved weight bandwidth (block bytes read per second; W is read once per 8-row tile). Printed ratio = kernel
time / bf16 matmul time (< 1: the kernel is faster). Random blocks (scales ~0.02).
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker_svc.quant.cupy_kernel import CupyQuantKernel  # noqa: E402
from worker_svc.quant.formats import FORMATS, QuantFormat, dequantize  # noqa: E402

SHAPES = [(4096, 4096), (14336, 4096)]  # (N, K)
ROWS = [1, 8, 64, 512]
NAMES = ["q4_0", "q8_0", "q4_k", "q6_k"]


FP16_FIELDS = {"q4_0": (0,), "q8_0": (0,), "q4_k": (0, 2), "q6_k": (208,)}  # byte offsets of the fp16 fields


def random_blocks(rng: np.random.Generator, fmt: QuantFormat, n: int, k: int) -> np.ndarray:
    """uint8 [n, row bytes]: random quants, fp16 scales ~0.02 (finite: a plausible weight)."""
    blocks = rng.integers(0, 256, (n * k // fmt.block_size, fmt.block_bytes), dtype=np.uint8)
    for offset in FP16_FIELDS[fmt.name]:
        scales = (rng.standard_normal(len(blocks)) * 0.02).astype("<f2")
        blocks[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(n, fmt.row_bytes(k))


def timed(fn, reps: int = 50) -> float:
    """Median milliseconds of fn() over reps warm launches."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def main() -> None:
    kernel = CupyQuantKernel()
    rng = np.random.default_rng(0)
    print(f"{torch.cuda.get_device_name()}: bfloat16 activations; ms (median); ratio = kernel / bf16 matmul")
    print(f"{'format':7s} {'N x K':>12s} {'M':>5s} {'kernel':>9s} {'bf16 mm':>9s} {'ratio':>6s} {'W GB/s':>8s}")
    for name in NAMES:
        fmt = FORMATS[name]
        for n, k in SHAPES:
            blocks = random_blocks(rng, fmt, n, k)
            packed = kernel.pack(fmt.ggml_type, torch.from_numpy(blocks), k)
            w16 = torch.from_numpy(dequantize(blocks, fmt)).to(torch.bfloat16).cuda()
            for m in ROWS:
                x = torch.randn(m, k, device="cuda").to(torch.bfloat16)
                t_q = timed(lambda: kernel.linear(fmt.ggml_type, x, packed, n))
                t_mm = timed(lambda: x @ w16.T)
                gbs = packed.numel() * -(-m // 8) / (t_q * 1e-3) / 1e9  # W is read once per 8-row tile
                print(f"{name:7s} {f'{n}x{k}':>12s} {m:5d} {t_q:9.3f} {t_mm:9.3f} {t_q / t_mm:6.2f} {gbs:8.0f}")


if __name__ == "__main__":
    if not torch.cuda.is_available():
        sys.exit("bench/gpu_quant_gemm.py needs a CUDA device")
    main()
