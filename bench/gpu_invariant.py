"""Device benchmark of cuda/dense_gemm.cu: what batch invariance costs a GPU's matmuls and RMSNorms.

    python bench/gpu_invariant.py          # well under 2 minutes on an H100 (est.: not run on a GPU yet)

With --batch-invariant on, the lean forward on a GPU runs every float matmul on worker_svc/dense_gpu.py's
CupyDenseKernel.linear (one float32 FMA chain over K per output, 64x64 SIMT tiles: no tensor cores, no split-K) and
every RMSNorm on its rms_norm (one fixed-order sum a row) instead of cuBLAS (F.linear) and torch's ops
(worker_svc/lean_model.py's _norm). This times both on the same tensors.

Matmuls: float16 and bfloat16, the worker's fused per-layer matmuls (pagedserve_cli.bench.flops.ModelShape.gemms:
qkv, o_proj, gate_up, down, lm_head) of the default model (smollm2-135m-instruct's config.json) and of a
Llama-3-8B-like model, at M in {1, 8, 32, 128, 512, 2048} rows (the lm_head only up to M = 128: the runner computes
it for the sampled rows alone, one a running sequence; bench/gemm_peak.py's rule). Per point: ours and cuBLAS in
microseconds, ratio = ours / cuBLAS (> 1: invariance costs that factor), each one's achieved bandwidth and TFLOP/s,
and each one's relative error max|y - ref| / max|ref| against F.linear in float32 (TF32 off) of the same rounded x
and W. TFLOP/s = 2 M N K / time. GB/s = the compulsory bytes (x [M, K] and W [N, K] read once, y [M, N] written
once) / time: the floor of the traffic (our kernel re-reads W once per 64-row tile, mostly from L2), the figure that
matters at small M; at large M the TFLOP/s is.
Norms: rms_norm against _norm (LlamaRMSNorm op for op: several kernels) at M in {1, 32, 2048} x hidden 576 / 4096,
both dtypes; GB/s = (x read + y written + the weight read once) / time; error against the float32 norm.

Timing: CUDA events around one launch, the GPU kept busy (torch.cuda._sleep) ahead of it so that the host's launch
cost (our argument checks, CuPy's launch) is not measured; after warm-up, the median of up to MAX_REPS launches, fewer
for big points (BUDGET_S of GPU time a point and implementation, MIN_REPS at least). Last line:
`invariant_matmul_ratio_m1=X invariant_matmul_ratio_m2048=Y invariant_norm_ratio=Z`, geometric means of ours / torch
time over the shapes and dtypes at M = 1, at M = 2048, and over every norm point.
Without a CUDA device or CuPy: says why and exits 2.
"""

from __future__ import annotations

import math
import statistics
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedserve_cli.bench.flops import ModelShape  # noqa: E402
from worker_svc.dense_gpu import CupyDenseKernel  # noqa: E402
from worker_svc.lean_model import _norm  # noqa: E402

# NOTE: the default model's shape written out: the device machine has no model cache (smollm2-135m-instruct's
# config.json: hidden 576, intermediate 1536, 30 layers, 9 heads, 3 kv heads, head_dim 64, vocab 49152)
MODELS = {
    "smollm2-135m": ModelShape(hidden=576, intermediate=1536, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
                               vocab=49152),
    "llama3-8b": ModelShape(hidden=4096, intermediate=14336, num_layers=32, num_heads=32, num_kv_heads=8,
                            head_dim=128, vocab=128256),
}
ROWS = (1, 8, 32, 128, 512, 2048)
LM_HEAD_MAX_M = 128  # NOTE: the lm_head multiplies the sampled rows only (one a running sequence; default 64)
NORM_ROWS = (1, 32, 2048)
NORM_HIDDEN = (576, 4096)
EPS = 1e-5
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}
WARMUP = 2
MIN_REPS, MAX_REPS = 3, 50
BUDGET_S = 0.1  # timed launches a point and implementation: MIN_REPS..MAX_REPS within about this much GPU time
SLEEP_CYCLES = 1_000_000  # ~0.5 ms of GPU work queued ahead of each timed launch (bench/gpu_kernels.py's)


@dataclass(slots=True, frozen=True)
class MatmulPoint:
    """One matmul: x [m, k] @ w [n, k]^T, `model`'s `name`."""

    model: str
    name: str
    k: int
    n: int
    m: int

    @property
    def label(self) -> str:
        """The weight's name and shape (N x K): one weight a label."""
        return f"{self.model}.{self.name} {self.n}x{self.k}"


def matmul_points() -> list[MatmulPoint]:
    """Every model's matmuls at every M (the lm_head up to LM_HEAD_MAX_M), a weight's points next to each other."""
    return [MatmulPoint(model, name, k, n, m) for model, shape in MODELS.items()
            for name, (k, n) in shape.gemms().items() for m in ROWS if name != "lm_head" or m <= LM_HEAD_MAX_M]


def gemm_flops(m: int, n: int, k: int) -> int:
    """A multiply and an add per (row, output, input)."""
    return 2 * m * n * k


def gemm_bytes(m: int, n: int, k: int, elem: int) -> int:
    """The compulsory traffic of x [m, k] @ w [n, k]^T -> y [m, n], `elem` bytes a value: x and w read, y written."""
    return elem * (m * k + n * k + m * n)


def norm_bytes(m: int, h: int, elem: int) -> int:
    """The compulsory traffic of an RMSNorm of x [m, h]: x read, y written, the weight [h] read once."""
    return elem * (2 * m * h + h)


def geomean(values: list[float]) -> float:
    """The geometric mean of positive `values`; nan where there are none (every point failed)."""
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else float("nan")


def summary_line(m1: list[float], m2048: list[float], norms: list[float]) -> str:
    return (f"invariant_matmul_ratio_m1={geomean(m1):.3f} invariant_matmul_ratio_m2048={geomean(m2048):.3f} "
            f"invariant_norm_ratio={geomean(norms):.3f}")


def timed(fn: Callable[[], object], budget_s: float = BUDGET_S) -> float:
    """Median seconds of one fn() launch on the current stream, each queued behind a GPU sleep; as many launches as
    fit budget_s by the first one's time, MIN_REPS..MAX_REPS."""
    for _ in range(WARMUP):
        fn()
    first = _one_launch(fn)
    reps = min(MAX_REPS, max(MIN_REPS, int(budget_s / max(first, 1e-9))))
    return statistics.median([first] + [_one_launch(fn) for _ in range(reps - 1)])


def _one_launch(fn: Callable[[], object]) -> float:
    """Seconds of one fn() on the GPU (CUDA events on the current stream, where CupyLauncher launches too)."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(SLEEP_CYCLES)  # keep the GPU busy while the host queues the timed work
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3  # NOTE: elapsed_time is in milliseconds


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    """max |y - ref| / max |ref|, in float32."""
    return ((y.float() - ref).abs().max() / ref.abs().max().clamp_min(1e-30)).item()


def matmul_section(kernel) -> tuple[list[float], list[float], int]:
    """The matmul table; returns the ratios at M = 1, at M = 2048, and the number of failed points."""
    print("\nmatmuls: us = median launch; ratio = ours / cuBLAS; err = max|y - ref| / max|ref|, ref float32")
    print(f"{'dtype':8s} {'shape':30s} {'M':>5s} {'ours_us':>10s} {'cublas_us':>10s} {'ratio':>6s} {'ours_GB/s':>9s} "
          f"{'ours_TF/s':>9s} {'cublas_GB/s':>11s} {'cublas_TF/s':>11s} {'ours_err':>8s} {'cublas_err':>10s}")
    ratios: dict[int, list[float]] = {}  # M -> ours / cuBLAS of every point there
    failed = 0
    for dname, dtype in DTYPES.items():
        weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}  # NOTE: one weight (and its float32 copy) at a time
        for p in matmul_points():
            try:
                if p.label not in weights:
                    weights.clear()
                    torch.cuda.empty_cache()
                    w = (torch.randn(p.n, p.k, device="cuda") / p.k ** 0.5).to(dtype)
                    weights[p.label] = (w, w.float())
                ratios.setdefault(p.m, []).append(matmul_point(kernel, p, dname, *weights[p.label]))
            except Exception as exc:  # noqa: BLE001 - report and go on with the other points
                print(f"{dname:8s} {p.label:30s} {p.m:5d}  FAILED: {type(exc).__name__}: {exc}")
                failed += 1
                weights.clear()
                torch.cuda.empty_cache()
    return ratios.get(1, []), ratios.get(2048, []), failed


def matmul_point(kernel, p: MatmulPoint, dname: str, w: torch.Tensor, w32: torch.Tensor) -> float:
    """One row of the matmul table (x of w's dtype); returns ours / cuBLAS time."""
    x = torch.randn(p.m, p.k, device="cuda").to(w.dtype)
    ref = F.linear(x.float(), w32)
    err_ours, err_cublas = rel_err(kernel.linear(x, w), ref), rel_err(F.linear(x, w), ref)
    del ref
    t_ours = timed(lambda: kernel.linear(x, w))
    t_cublas = timed(lambda: F.linear(x, w))
    flops, nbytes = gemm_flops(p.m, p.n, p.k), gemm_bytes(p.m, p.n, p.k, w.element_size())
    print(f"{dname:8s} {p.label:30s} {p.m:5d} {t_ours * 1e6:10.1f} {t_cublas * 1e6:10.1f} {t_ours / t_cublas:6.2f} "
          f"{nbytes / t_ours / 1e9:9.0f} {flops / t_ours / 1e12:9.2f} {nbytes / t_cublas / 1e9:11.0f} "
          f"{flops / t_cublas / 1e12:11.2f} {err_ours:8.1e} {err_cublas:10.1e}")
    return t_ours / t_cublas


def norm_section(kernel) -> tuple[list[float], int]:
    """The RMSNorm table; returns the ratios and the number of failed points."""
    print(f"\nRMSNorm (eps {EPS:g}): ours = rms_norm, torch = lean_model._norm; ratio = ours / torch")
    print(f"{'dtype':8s} {'M':>5s} {'H':>5s} {'ours_us':>10s} {'torch_us':>10s} {'ratio':>6s} {'ours_GB/s':>9s} "
          f"{'torch_GB/s':>10s} {'ours_err':>8s} {'torch_err':>9s}")
    ratios, failed = [], 0
    for dname, dtype in DTYPES.items():
        for h in NORM_HIDDEN:
            for m in NORM_ROWS:
                try:
                    ratios.append(norm_point(kernel, dname, dtype, m, h))
                except Exception as exc:  # noqa: BLE001 - report and go on with the other points
                    print(f"{dname:8s} {m:5d} {h:5d}  FAILED: {type(exc).__name__}: {exc}")
                    failed += 1
    return ratios, failed


def norm_point(kernel, dname: str, dtype: torch.dtype, m: int, h: int) -> float:
    """One row of the norm table; returns ours / torch time."""
    x = torch.randn(m, h, device="cuda").to(dtype)
    weight = (1 + 0.1 * torch.randn(h, device="cuda")).to(dtype)
    xf = x.float()
    ref = weight.float() * xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS)
    err_ours, err_torch = rel_err(kernel.rms_norm(x, weight, EPS), ref), rel_err(_norm(x, weight, EPS), ref)
    t_ours = timed(lambda: kernel.rms_norm(x, weight, EPS))
    t_torch = timed(lambda: _norm(x, weight, EPS))
    nbytes = norm_bytes(m, h, x.element_size())
    print(f"{dname:8s} {m:5d} {h:5d} {t_ours * 1e6:10.1f} {t_torch * 1e6:10.1f} {t_ours / t_torch:6.2f} "
          f"{nbytes / t_ours / 1e9:9.0f} {nbytes / t_torch / 1e9:10.0f} {err_ours:8.1e} {err_torch:9.1e}")
    return t_ours / t_torch


def main() -> int:
    if not torch.cuda.is_available():
        print("bench/gpu_invariant.py needs a CUDA device (torch.cuda.is_available() is False); nothing to measure.")
        return 2
    try:
        import cupy
    except ImportError:
        print("bench/gpu_invariant.py needs cupy (cupy-cuda12x / cupy-cuda13x); nothing to measure.")
        return 2
    # NOTE: the float32 reference without TF32; cuBLAS's float16/bfloat16 matmuls keep torch's defaults (the worker's)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.manual_seed(0)
    print(f"device: {torch.cuda.get_device_name()}  torch {torch.__version__}  cupy {cupy.__version__}")
    kernel = CupyDenseKernel()  # compiles dense_gemm.cu (NVRTC) once
    with torch.inference_mode():
        m1, m2048, failed = matmul_section(kernel)
        norms, norm_failed = norm_section(kernel)
    print(f"\n{failed} matmul point(s) and {norm_failed} norm point(s) failed")
    print(summary_line(m1, m2048, norms))
    return 0


if __name__ == "__main__":
    sys.exit(main())
