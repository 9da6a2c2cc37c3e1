"""The quantised-weight matmul (worker_svc/q_gemm.cpp) on every CPU path that runs it, for each GGML format the
worker keeps quantised: its output is, bit for bit, the float32 panel kernel's (f32_gemm.cpp) on the weight as
gguf-py dequantises it (each weight GGML's float32 value, one FMA chain per output over k), so within the panel
kernel's derived bound of a float64 reference; each row gets the bits it gets alone (batch invariance); the AVX2
kernel gives the AVX-512 one's bits; bfloat16 rows are the float32 result rounded once."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from tests.support.quant_blocks import FP16_FIELDS, q5_0_widened_to_q8_0
from worker_svc import cpu_path
from worker_svc.cpu_build import load_library
from worker_svc.cpu_features import cpu_flags
from worker_svc.cpu_ops import CpuOps
from worker_svc.quant.kernel import QuantKernel

PATHS = [p for p in ("avx512", "avx2") if p in cpu_path.supported(cpu_flags())]
pytestmark = pytest.mark.skipif(not PATHS, reason="no AVX2 + FMA + F16C on this CPU: no quantised kernel runs here")
FORMATS = {t.name.lower(): t for t in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1,
                                       GGMLQuantizationType.Q5_0, GGMLQuantizationType.Q8_0,
                                       GGMLQuantizationType.Q4_K, GGMLQuantizationType.Q6_K)}
U32 = 2.0 ** -24  # float32's unit roundoff


@pytest.fixture(scope="module")
def kernels() -> dict[str, tuple[QuantKernel, CpuOps]]:
    """Per path: the quantised kernel and the panel kernel of that path's library."""
    out = {}
    for p in PATHS:
        lib = load_library(cpu=cpu_path.PATHS[p])
        out[p] = (QuantKernel(lib), CpuOps(lib))
    assert {p: k.width() for p, (k, _) in out.items()} == {p: {"avx512": 512, "avx2": 256}[p] for p in out}
    return out


def random_blocks(fmt: str, rows: int, cols: int, seed: int) -> np.ndarray:
    """Random bytes for `rows` rows of `cols` weights, each block's fp16 scales set to finite values of a real
    checkpoint's size (~1e-3..1e-1; Q4_K's and Q6_K's sub-block scales are the random bytes)."""
    block_k, block_bytes = GGML_QUANT_SIZES[FORMATS[fmt]]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, size=(rows, cols // block_k, block_bytes), dtype=np.uint8)
    for offset in FP16_FIELDS[fmt]:  # set to finite values of a real checkpoint's size
        scales = (rng.uniform(1e-3, 1e-1, size=blocks.shape[:2]) * rng.choice([-1, 1], size=blocks.shape[:2]))
        blocks[:, :, offset:offset + 2] = scales.astype(np.float16)[..., None].view(np.uint8)
    return blocks.reshape(rows, -1)


def case(fmt: str, rows: int, out: int, inp: int, seed: int):
    blocks = random_blocks(fmt, out, inp, seed)
    weight = torch.from_numpy(dequantize(blocks, FORMATS[fmt]).copy())  # gguf-py: the independent reference
    gen = torch.Generator().manual_seed(seed)
    return torch.from_numpy(blocks), weight, torch.randn(rows, inp, generator=gen), torch.randn(out, generator=gen)


SHAPES = [(1, 48, 256), (3, 100, 512), (9, 576, 576 // 64 * 256), (17, 50, 1536), (70, 192, 256)]


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("rows,out,inp", SHAPES)
def test_the_output_is_the_panel_kernels_on_the_dequantised_weight(kernels, fmt, rows, out, inp):
    blocks, weight, x, bias = case(fmt, rows, out, inp, rows * 7 + out)
    for q, ops in kernels.values():
        got = q.linear(FORMATS[fmt].value, x, q.pack(FORMATS[fmt].value, blocks, inp), out, bias)
        want = ops.panel_linear(x, ops.f32_pack(weight), out, bias)
        assert torch.equal(got, want)


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_output_is_within_the_float32_bound_of_a_float64_reference(kernels, fmt):
    """|out - exact| <= K u sum_k |x_k w_k| (+ the bias add's rounding): a chain of K float32 FMAs' bound; the
    weights are exact (each is GGML's float32 value, which the reference uses too)."""
    blocks, weight, x, bias = case(fmt, 5, 96, 1024, 3)
    exact = x.double() @ weight.double().T + bias.double()
    bound = 1024 * U32 * (x.double().abs() @ weight.double().abs().T) + U32 * exact.abs() + 1e-30
    for q, _ in kernels.values():
        got = q.linear(FORMATS[fmt].value, x, q.pack(FORMATS[fmt].value, blocks, 1024), 96, bias).double()
        assert bool(((got - exact).abs() <= bound).all())


@pytest.mark.parametrize("fmt", FORMATS)
def test_each_row_gets_the_bits_it_gets_alone(kernels, fmt):
    blocks, _, x, bias = case(fmt, 37, 144, 512, 5)
    for q, _ in kernels.values():
        packed = q.pack(FORMATS[fmt].value, blocks, 512)
        batch = q.linear(FORMATS[fmt].value, x, packed, 144, bias)
        for r in (0, 5, 8, 36):
            assert torch.equal(q.linear(FORMATS[fmt].value, x[r:r + 1].contiguous(), packed, 144, bias)[0], batch[r])
        assert torch.equal(q.linear(FORMATS[fmt].value, x[3:20].contiguous(), packed, 144, bias), batch[3:20])


@pytest.mark.parametrize("fmt", FORMATS)
def test_avx2_and_avx512_kernels_give_the_same_bits(kernels, fmt):
    if len(kernels) < 2:
        pytest.skip("this CPU runs one of the two kernels only")
    blocks, _, x, bias = case(fmt, 11, 200, 768, 9)
    got = [q.linear(FORMATS[fmt].value, x, q.pack(FORMATS[fmt].value, blocks, 768), 200, bias)
           for q, _ in kernels.values()]
    assert torch.equal(got[0], got[1])


@pytest.mark.parametrize("out,inp,panels", [(48, 256, 1), (100, 512, 3), (576, 1536, 12), (1536, 576, 32)])
def test_q5_0_panels_hold_5_5_bits_a_weight(kernels, out, inp, panels):
    """Each weight's nibble, its fifth bit in a bit plane and its block's fp16 d: 5.5 bits a weight, as the file holds
    it (22 bytes a block of 32), the output columns padded to whole panels of 48; not 8.5 (int8 quants)."""
    for q, _ in kernels.values():
        assert q.packed_size(FORMATS["q5_0"].value, out, inp) == panels * 48 * inp * 11 // 16
        blocks = torch.from_numpy(random_blocks("q5_0", out, inp, 1))
        assert q.pack(FORMATS["q5_0"].value, blocks, inp).numel() == panels * 48 * inp * 11 // 16


@pytest.mark.parametrize("rows,out,inp", SHAPES)
def test_q5_0_gives_the_bits_of_its_int8_widening(kernels, rows, out, inp):
    """Q5_0 kept at 5 bits multiplies to the bits of the same weights held as Q8_0 (q - 16 as int8, d): the direct
    (few rows) and grouped paths, both instruction sets."""
    blocks, _, x, bias = case("q5_0", rows, out, inp, rows * 3 + out)
    wide = torch.from_numpy(q5_0_widened_to_q8_0(blocks.numpy()))
    q5, q8 = FORMATS["q5_0"].value, FORMATS["q8_0"].value
    for q, _ in kernels.values():
        assert torch.equal(q.linear(q5, x, q.pack(q5, blocks, inp), out, bias),
                           q.linear(q8, x, q.pack(q8, wide, inp), out, bias))


@pytest.mark.parametrize("fmt", ["q4_1", "q4_k"])
def test_bfloat16_rows_are_the_float32_result_rounded_once(kernels, fmt):
    blocks, _, x, bias = case(fmt, 6, 96, 512, 11)
    xb, bb = x.bfloat16(), bias.bfloat16()
    for q, _ in kernels.values():
        packed = q.pack(FORMATS[fmt].value, blocks, 512)
        got = q.linear(FORMATS[fmt].value, xb, packed, 96, bb)
        assert got.dtype == torch.bfloat16
        assert torch.equal(got, q.linear(FORMATS[fmt].value, xb.float(), packed, 96, bb.float()).bfloat16())


def test_bad_arguments_are_refused_by_name(kernels):
    q, _ = next(iter(kernels.values()))
    blocks, _, x, _ = case("q4_0", 2, 48, 256, 1)
    with pytest.raises(ValueError, match="GGML type 99"):
        q.pack(99, blocks, 256)
    with pytest.raises(ValueError, match="not whole blocks"):
        q.pack(FORMATS["q4_k"].value, blocks, 64)  # Q4_K's blocks hold 256 weights
    packed = q.pack(FORMATS["q4_0"].value, blocks, 256)
    with pytest.raises(ValueError, match="x has 128 features"):
        q.linear(FORMATS["q4_0"].value, x[:, :128].contiguous(), packed, 48)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        q.linear(FORMATS["q4_0"].value, x.double(), packed, 48)
