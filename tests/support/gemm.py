"""The CPU matmul kernels' shared test pieces (tests/worker/test_amx_gemm.py, test_f32_gemm.py): their float32 test
data, and the batch-invariance check both kernels must pass."""

from __future__ import annotations

import torch


def gemm_data(rows, out, inp, seed):
    """Weights [out, inp] (scaled by 0.1), bias [out] and input [rows, inp], float32, drawn in that order from `seed`.
    NOTE: the draw order is part of the data: a caller that wants bfloat16 rounds these (the same values as drawing
    and rounding each)."""
    gen = torch.Generator().manual_seed(seed)
    return (torch.randn(out, inp, generator=gen) * 0.1, torch.randn(out, generator=gen),
            torch.randn(rows, inp, generator=gen))


def assert_each_row_alone(linear, x, rows):
    """A decode step's rows are other requests: a row's result must not depend on who shares its tiles. `linear`
    maps an input [n, inp] to [n, out]; each of `rows` alone, and the first 17 rows (a partial tile), get exactly the
    bits of the whole batch, which is returned."""
    batch = linear(x)
    for r in rows:
        assert torch.equal(linear(x[r:r + 1].contiguous())[0], batch[r])
    assert torch.equal(linear(x[:17].contiguous()), batch[:17])
    return batch


def product_and_reference(linear, pack, data, out, with_bias):
    """`data`: (w, b, x) as gemm_data draws them (or rounded). Runs the kernel, `linear(x, pack(w), out, b or None)`,
    checks its result's shape and dtype (x's), and returns that result, the float64 x @ w.T (+ b) it is held to, and
    |x| @ |w|.T (the scale of the products' rounding errors)."""
    w, b, x = data
    bias = b if with_bias else None
    got = linear(x, pack(w), out, bias)
    assert got.shape == (x.shape[0], out) and got.dtype == x.dtype
    want = x.double() @ w.double().T + (0 if bias is None else bias.double())
    return got, want, x.double().abs() @ w.double().abs().T
