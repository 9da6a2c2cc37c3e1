"""The panel matmuls (worker_svc/f32_gemm.cpp) on every CPU path that runs them: the AVX2 + FMA kernel gives the
AVX-512 one's bits, float32 and bfloat16 (one FMA chain an output in both), each row the bits it gets alone (the M
invariance batch invariance stands on), and the bfloat16 kernel within its derived bound of a float64 reference;
Linear under batch invariance runs one kernel at every row count."""

from __future__ import annotations

import pytest
import torch

from worker_svc import cpu_path
from worker_svc.attention.cpu_backend import load_library
from worker_svc.cpu_features import cpu_flags
from worker_svc.cpu_ops import CpuOps
from worker_svc.linear import make_linear

# The paths whose panel kernels differ: AVX-512 (any of the paths above avx2) and AVX2 + FMA.
PANEL_PATHS = [p for p in ("avx512", "avx2") if p in cpu_path.supported(cpu_flags())]
pytestmark = pytest.mark.skipif(not PANEL_PATHS, reason="no AVX2 + FMA on this CPU: no panel kernel runs here")
U32, U_BF16 = 2.0 ** -24, 2.0 ** -8  # unit roundoffs: float32 (24-bit significand), bfloat16 (8-bit)


@pytest.fixture(scope="module")
def ops() -> dict[str, CpuOps]:
    out = {p: CpuOps(load_library(cpu=cpu_path.PATHS[p])) for p in PANEL_PATHS}
    assert {p: o.panel_width() for p, o in out.items()} == {p: {"avx512": 512, "avx2": 256}[p] for p in out}
    return out


def _data(rows, out, inp, seed, dtype):
    gen = torch.Generator().manual_seed(seed)
    w, b, x = torch.randn(out, inp, generator=gen) * 0.1, torch.randn(out, generator=gen), \
        torch.randn(rows, inp, generator=gen)
    return w.to(dtype), b.to(dtype), x.to(dtype)


def _pack(o: CpuOps, w: torch.Tensor) -> torch.Tensor:
    return o.f32_pack(w) if w.dtype == torch.float32 else o.bf16_pack(w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,out,inp", [(1, 48, 64), (3, 100, 33), (9, 576, 576), (17, 50, 1536), (70, 960, 64)])
def test_avx2_and_avx512_kernels_give_the_same_bits(ops, dtype, rows, out, inp):
    if len(ops) < 2:
        pytest.skip("this CPU runs one panel kernel only")
    w, b, x = _data(rows, out, inp, rows + out, dtype)
    got = {p: o.panel_linear(x, _pack(o, w), out, b) for p, o in ops.items()}
    assert torch.equal(got["avx512"], got["avx2"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_row_gets_the_bits_it_gets_alone(ops, dtype):
    w, b, x = _data(37, 144, 576, 5, dtype)
    for o in ops.values():
        packed = _pack(o, w)
        batch = o.panel_linear(x, packed, 144, b)
        for r in (0, 5, 8, 36):
            assert torch.equal(o.panel_linear(x[r:r + 1].contiguous(), packed, 144, b)[0], batch[r])
        assert torch.equal(o.panel_linear(x[3:20].contiguous(), packed, 144, b), batch[3:20])


@pytest.mark.parametrize("with_bias", [False, True])
def test_bf16_panels_are_the_float64_product_rounded_once_to_bfloat16(ops, with_bias):
    w, b, x = _data(19, 100, 576, 11, torch.bfloat16)
    bias = b if with_bias else None
    want = x.double() @ w.double().T + (0 if bias is None else bias.double())
    # a float32 FMA chain over K, then the bias (K + 1 roundings of <= U32 of the partial sums' magnitudes), then
    # one rounding to bfloat16 (<= U_BF16 of the value it rounds)
    scale = x.double().abs() @ w.double().abs().T + (0 if bias is None else bias.double().abs())
    f32_err = (576 + 1) * U32 * scale
    for o in ops.values():
        got = o.panel_linear(x, o.bf16_pack(w), 100, bias)
        assert got.dtype == torch.bfloat16
        assert ((got.double() - want).abs() <= f32_err + U_BF16 * (want.abs() + f32_err) + 1e-30).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_an_invariant_linear_gives_a_row_the_same_bits_at_every_row_count(dtype):
    w, b, x = _data(600, 96, 64, 3, dtype)
    lin = make_linear(w, b, f32_copy=True, invariant=True)
    assert lin.invariant
    full = lin(x)
    for rows in (1, 7, 64, 65, 300):
        assert torch.equal(lin(x[:rows].contiguous()), full[:rows]), rows
