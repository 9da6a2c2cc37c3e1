"""worker_svc/f32_gemm.cpp through CpuOps: the float32 panel matmul against a float64 reference (row groups of 8
and their remainders, a last panel of fewer than 48 columns, bias, K not a multiple of anything), its batch and
thread-count invariance, weights packed from either storage order; Linear takes it up to its panel_rows and keeps
its other path beyond (batch invariance off; on, every call: tests/worker/test_panel_paths.py). Skipped where the CPU
has no AVX-512 (the AVX2 kernel's bits are the same: test_panel_paths)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support.gemm import assert_each_row_alone, gemm_data, product_and_reference
from worker_svc.cpu_ops import shared_ops
from worker_svc.linear import F32_PANEL_ROWS, F32_VOCAB_PANEL_ROWS, make_linear, transposed

OPS = shared_ops()
pytestmark = pytest.mark.skipif(OPS is None or OPS.panel_width() != 512,
                                reason="no AVX-512 on this CPU: the kernel never runs here")


@pytest.mark.parametrize("rows", [1, 7, 8, 9, 16, 17, 63, 64, 65, 130])
@pytest.mark.parametrize("out,inp", [(48, 64), (100, 33), (576, 1536), (960, 576)])  # 100: a last panel of 4
@pytest.mark.parametrize("with_bias", [False, True])
def test_f32_linear_is_the_float64_product_within_float32_accumulation(rows, out, inp, with_bias):
    w, b, x = gemm_data(rows, out, inp, seed=rows * 1000 + out)  # float32: got's dtype too
    got, want, magnitude = product_and_reference(OPS.f32_linear, OPS.f32_pack, (w, b, x), out, with_bias)
    # one chain of float32 FMAs over K, then the bias: each step rounds once (<= 2^-24 relative of the partial sum)
    scale = magnitude + (b.double().abs() if with_bias else 0)
    assert ((got.double() - want).abs() <= (inp + 1) * 2.0 ** -24 * scale + 1e-30).all()


def test_each_row_gets_the_bits_it_gets_alone_at_any_thread_count():
    # A decode step's rows are other requests: a row's result must not depend on who shares its step, nor on how
    # many threads the worker has now (the thread governor changes it between steps).
    w, b, x = gemm_data(64, 576, 576, seed=3)
    packed = OPS.f32_pack(w)
    batch = assert_each_row_alone(lambda rows: OPS.f32_linear(rows, packed, 576, b), x, (0, 7, 8, 40, 63))
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(OPS.f32_linear(x, packed, 576, b), batch)
    finally:
        torch.set_num_threads(threads)


def test_a_weight_packs_the_same_from_either_storage_order():
    w, _, x = gemm_data(5, 96, 80, seed=4)
    assert torch.equal(OPS.f32_pack(w), OPS.f32_pack(transposed(w)))  # the [in, out] storage the mm layout keeps
    assert OPS.f32_pack(w).numel() == 96 * 80
    assert OPS.f32_pack(w[:50]).numel() == 96 * 80  # 50 columns: one panel of 48 and one padded to 48


def test_no_rows_is_an_empty_result_and_bad_inputs_are_refused():
    w, _, x = gemm_data(4, 48, 64, seed=5)
    packed = OPS.f32_pack(w)
    assert OPS.f32_linear(x[:0].contiguous(), packed, 48, None).shape == (0, 48)
    with pytest.raises(ValueError, match="features"):
        OPS.f32_linear(torch.zeros(4, 32), packed, 48, None)
    with pytest.raises(ValueError, match="float32"):
        OPS.f32_linear(x.bfloat16(), packed, 48, None)
    with pytest.raises(ValueError, match="float32"):
        OPS.f32_pack(w.bfloat16())


@pytest.mark.parametrize("vocab", [False, True])
def test_a_float32_weight_with_its_copy_takes_the_panels_up_to_panel_rows_and_its_layout_beyond(vocab):
    w, b, _ = gemm_data(1, 96, 576, seed=7)
    bias = None if vocab else b
    lin = make_linear(w if vocab else transposed(w), bias, vocab=vocab, f32_copy=True)
    limit = F32_VOCAB_PANEL_ROWS if vocab else F32_PANEL_ROWS
    assert lin.panels is not None and lin.panel_rows == limit and lin.small is None
    assert make_linear(transposed(w), b).panels is None  # no copy unless asked (f32_copies_fit)
    calls = []

    class Watched:  # the real kernel, its calls counted (another kernel's bits may equal ours: not a sign)
        def panel_linear(self, *args):
            calls.append(args[0].shape[0])
            return OPS.panel_linear(*args)

    lin.ops = Watched()
    for rows in (1, limit, limit + 1):
        x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows))
        got = lin(x)
        assert (calls[-1:] == [rows]) == (rows <= limit), rows  # the call goes where the row count says
        if rows <= limit:
            assert torch.equal(got, OPS.f32_linear(x, lin.panels, 96, bias))
        assert torch.allclose(got, F.linear(x, w, bias), atol=1e-4, rtol=1e-4)
    assert calls == [1, limit]
