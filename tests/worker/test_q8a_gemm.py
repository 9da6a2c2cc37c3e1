"""The int8-activation matmul (worker_svc/q8a_gemm.cpp) on every CPU path that runs it, for each GGML format the worker
keeps quantised: its output is, bit for bit, the contract at the top of the file as tests/support/q8a_reference.py
computes it in numpy (so the AVX2 kernel gives the VNNI one's bits); each row gets the bits it gets alone (batch
invariance); bfloat16 rows are the float32 result rounded once; and the error against a float64 product on the
dequantised weight stays within the bound activation rounding derives."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.support.q8a_reference import ACT_BLOCK, q8a_linear, quantize_activations
from tests.support.quant_blocks import q5_0_widened_to_q8_0, random_blocks
from worker_svc import cpu_path
from worker_svc.cpu_build import load_library
from worker_svc.cpu_features import cpu_flags
from worker_svc.quant.formats import FORMATS, dequantize
from worker_svc.quant.kernel import QuantKernel

FLAGS = cpu_flags()
VNNI = {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= FLAGS
# native: VNNI where the CPU has it; avx2: vpmaddubsw. The avx512 path hides VNNI, so it runs the AVX2 kernel.
PATHS = {p: (512 if VNNI and p == "native" else 256) for p in ("native", "avx2")
         if p in cpu_path.supported(FLAGS) and "avx2" in FLAGS}
pytestmark = pytest.mark.skipif(not PATHS, reason="no AVX2 on this CPU: no int8-activation kernel runs here")
U32 = 2.0 ** -24  # float32's unit roundoff
SHAPES = [(1, 48, 256), (3, 100, 512), (4, 96, 256), (9, 130, 768), (17, 50, 1536)]


@pytest.fixture(scope="module")
def kernels() -> dict[str, QuantKernel]:
    out = {p: QuantKernel(load_library(cpu=cpu_path.PATHS[p]), int8_activations=True) for p in PATHS}
    assert {p: k.width() for p, k in out.items()} == PATHS
    return out


def case(fmt: str, rows: int, out: int, inp: int, seed: int):
    rng = np.random.default_rng(seed)
    blocks = random_blocks(rng, FORMATS[fmt], out, inp, scale=0.02)
    x = rng.standard_normal((rows, inp)).astype(np.float32)
    x[:, :ACT_BLOCK] = 0.0  # an all-zero block: scale 0
    bias = rng.standard_normal(out).astype(np.float32)
    return blocks, x, bias


def run(kernel: QuantKernel, fmt: str, blocks: np.ndarray, x: torch.Tensor, bias: torch.Tensor | None = None):
    ggml = FORMATS[fmt].ggml_type
    packed = kernel.pack(ggml, torch.from_numpy(blocks), x.shape[1])
    return kernel.linear(ggml, x, packed, blocks.shape[0], bias)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows,out,inp", SHAPES)
def test_the_output_is_the_contracts_bit_for_bit(kernels, fmt, rows, out, inp):
    blocks, x, bias = case(fmt, rows, out, inp, rows * 7 + out)
    want = q8a_linear(x, blocks, FORMATS[fmt], bias)
    for path, kernel in kernels.items():
        got = run(kernel, fmt, blocks, torch.from_numpy(x), torch.from_numpy(bias)).numpy()
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=path)


@pytest.mark.parametrize("rows,out,inp", SHAPES)
def test_q5_0_gives_the_bits_of_its_int8_widening_in_5_5_bits_a_weight(kernels, rows, out, inp):
    """Q5_0 packed with its fifth bits in a bit plane (5.5 bits a weight, the output columns padded to whole panels
    of 48; q_gemm's size) multiplies to the bits of the same weights held as Q8_0 (q - 16 as int8, d)."""
    blocks, x, bias = case("q5_0", rows, out, inp, rows * 3 + out)
    wide = q5_0_widened_to_q8_0(blocks)
    for path, kernel in kernels.items():
        packed = kernel.pack(FORMATS["q5_0"].ggml_type, torch.from_numpy(blocks), inp)
        assert packed.numel() == -(-out // 48) * 48 * inp * 11 // 16
        got = run(kernel, "q5_0", blocks, torch.from_numpy(x), torch.from_numpy(bias)).numpy()
        want = run(kernel, "q8_0", wide, torch.from_numpy(x), torch.from_numpy(bias)).numpy()
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=path)


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_row_gets_the_bits_it_gets_alone(kernels, fmt):
    blocks, x, _ = case(fmt, 11, 100, 512, 5)
    for kernel in kernels.values():
        batch = run(kernel, fmt, blocks, torch.from_numpy(x))
        for r in range(x.shape[0]):
            assert torch.equal(run(kernel, fmt, blocks, torch.from_numpy(x[r:r + 1].copy()))[0], batch[r])


@pytest.mark.parametrize("fmt", FORMATS)
def test_bfloat16_rows_are_the_float32_result_rounded_once(kernels, fmt):
    blocks, x, bias = case(fmt, 6, 96, 512, 9)
    xb, bb = torch.from_numpy(x).bfloat16(), torch.from_numpy(bias).bfloat16()
    want = torch.from_numpy(q8a_linear(xb.float().numpy(), blocks, FORMATS[fmt], bb.float().numpy())).bfloat16()
    for kernel in kernels.values():
        got = run(kernel, fmt, blocks, xb, bb)
        assert got.dtype == torch.bfloat16 and torch.equal(got.view(torch.int16), want.view(torch.int16))


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_error_is_within_what_rounding_the_activations_allows(kernels, fmt):
    """Each input moves by at most half its block's scale d when rounded to int8, so an output moves by at most
    sum_k d_k / 2 |w_k| from the float64 product on the dequantised weight; the float32 steps add at most
    (2 groups + 2) u sum_k |x_k w_k| (two roundings a group and the bias add)."""
    blocks, x, bias = case(fmt, 5, 96, 1024, 3)
    w = dequantize(blocks, FORMATS[fmt]).astype(np.float64)
    _, d = quantize_activations(x)
    step = np.repeat(d.astype(np.float64), ACT_BLOCK, axis=1) / 2  # [M, K]
    groups = 1024 // 16
    bound = step @ np.abs(w).T + (2 * groups + 2) * U32 * (np.abs(x) + step) @ np.abs(w).T + 1e-30
    exact = x.astype(np.float64) @ w.T + bias
    for kernel in kernels.values():
        got = run(kernel, fmt, blocks, torch.from_numpy(x), torch.from_numpy(bias)).numpy().astype(np.float64)
        assert (np.abs(got - exact) <= bound).all()
        # and the bound is not vacuous: the error is well under the output's size
        assert np.linalg.norm(got - exact) < 0.05 * np.linalg.norm(exact)


def test_bad_arguments_are_refused_by_name(kernels):
    kernel = next(iter(kernels.values()))
    blocks, x, _ = case("q4_0", 2, 48, 256, 1)
    packed = kernel.pack(2, torch.from_numpy(blocks), 256)
    with pytest.raises(ValueError, match="x has 128 features"):
        kernel.linear(2, torch.from_numpy(x[:, :128].copy()), packed, 48)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        kernel.linear(2, torch.from_numpy(x).double(), packed, 48)
