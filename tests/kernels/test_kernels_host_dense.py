"""cuda/dense_gemm.cu (the GPU's batch-invariant float matmul and RMSNorm) on the host shim, without a GPU, through
CupyDenseKernel.

0. nvcc builds every entry for sm_80 and sm_90 without register spills.
1. Bit for bit against tests/support/dense_reference.py (the contract at the top of the .cu, in numpy with an exact
   FMA): float32 / float16 / bfloat16, M = 1, M and N past one 64 x 64 tile and not multiples of it, K not a multiple
   of the 16-wide chunk, with and without a bias; the RMSNorm for thread counts 32, 64 and 256.
2. Accuracy: within a derived float64 bound (gamma_{K+1} of sum |x w| + |b|, plus the rounding into the dtype).
3. Batch invariance: a row alone gives the bits it gives inside batches of 3, 17 and 70 rows with other rows beside
   it; the RMSNorm's row alone the bits of the same row among 9.
4. Bad calls are refused naming the argument.
Small shapes only: the shim runs every CUDA thread as a fiber.
"""

from __future__ import annotations

import secrets

import numpy as np
import pytest
import torch

from tests.support.cuda import assert_nvcc_entries_without_spills, bits
from tests.support.dense_reference import dense_gemm, gemm_bound, rms_norm, rms_norm_bound, rms_norm_f64
from worker_svc.attention.cupy_backend import DTYPE_TAGS
from worker_svc.dense_gpu import CupyDenseKernel

pytestmark = pytest.mark.timeout(600)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES = [(1, 5, 7), (9, 70, 33), (70, 13, 40)]  # (M, N, K): a lone row, two column tiles, two row tiles
EPS = 1e-6


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_dense_gemm_nvcc_builds_without_spills(builds, arch):
    rc, log = builds.result(f"dense_{arch}")  # conftest's key for dense_gemm.cu
    assert rc == 0, log
    assert_nvcc_entries_without_spills(log, {f"{k}_{t}" for k in ("dense_gemm", "rms_norm") for t in ("f32", "f16", "bf16")})
    assert "warning" not in log.lower(), log


def fresh_rng():
    seed = secrets.randbits(63)
    return np.random.default_rng(seed), seed


def randn(rng, shape, dtype, scale: float = 1.0, shift: float = 0.0) -> torch.Tensor:
    return torch.from_numpy((rng.standard_normal(shape) * scale + shift).astype(np.float32)).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_gemm_is_the_contract_bit_for_bit_and_within_the_float64_bound(launcher, dtype):
    rng, seed = fresh_rng()
    kernel = CupyDenseKernel(launcher)
    for m, n, k in SHAPES:
        x, w = randn(rng, (m, k), dtype), randn(rng, (n, k), dtype, 0.1)
        bias = randn(rng, (n,), dtype) if rng.integers(2) else None
        out = kernel.linear(x, w, bias)
        b32 = None if bias is None else bias.float().numpy()
        expected = torch.from_numpy(dense_gemm(x.float().numpy(), w.float().numpy(), b32)).to(dtype)
        assert out.dtype == dtype and out.shape == (m, n)
        assert torch.equal(bits(out), bits(expected)), f"seed {seed}, shape {(m, n, k)}, bias {bias is not None}"
        assert launcher.launches[-1] == (f"dense_gemm_{DTYPE_TAGS[dtype]}", (-(-n // 64), -(-m // 64), 1), 256)
        x64, w64 = x.double().numpy(), w.double().numpy()
        b64 = None if bias is None else bias.double().numpy()
        ref = x64 @ w64.T + (0 if b64 is None else b64[None, :])
        err = np.abs(out.double().numpy() - ref)
        assert (err <= gemm_bound(x64, w64, b64, ref, dtype)).all(), f"seed {seed}, shape {(m, n, k)}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_dense_gemm_row_alone_equals_row_in_any_batch(launcher, dtype):
    rng, seed = fresh_rng()
    kernel = CupyDenseKernel(launcher)
    n, k = 67, 40  # two column tiles, a short last K chunk
    w, bias = randn(rng, (n, k), dtype, 0.1), randn(rng, (n,), dtype)
    row = randn(rng, (1, k), dtype)
    alone = kernel.linear(row, w, bias)
    for m in (3, 17, 70):
        at = int(rng.integers(m))
        x = randn(rng, (m, k), dtype, 10.0)  # other rows, of other magnitudes
        x[at] = row[0]
        batch = kernel.linear(x, w, bias)
        assert torch.equal(bits(batch[at:at + 1]), bits(alone)), f"seed {seed}, batch {m}, row {at}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_is_the_contract_bit_for_bit_and_within_the_float64_bound(launcher, dtype):
    rng, seed = fresh_rng()
    for threads, h in ((32, 40), (64, 200), (256, 96)):  # rows shorter and longer than a CTA
        kernel = CupyDenseKernel(launcher, norm_threads=threads)
        x, weight = randn(rng, (5, h), dtype, 3.0), randn(rng, (h,), dtype, 0.1, 1.0)
        out = kernel.rms_norm(x, weight, EPS)
        assert torch.equal(bits(out), bits(rms_norm(x, weight, EPS, threads))), f"seed {seed}, threads {threads}"
        assert launcher.launches[-1] == (f"rms_norm_{DTYPE_TAGS[dtype]}", (5, 1, 1), threads)
        ref = rms_norm_f64(x, weight, EPS)
        err = np.abs(out.double().numpy() - ref)
        assert (err <= rms_norm_bound(ref, h, dtype)).all(), f"seed {seed}, threads {threads}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_row_alone_equals_row_among_nine_and_keeps_the_shape(launcher, dtype):
    rng, seed = fresh_rng()
    kernel = CupyDenseKernel(launcher, norm_threads=64)
    x, weight = randn(rng, (9, 3, 50), dtype), randn(rng, (50,), dtype, 0.1, 1.0)  # [T, heads, hd] as q_norm's
    batch = kernel.rms_norm(x, weight, EPS)
    assert batch.shape == x.shape and batch.dtype == dtype
    for t in (0, 4, 8):
        alone = kernel.rms_norm(x[t:t + 1].clone(), weight, EPS)
        assert torch.equal(bits(alone), bits(batch[t:t + 1])), f"seed {seed}, row {t}"


def test_dense_gemm_strided_rows_and_empty_batch(launcher):
    """A non-contiguous x (every other row, a column window) gives the rows' own bits; M = 0 launches nothing."""
    rng, seed = fresh_rng()
    kernel = CupyDenseKernel(launcher)
    w = randn(rng, (6, 24), torch.float16)
    x = randn(rng, (8, 40), torch.float16)[::2, 8:32]
    assert torch.equal(kernel.linear(x, w), kernel.linear(x.contiguous(), w)), f"seed {seed}"
    launches = len(launcher.launches)
    assert kernel.linear(x[:0], w).shape == (0, 6) and len(launcher.launches) == launches


def test_dense_kernel_refuses_bad_calls_by_name(launcher):
    kernel = CupyDenseKernel(launcher)
    x, w = torch.zeros((2, 8)), torch.zeros((4, 8))
    with pytest.raises(ValueError, match="norm_threads 48"):
        CupyDenseKernel(launcher, norm_threads=48)
    with pytest.raises(ValueError, match="x is a float32"):
        kernel.linear(x.double(), w)
    with pytest.raises(ValueError, match="x is a float32"):
        kernel.linear(x[0], w)
    with pytest.raises(ValueError, match="weight is a 2-D torch.float32"):
        kernel.linear(x, w.half())
    with pytest.raises(ValueError, match="weight is \\[N, 6\\], x has 8 features"):
        kernel.linear(x, torch.zeros((4, 6)))
    with pytest.raises(ValueError, match="weight is not contiguous"):
        kernel.linear(x, torch.zeros((8, 4)).t())
    with pytest.raises(ValueError, match="bias has 3 values for 4 outputs"):
        kernel.linear(x, w, torch.zeros(3))
    with pytest.raises(ValueError, match="bias is a 1-D"):
        kernel.linear(x, w, torch.zeros(4, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="weight is on meta"):
        kernel.linear(x, torch.zeros((4, 8), device="meta"))
    with pytest.raises(ValueError, match="weight has 7 values, x rows 8"):
        kernel.rms_norm(x, torch.zeros(7), EPS)
    with pytest.raises(ValueError, match="weight is a 1-D"):
        kernel.rms_norm(x, torch.zeros(8, dtype=torch.float16), EPS)
    with pytest.raises(ValueError, match="eps"):
        kernel.rms_norm(x, torch.zeros(8), float("nan"))
    with pytest.raises(ValueError, match="H = 0"):
        kernel.rms_norm(torch.zeros((2, 0)), torch.zeros(0), EPS)
