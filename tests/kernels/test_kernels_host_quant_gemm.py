"""cuda/quant_gemm.cu (the GPU's quantised-weight matmul) on the host shim, without a GPU, through CupyQuantKernel.

0. nvcc builds every entry for sm_80 and sm_90 without register spills (test_kernels_nvrtc.py: NVRTC, where found).
1. Bit for bit against tests/support/quant_gemm_reference.py (the contract at the top of the .cu, in numpy with an
   exact FMA): every format x float32 / float16 / bfloat16 activations, M = 1 and M not a multiple of the kernel's
   8-row tile, N not a multiple of the CTA's warps, K of 1 to 16 lane rounds (K-quants: 256 and 512), with and
   without a bias, fp16 block fields of any finite bit pattern (subnormals and zeros included).
2. Batch invariance: a row alone gives the bits it gives inside a batch, whatever the warps a CTA.
3. Accuracy: within a float64 bound of x @ W.T on formats.dequantize's weights.
4. Bad calls are refused naming what is wrong.
Small shapes only (K <= 512, N <= 64): the shim runs every CUDA thread as a fiber.
"""

from __future__ import annotations

import secrets

import numpy as np
import pytest
import torch

from tests.support.cuda import assert_nvcc_entries_without_spills, bits
from tests.support.hf_quant import q8_0_blocks, rtn
from tests.support.quant_blocks import random_blocks
from tests.support.quant_gemm_reference import quant_gemm
from worker_svc.attention.cupy_backend import DTYPE_TAGS
from worker_svc.quant.cupy_kernel import CupyQuantKernel
from worker_svc.quant.formats import FORMATS, dequantize
from worker_svc.quant.int_groups import IntGroups, to_blocks

pytestmark = pytest.mark.timeout(600)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SHAPES_32 = [(1, 5, 32), (9, 13, 96), (3, 64, 512)]  # (M, N, K) for the 32-weight formats
SHAPES_K = [(1, 5, 256), (9, 13, 512)]  # K-quants: whole 256-weight super-blocks


@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_quant_gemm_nvcc_builds_without_spills(builds, arch):
    rc, log = builds.result(f"quant_{arch}")  # conftest's key for quant_gemm.cu
    assert rc == 0, log
    assert_nvcc_entries_without_spills(log, {f"quant_gemm_{f}_{t}" for f in FORMATS for t in ("f32", "f16", "bf16")})


def fresh_rng():
    seed = secrets.randbits(63)
    return np.random.default_rng(seed), seed


def shapes(fmt):
    return SHAPES_K if fmt.block_size == 256 else SHAPES_32


def run(kernel, fmt, x: torch.Tensor, blocks: np.ndarray, bias: torch.Tensor | None = None) -> torch.Tensor:
    k = x.shape[1]
    packed = kernel.pack(fmt.ggml_type, torch.from_numpy(blocks), k)
    return kernel.linear(fmt.ggml_type, x, packed, blocks.shape[0], bias)


def activations(rng, m, k, dtype) -> torch.Tensor:
    return torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).to(dtype)


def as_dtype(y32: np.ndarray, dtype) -> torch.Tensor:
    """The contract's last step: float32 -> the activation dtype, round to nearest even (torch's cast)."""
    return torch.from_numpy(y32).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(FORMATS))
def test_quant_gemm_is_the_contract_bit_for_bit(launcher, name, dtype):
    fmt = FORMATS[name]
    rng, seed = fresh_rng()
    kernel = CupyQuantKernel(launcher, warps=int(rng.integers(1, 5)))
    for m, n, k in shapes(fmt):
        blocks = random_blocks(rng, fmt, n, k)  # any finite fp16 fields
        x = activations(rng, m, k, dtype)
        bias = activations(rng, 1, n, dtype)[0] if rng.integers(2) else None
        out = run(kernel, fmt, x, blocks, bias)
        expected = as_dtype(quant_gemm(x.float().numpy(), blocks, fmt, None if bias is None else bias.float().numpy()),
                            dtype)
        assert out.dtype == dtype and out.shape == (m, n)
        assert torch.equal(bits(out), bits(expected)), f"seed {seed}, shape {(m, n, k)}, bias {bias is not None}"
        assert launcher.launches[-1] == (f"quant_gemm_{name}_{DTYPE_TAGS[dtype]}",
                                         (-(-n // kernel.warps), -(-m // 8), 1), 32 * kernel.warps)


@pytest.mark.parametrize("dtype", DTYPES)
def test_quant_gemm_asymmetric_int4_as_q5_0_gives_the_bits_of_its_q8_0_blocks(launcher, dtype):
    # a Hugging Face asymmetric int4 weight (worker_svc/quant/int_groups.py: Q5_0, once Q8_0 holding int8 q - z):
    # both dequantise to the same float32 weights, so the kernel's outputs are the same bits
    rng, seed = fresh_rng()
    q, scale, zero = rtn(rng.standard_normal((13, 96)).astype(np.float32), 4, 32, False)
    groups = IntGroups(32, q, scale.astype(np.float32), zero.astype(np.int32))
    w = to_blocks(groups, "w")
    assert w.format == FORMATS["q5_0"]
    kernel = CupyQuantKernel(launcher, warps=int(rng.integers(1, 5)))
    x = activations(rng, 9, 96, dtype)
    got = run(kernel, w.format, x, w.blocks.numpy())
    assert torch.equal(bits(got), bits(run(kernel, FORMATS["q8_0"], x, q8_0_blocks(groups).numpy()))), f"seed {seed}"


@pytest.mark.parametrize("name", ["q4_0", "q4_k", "q6_k"])
def test_quant_gemm_row_alone_equals_row_in_batch(launcher, name):
    fmt = FORMATS[name]
    rng, seed = fresh_rng()
    m, n, k = 11, 7, 256
    blocks = random_blocks(rng, fmt, n, k, scale=0.02)
    x = activations(rng, m, k, torch.bfloat16)
    batch = run(CupyQuantKernel(launcher, warps=3), fmt, x, blocks)
    for i in (0, 7, 10):  # the first tile, inside it, the short last tile
        alone = run(CupyQuantKernel(launcher, warps=int(rng.integers(1, 5))), fmt, x[i:i + 1].clone(), blocks)
        assert torch.equal(bits(alone), bits(batch[i:i + 1])), f"seed {seed}, row {i}"


@pytest.mark.parametrize("name", list(FORMATS))
def test_quant_gemm_within_float64_bound(launcher, name):
    """|y - x @ W.T| <= K * 2^-23 * sum_k |x_k w_k| (+ |y| 2^-24 for the float32 output), float64 on the same
    dequantised weights: the bound of any float32 summation order."""
    fmt = FORMATS[name]
    rng, seed = fresh_rng()
    m, n, k = 5, 17, 512
    blocks = random_blocks(rng, fmt, n, k, scale=0.02)
    x = activations(rng, m, k, torch.float32)
    out = run(CupyQuantKernel(launcher), fmt, x, blocks).double().numpy()
    w = dequantize(blocks, fmt).astype(np.float64)
    x64 = x.double().numpy()
    ref = x64 @ w.T
    bound = k * 2.0**-23 * (np.abs(x64) @ np.abs(w).T) + np.abs(ref) * 2.0**-24
    assert (np.abs(out - ref) <= bound).all(), f"seed {seed}"
    assert np.abs(out - ref).max() > 0 or k < 64  # a float32 sum of 512 terms is not the float64 one


def test_quant_gemm_strided_rows_and_empty_batch(launcher):
    """A non-contiguous x (every other row of a wider tensor) gives the rows' own bits; M = 0 launches nothing."""
    fmt = FORMATS["q8_0"]
    rng, seed = fresh_rng()
    blocks = random_blocks(rng, fmt, 6, 64, scale=0.02)
    wide = activations(rng, 8, 96, torch.float16)
    x = wide[::2, 16:80]
    kernel = CupyQuantKernel(launcher)
    assert torch.equal(run(kernel, fmt, x, blocks), run(kernel, fmt, x.contiguous(), blocks)), f"seed {seed}"
    launches = len(launcher.launches)
    assert run(kernel, fmt, x[:0], blocks).shape == (0, 6) and len(launcher.launches) == launches


def test_quant_gemm_refuses_bad_calls_by_name(launcher):
    fmt = FORMATS["q4_0"]
    kernel = CupyQuantKernel(launcher)
    blocks = torch.zeros((4, fmt.row_bytes(64)), dtype=torch.uint8)
    with pytest.raises(ValueError, match="warps"):
        CupyQuantKernel(launcher, warps=9)
    with pytest.raises(ValueError, match="not whole blocks"):
        kernel.pack(fmt.ggml_type, blocks, 96)
    with pytest.raises(ValueError, match="unknown type"):
        kernel.pack(99, blocks, 64)
    packed = kernel.pack(fmt.ggml_type, blocks, 64)
    with pytest.raises(ValueError, match="x is a float32"):
        kernel.linear(fmt.ggml_type, torch.zeros((2, 64), dtype=torch.float64), packed, 4)
    with pytest.raises(ValueError, match="x has 32 features"):
        kernel.linear(fmt.ggml_type, torch.zeros((2, 32)), packed, 4)
    with pytest.raises(ValueError, match="bias"):
        kernel.linear(fmt.ggml_type, torch.zeros((2, 64)), packed, 4, torch.zeros(4, dtype=torch.float16))
