"""worker_svc/amx_gemm.cpp through CpuOps: the AMX small-batch matmul against a float64 reference, its row tiles
(partial ones from a padded copy), column blocks (an odd count), bias, and its batch invariance; the Linear layer
takes it up to AMX_MAX_ROWS rows and oneDNN beyond. Skipped where the CPU has no AMX-BF16 (nothing runs it there)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.support.gemm import assert_each_row_alone, gemm_data, product_and_reference
from worker_svc.cpu_ops import shared_ops
from worker_svc.linear import AMX_MAX_ROWS, make_linear

OPS = shared_ops()
pytestmark = pytest.mark.skipif(OPS is None or not OPS.amx_available(),
                                reason="no AMX-BF16 for this process on this CPU: the kernel never runs here")


def _data(rows, out, inp, seed):
    w, b, x = gemm_data(rows, out, inp, seed)
    return w.bfloat16(), b.bfloat16(), x.bfloat16()


@pytest.mark.parametrize("rows", [1, 7, 16, 17, 24, 31, 32, 33, 48, 63, 64, 100])
@pytest.mark.parametrize("out,inp", [(48, 64), (96, 576), (576, 1536)])  # 3 column blocks: one pair and a single
@pytest.mark.parametrize("with_bias", [False, True])
def test_amx_linear_is_the_float64_product_rounded_once_to_bfloat16(rows, out, inp, with_bias):
    data = _data(rows, out, inp, seed=rows * 1000 + out)  # bfloat16: got's dtype too
    got, want, magnitude = product_and_reference(OPS.amx_linear, OPS.amx_pack, data, out, with_bias)
    # float32 accumulation of exact bfloat16 products (|error| <= inp * 2^-24 * sum |x w|), then one rounding to
    # bfloat16 (half a unit in the last place: <= 2^-8 relative; the bias added before it)
    bound = 2.0 ** -8 * want.abs() + inp * 2.0 ** -24 * magnitude + 1e-30
    assert ((got.double() - want).abs() <= bound * 1.0001).all()


def test_each_row_gets_the_bits_it_gets_alone():
    # A decode step's rows are other requests: a row's result must not depend on who shares its tiles.
    w, b, x = _data(64, 576, 576, seed=3)
    packed = OPS.amx_pack(w)
    assert_each_row_alone(lambda rows: OPS.amx_linear(rows, packed, 576, b), x, (0, 15, 16, 40, 63))


def test_no_rows_is_an_empty_result_and_bad_shapes_are_refused():
    w, b, x = _data(4, 48, 64, seed=5)
    packed = OPS.amx_pack(w)
    assert OPS.amx_linear(x[:0].contiguous(), packed, 48, None).shape == (0, 48)
    with pytest.raises(ValueError, match="N % 16 == 0 and K % 32 == 0"):
        OPS.amx_pack(w[:40].contiguous())
    with pytest.raises(ValueError, match="N % 16 == 0 and K % 32 == 0"):
        OPS.amx_pack(w[:, :48].contiguous())
    with pytest.raises(ValueError, match="features"):
        OPS.amx_linear(torch.zeros(4, 32, dtype=torch.bfloat16), packed, 48, None)
    with pytest.raises(ValueError, match="bfloat16"):
        OPS.amx_linear(x.float(), packed, 48, None)


def test_a_bfloat16_layer_takes_the_amx_kernel_up_to_amx_max_rows_and_onednn_beyond():
    w, b, _ = _data(1, 96, 576, seed=7)
    lin = make_linear(w, b)
    assert lin.kind == "onednn" and lin.amx is not None
    for rows in (1, AMX_MAX_ROWS, AMX_MAX_ROWS + 1, 200):
        x = torch.randn(rows, 576, generator=torch.Generator().manual_seed(rows)).bfloat16()
        amx = OPS.amx_linear(x, lin.amx, 96, b)
        onednn = torch.ops.mkldnn._linear_pointwise(x, lin.weight, b, "none", [], "")
        want = amx if rows <= AMX_MAX_ROWS else onednn
        assert torch.equal(lin(x), want), rows
        assert torch.allclose(lin(x).float(), F.linear(x.float(), w.float(), b.float()), atol=0.05, rtol=0.02)
    # a weight the kernel cannot tile keeps oneDNN alone; so does float32
    assert make_linear(w[:, :48].contiguous(), None).amx is None
    assert make_linear(w.float(), None).amx is None
