"""The lean forward's matmuls: each weight laid out once, at load, for the fastest CPU GEMM of its dtype.

Measured on the default model's shapes (one thread, CPU time; docs/performance.md, "What was tried": GEMM
layouts): F.linear hands MKL a transposed [out, in] weight that it repacks on every call, which costs most at the
decode step's 16-64 rows. So on the CPU:
- float32 layer weights are stored transposed, [in, out] contiguous, and run as torch.mm / addmm (1.1-1.6x F.linear
  at 16-64 rows, even at 512); the transformers modules' weights become views of that storage (no second copy).
- bfloat16 weights, and the float32 lm_head (K = hidden is short, N = vocab is long), go through oneDNN with the
  weight reordered once into its blocked layout (`mkldnn._reorder_linear_weight`, then `_linear_pointwise`): 1.8x
  F.linear at 16-64 bfloat16 rows (AMX or AVX512-BF16), 1.3-1.8x for the float32 lm_head. That is a second copy
  of those weights (the modules keep theirs for the transformers path).
Elsewhere (a GPU, a CPU build without oneDNN, a kernel that fails its self-check) F.linear, unchanged.

MKL's sgemm on the transposed float32 weight and oneDNN's prepacked one read the weights at about half the plain
read rate at a decode batch's 4-32 rows and overlap neither the read nor the arithmetic at 64. So where the copies
fit (F32_COPY_SHARE of the memory available at load: a small model on a CPU box), float32 weights get a copy packed
for our panel kernel (f32_gemm.cpp, AVX-512), which runs layer calls of up to F32_PANEL_ROWS rows and the lm_head's
of up to F32_VOCAB_PANEL_ROWS (the default model's 120 layer matmuls, weights read from memory, 2 threads,
docs/performance.md's matmul chain study: 1 / 16 / 64 / 256 rows 15.9 / 23.1 / 44.7 / 138.6 ms against the best of
torch.mm and oneDNN 14.6 / 28.0 / 52.6 / 149.2; at 512 all ~270, and in process a 512-token prefill step 2% slower:
prefill steps keep MKL; the lm_head at 64 rows 9.8 against oneDNN's 12.3, at 256 47.6 against 43.7). On a CPU
without AVX-512, layer weights get oneDNN's prepacked float32 copy instead, for calls of F32_ONEDNN_ROWS rows
(16 rows 73.8 -> 47.8 ms on 1 thread, 37.9 -> 27.2 on 2, against torch.mm).

oneDNN's prepacked kernel falls off a cliff on some shapes past a few hundred rows (a prefill chunk): measured
here (bfloat16, 2 threads, AMX), o_proj and down (N = 576) ran 1.4x slower than F.linear at 384-512 rows while
1.5x faster at 64. Which shapes and where depends on the CPU, so each onednn shape is timed once at load at
PLAIN_ROWS rows (`plain_rows`), and from the row count where F.linear won clearly the layer calls F.linear on the
[out, in] weight the transformers module holds anyway (no copy). NOTE: bfloat16 GEMMs were not batch invariant
before this either (oneDNN's own kernels give another row's bits at 64 rows than at 512).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import structlog
import torch
import torch.nn.functional as F

from worker_svc.dense_gpu import DENSE_DTYPES, gpu_dense_kernel

log = structlog.get_logger("pagedserve.worker")

KINDS = ("linear", "mm", "onednn", "dense")
UNBOUNDED = 2**62  # an M-invariant kernel's row bound under batch invariance: every call
PLAIN_ROWS = (256, 384, 512)  # the row counts an onednn shape is timed at against F.linear
PLAIN_MARGIN = 1.15  # F.linear must be this much faster at a row count (and every larger one) to take it
# Shapes past this many FLOPs a 512-row call keep oneDNN untimed: timing them would add seconds to a large model's
# load (a 7B MLP's 512-row call is ~90 GFLOP), and the cliff was measured on small-N shapes only.
PLAIN_MAX_FLOP = 4e9
# Calls of at most this many rows take the AMX kernel (amx_gemm.cpp) where the CPU has AMX-BF16: the default model's
# 121 decode matmuls back to back, weights read from memory (2 threads, best of 4; docs/performance.md, "What was
# tried": the matmul chain) took
# 11.4 / 12.2 / 16.8 ms at 1 / 32 / 64 rows against oneDNN's 14.0 / 16.3 / 18.1, and 24.6 against 24.1 at 96 rows,
# 42.7 against 34.6 at 256: a prefill chunk keeps oneDNN.
AMX_MAX_ROWS = 64
F32_ONEDNN_ROWS = (4, 32)  # float32 calls of this many rows (inclusive) take the prepacked copy where there is one
F32_COPY_SHARE = 0.25  # the prepacked float32 copies may take this share of the memory available at load
F32_PANEL_ROWS = 256  # float32 layer calls of at most this many rows take the panel kernel where there is a copy
F32_VOCAB_PANEL_ROWS = 128  # the float32 lm_head's calls of at most this many rows take its panel copy


@dataclass(slots=True)
class Linear:
    """y = x @ W.T + b for x [T, in], with W held in the layout `kind` wants."""

    kind: str  # one of KINDS
    # linear: [out, in]; mm: [in, out] contiguous; onednn: oneDNN's reordered tensor; dense: [out, in] contiguous
    weight: torch.Tensor
    bias: torch.Tensor | None
    out_features: int
    plain: torch.Tensor | None = None  # onednn only: the [out, in] weight F.linear takes from plain_rows rows on
    plain_rows: int = 0
    amx: torch.Tensor | None = None  # onednn only: the weight in the AMX kernel's order, for calls of <= AMX_MAX_ROWS
    ops: object | None = None  # the CpuOps that runs `amx` or `panels`; dense: the GPU's dense_gpu.CupyDenseKernel
    small: torch.Tensor | None = None  # mm only: oneDNN's prepacked copy, for calls of F32_ONEDNN_ROWS rows
    panels: torch.Tensor | None = None  # the panel kernel's copy (f32_gemm.cpp: float32 or bfloat16), run by `ops`
    panel_rows: int = 0  # calls of at most this many rows take `panels`
    amx_rows: int = AMX_MAX_ROWS  # calls of at most this many rows take `amx`
    # Batch invariant: every call, whatever its row count, runs one M-invariant kernel (the panels or AMX), so a
    # row's bits do not depend on the rows beside it (--batch-invariant on).
    invariant: bool = False

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        # NOTE: lean_stack._matmul makes the same choice of the library's kernels for its C++ layer loop
        if self.kind == "dense":
            return self.ops.linear(x, self.weight, self.bias)
        if self.panels is not None and x.shape[0] <= self.panel_rows:
            return self.ops.panel_linear(x.contiguous(), self.panels, self.out_features, self.bias)
        if self.kind == "mm":
            if self.small is not None and F32_ONEDNN_ROWS[0] <= x.shape[0] <= F32_ONEDNN_ROWS[1]:
                return torch.ops.mkldnn._linear_pointwise(x, self.small, self.bias, "none", [], "")
            return torch.mm(x, self.weight) if self.bias is None else torch.addmm(self.bias, x, self.weight)
        if self.kind == "onednn":
            if self.amx is not None and x.shape[0] <= self.amx_rows:
                return self.ops.amx_linear(x.contiguous(), self.amx, self.out_features, self.bias)
            if self.plain is not None and x.shape[0] >= self.plain_rows:
                return F.linear(x, self.plain, self.bias)
            return torch.ops.mkldnn._linear_pointwise(x, self.weight, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


def transposed(weight: torch.Tensor) -> torch.Tensor:
    """weight [out, in] stored as [in, out] contiguous, returned as the [out, in] view of that storage."""
    return weight.t().contiguous().t()


def onednn_available(dtype: torch.dtype) -> bool:
    """Whether oneDNN's prepacked linear runs here and agrees with F.linear (checked once per dtype)."""
    if dtype not in _ONEDNN_OK:
        _ONEDNN_OK[dtype] = _check_onednn(dtype)
    return _ONEDNN_OK[dtype]


_ONEDNN_OK: dict[torch.dtype, bool] = {}


def _check_onednn(dtype: torch.dtype) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        w = torch.randn(48, 32, generator=gen).to(dtype)
        b = torch.randn(48, generator=gen).to(dtype)
        x = torch.randn(5, 32, generator=gen).to(dtype)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 5)
        got = torch.ops.mkldnn._linear_pointwise(x, packed, b, "none", [], "")
    except (RuntimeError, AttributeError):
        return False
    want = F.linear(x.float(), w.float(), b.float())
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    return bool(got.shape == want.shape and torch.allclose(got.float(), want, atol=tol, rtol=tol))


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, *, vocab: bool = False,
                f32_copy: bool = False, invariant: bool = False, dense_kernel=None) -> Linear:
    """The fastest layout for `weight` [out, in] on its device; vocab=True for the lm_head (a short K, a long N);
    f32_copy: a float32 weight also gets the panel kernel's copy (else, a layer's: oneDNN's prepacked copy) for
    small calls (f32_copies_fit); invariant: one M-invariant kernel for every call where there is one (a GPU:
    dense_kernel, default dense_gpu.gpu_dense_kernel's; a CPU: invariant_linear), else the fastest layout and
    Linear.invariant False. dense_kernel (tests: the GPU kernel on the host shim) runs the weight wherever it is."""
    out = int(weight.shape[0])
    weight, bias = weight.detach(), None if bias is None else bias.detach()
    if invariant and (dense_kernel is not None or weight.device.type == "cuda"):
        lin = dense_linear(weight, bias, dense_kernel)
        if lin is not None:
            return lin
    if weight.device.type != "cpu":
        return Linear("linear", weight, bias, out)
    if invariant:
        lin = invariant_linear(weight, bias, f32_copy)
        if lin is not None:
            return lin
    if (weight.dtype == torch.bfloat16 or (vocab and weight.dtype == torch.float32)) and \
            onednn_available(weight.dtype):
        # NOTE: the row count is only a hint for the blocked layout; any row count runs on it.
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, 64)
        rows = None if vocab else _calibrated_plain_rows(weight, bias, packed)
        ops = amx_ops(weight)
        amx = None if ops is None else ops.amx_pack(weight.contiguous())
        lin = Linear("onednn", packed, bias, out, weight if rows else None, rows or 0, amx, ops)
        return _with_panels(lin, weight, F32_VOCAB_PANEL_ROWS) if vocab and f32_copy else lin
    if weight.dtype == torch.float32 and not vocab:
        # NOTE: a [in, out] contiguous tensor: when `weight` is already the view transposed() made, no copy
        wt = weight.t() if weight.t().is_contiguous() else weight.t().contiguous()
        lin = Linear("mm", wt, bias, out)
        if f32_copy and fast_panel_ops(weight) is not None:
            return _with_panels(lin, weight, F32_PANEL_ROWS)
        if f32_copy and onednn_available(torch.float32):
            lin.small = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), F32_ONEDNN_ROWS[1])
        return lin
    lin = Linear("linear", weight, bias, out)
    return _with_panels(lin, weight, F32_VOCAB_PANEL_ROWS) if vocab and f32_copy else lin


def invariant_linear(weight: torch.Tensor, bias: torch.Tensor | None, f32_copy: bool) -> Linear | None:
    """A Linear whose every call runs one M-invariant kernel: bfloat16 on AMX tiles (amx_gemm.cpp) or, on a CPU
    without AMX, on the bfloat16 panels; float32 on the panels where their copy fits (f32_copy). None where this
    CPU has no such kernel for the weight.

    NOTE: the cost is the prefill's: oneDNN's and MKL's kernels are faster there at 256-512 rows (AMX 42.7 ms
    against oneDNN's 34.6 for the default model's matmuls at 256 rows; docs/performance.md, the matmul chain), and
    which of their kernels runs, so the order of each row's sums, depends on the row count."""
    out = int(weight.shape[0])
    if weight.dtype == torch.bfloat16:
        ops = amx_ops(weight)
        if ops is not None:
            return Linear("onednn", weight, bias, out, amx=ops.amx_pack(weight.contiguous()), ops=ops,
                          amx_rows=UNBOUNDED, invariant=True)
        ops = panel_ops(weight)
        if ops is not None:
            return Linear("linear", weight, bias, out, ops=ops, panels=ops.bf16_pack(weight),
                          panel_rows=UNBOUNDED, invariant=True)
        return None
    ops = panel_ops(weight) if weight.dtype == torch.float32 and f32_copy else None
    if ops is not None:
        wt = weight.t() if weight.t().is_contiguous() else weight.t().contiguous()
        return Linear("mm", wt, bias, out, ops=ops, panels=ops.f32_pack(weight), panel_rows=UNBOUNDED,
                      invariant=True)
    return None


def dense_linear(weight: torch.Tensor, bias: torch.Tensor | None, kernel=None) -> Linear | None:
    """A Linear whose every call runs the GPU's M-invariant matmul (cuda/dense_gemm.cu; `kernel`, default the
    weight's GPU's), or None where it cannot: no CuPy, or a dtype it has no entry for."""
    if kernel is None:
        kernel = gpu_dense_kernel(weight.device)
    ok = weight.dtype in DENSE_DTYPES and (bias is None or bias.dtype == weight.dtype)
    if kernel is None or not ok:
        return None
    return Linear("dense", weight.contiguous(), bias, int(weight.shape[0]), ops=kernel, invariant=True)


def _with_panels(lin: Linear, weight: torch.Tensor, rows: int) -> Linear:
    """`lin` with the panel kernel's copy of `weight` for calls of at most `rows` rows, where the kernel runs."""
    ops = fast_panel_ops(weight)
    if ops is not None:
        lin.panels, lin.panel_rows, lin.ops = ops.f32_pack(weight), rows, ops
    return lin


def f32_copies_fit(num_bytes: int) -> bool:
    """Whether prepacked copies of `num_bytes` of float32 weights fit in F32_COPY_SHARE of the memory available
    now (/proc/meminfo's MemAvailable; elsewhere, no copies)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration, ValueError, IndexError):
        return False
    fits = num_bytes <= F32_COPY_SHARE * available
    panels = fits and panel_kernel() is not None
    log.info("float32 small-call copies", fit=fits, gib=round(num_bytes / 2**30, 2),
             available_gib=round(available / 2**30, 1), kernel="panels" if panels else "onednn",
             rows=[1, F32_PANEL_ROWS] if panels else list(F32_ONEDNN_ROWS))
    return fits


def amx_ops(weight: torch.Tensor):
    """The CpuOps whose AMX kernel can run `weight` [out, in] (bfloat16, out % 16 == 0, in % 32 == 0) in this
    process, after a self-check against F.linear; else None (no AMX or no kernel library)."""
    if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.shape[0] % 16 or weight.shape[1] % 32:
        return None
    if not _AMX_OK:
        _AMX_OK.append(_check_amx())
    return _AMX_OK[0]


_AMX_OK: list = []


def panel_ops(weight: torch.Tensor):
    """The CpuOps whose panel kernel can run `weight` in this process (a float32 or bfloat16 CPU weight):
    panel_kernel()'s, else None."""
    ok = weight.dtype in (torch.float32, torch.bfloat16) and weight.device.type == "cpu"
    return panel_kernel() if ok else None


def fast_panel_ops(weight: torch.Tensor):
    """panel_ops(weight) where its kernel is the AVX-512 one, else None: the layouts chosen for speed (batch
    invariance off) take the panels there only. NOTE: the AVX2 kernel was written for batch invariance and not timed
    against oneDNN's small-call copy."""
    ops = panel_ops(weight)
    return ops if ops is not None and ops.panel_width() == 512 else None


def panel_kernel():
    """The CpuOps that runs the panel kernel in this process (AVX-512, or AVX2 + FMA), after a self-check against
    F.linear (once); else None."""
    if not _PANELS_OK:
        _PANELS_OK.append(_check_panels())
    return _PANELS_OK[0]


_PANELS_OK: list = []


def _check_panels():
    from worker_svc.cpu_ops import shared_ops  # NOTE: here, not at the top: cpu_ops builds the kernel library

    ops = shared_ops()
    if ops is None or not ops.panel_width():
        return None
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(53, 40, generator=gen)
    b = torch.randn(53, generator=gen)
    x = torch.randn(11, 40, generator=gen)
    ok = torch.allclose(ops.panel_linear(x, ops.f32_pack(w), 53, b), F.linear(x, w, b), atol=1e-4, rtol=1e-4)
    wb, bb, xb = w.bfloat16(), b.bfloat16(), x.bfloat16()
    got = ops.panel_linear(xb, ops.bf16_pack(wb), 53, bb).float()
    ok = ok and torch.allclose(got, F.linear(xb.float(), wb.float(), bb.float()), atol=5e-2, rtol=1e-2)
    log.info("panel matmul", available=bool(ok), width=ops.panel_width(), max_rows=F32_PANEL_ROWS)
    return ops if ok else None


def _check_amx():
    from worker_svc.cpu_ops import shared_ops  # NOTE: here, not at the top: cpu_ops builds the kernel library

    ops = shared_ops()
    if ops is None or not ops.amx_available():
        return None
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(48, 64, generator=gen).bfloat16()
    b = torch.randn(48, generator=gen).bfloat16()
    x = torch.randn(21, 64, generator=gen).bfloat16()
    got = ops.amx_linear(x, ops.amx_pack(w), 48, b).float()
    want = F.linear(x.float(), w.float(), b.float())
    ok = torch.allclose(got, want, atol=5e-2, rtol=1e-2)
    log.info("amx matmul", available=bool(ok), max_rows=AMX_MAX_ROWS)
    return ops if ok else None


def choose_plain_rows(seconds: dict[int, tuple[float, float]], margin: float = PLAIN_MARGIN) -> int | None:
    """From {rows: (onednn s, F.linear s)}: the fewest rows from which on F.linear is `margin` times faster at
    every measured row count, or None."""
    best = None
    for rows in sorted(seconds, reverse=True):
        onednn_s, plain_s = seconds[rows]
        if plain_s * margin >= onednn_s:
            break
        best = rows
    return best


_PLAIN_ROWS: dict[tuple, int | None] = {}


def _calibrated_plain_rows(weight: torch.Tensor, bias: torch.Tensor | None, packed: torch.Tensor) -> int | None:
    """choose_plain_rows over this shape's timings (once per shape, dtype and thread count: ~10 ms), or None
    untimed for a shape past PLAIN_MAX_FLOP."""
    if 2 * max(PLAIN_ROWS) * weight.shape[0] * weight.shape[1] > PLAIN_MAX_FLOP:
        return None
    key = (tuple(weight.shape), weight.dtype, bias is not None, torch.get_num_threads())
    if key not in _PLAIN_ROWS:
        seconds = {}
        for rows in PLAIN_ROWS:
            x = torch.randn(rows, weight.shape[1], generator=torch.Generator().manual_seed(rows)).to(weight.dtype)
            seconds[rows] = (_best_of(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")),
                             _best_of(lambda: F.linear(x, weight, bias)))
        _PLAIN_ROWS[key] = choose_plain_rows(seconds)
        # NOTE: debug: per-shape timings a user cannot act on (PAGEDSERVE_LOG_LEVEL=debug shows them)
        log.debug("linear layout timed", out_features=int(weight.shape[0]), in_features=int(weight.shape[1]),
                  dtype=str(weight.dtype).removeprefix("torch."), plain_from_rows=_PLAIN_ROWS[key],
                  ms={rows: [round(t * 1e3, 3) for t in pair] for rows, pair in seconds.items()})
    return _PLAIN_ROWS[key]


def _best_of(fn, repeats: int = 5) -> float:
    """The fastest of `repeats` calls after a warm-up (best-of: a busy neighbour only slows some)."""
    with torch.inference_mode():
        fn()
        best = float("inf")
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            best = min(best, time.perf_counter() - t0)
    return best
