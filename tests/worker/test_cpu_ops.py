"""worker_svc/cpu_ops.py: the lean forward's fused ops (bfloat16 and float32) against the torch ops they replace
(transformers' math op for op), on the vector paths and the scalar tails, and the lean forward with and without them."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from worker_svc.attention import AttentionMetadata
from worker_svc.cpu_ops import CpuOps
from worker_svc.kv_pool import KVPool
from worker_svc.lean_model import LeanModel, _norm, _rotate
from worker_svc.models import load_model
from worker_svc.runner import StepContext
from worker_svc.worker import make_backend

BF16 = torch.bfloat16


@pytest.fixture(scope="module")
def ops() -> CpuOps:
    return CpuOps()


def _randn(*shape, seed=0, scale=1.0):
    return (scale * torch.randn(*shape, generator=torch.Generator().manual_seed(seed))).to(BF16)


def _same_or_two_ulps(got: torch.Tensor, want: torch.Tensor, exact: bool) -> bool:
    """Bit-equal where `exact`, else within two bfloat16 ulps: a sum of squares in another order than torch's moves
    the row's scale by <= dim x 2^-24 relative (~3e-5, far below half a bfloat16 ulp, 2^-9), so each of the two
    roundings to bfloat16 after it (x * scale, then w * that) may land one ulp away at most."""
    if exact:
        return torch.equal(got, want)
    ulps = (got.view(torch.int16).int() - want.view(torch.int16).int()).abs()  # same sign: one ulp a step
    return bool((ulps <= 2).all())


@pytest.mark.parametrize("rows, dim", [(1, 576), (7, 576), (64, 576), (300, 576), (5, 100), (3, 12)])
def test_rms_norm_and_the_residual_add_equal_torch_bit_for_bit(ops, rows, dim):
    # NOTE: bit for bit where the build's sum of squares is AVX-512's, the order of torch's own AVX-512 reduction;
    # other builds (AVX2, scalar: --cpu-path avx2, an AVX2-only CPU) sum in order, within two bfloat16 ulps of torch
    exact = ops.simd_width() == 512 and torch.backends.cpu.get_cpu_capability() == "AVX512"
    x, w, d = _randn(rows, dim, seed=1), _randn(dim, seed=2), _randn(rows, dim, seed=3)
    assert _same_or_two_ulps(ops.rms_norm(x, w, 1e-5), _norm(x, w, 1e-5), exact)
    x2 = x.clone()
    normed = ops.add_rms_norm(x2, d, w, 1e-5)
    assert torch.equal(x2, x + d)  # in place, rounded as torch's bfloat16 add
    assert _same_or_two_ulps(normed, _norm(x + d, w, 1e-5), exact)


@pytest.mark.parametrize("rows, inter", [(1, 1536), (64, 1536), (300, 1536), (4, 40)])
def test_silu_mul_matches_torch_to_a_bfloat16_step(ops, rows, inter):
    gu = _randn(rows, 2 * inter, seed=4, scale=4.0)  # wide: exp's clamp and both tails of silu
    got = ops.silu_mul(gu)
    want = F.silu(gu[:, :inter]) * gu[:, inter:]
    assert got.shape == want.shape and got.dtype == BF16
    # NOTE: exp is ours, not Sleef's: a result on a rounding boundary may land one bfloat16 step away
    differ = got != want
    assert differ.float().mean().item() < 1e-3
    assert torch.allclose(got.float(), want.float(), rtol=2 ** -7, atol=1e-6)


@pytest.mark.parametrize("heads, hd", [(12, 64), (20, 128), (3, 24)])
def test_rope_in_place_equals_rotate_half_and_leaves_the_rest(ops, heads, hd):
    t = 9
    packed = _randn(t, heads * hd + 3 * hd, seed=5)  # q|k heads then v, as the fused QKV output
    cos, sin = _randn(t, hd, seed=6), _randn(t, hd, seed=7)
    want = _rotate(packed[:, :heads * hd].reshape(t, heads, hd), cos[:, None, :], sin[:, None, :])
    got = packed.clone()
    ops.rope_(got[:, :heads * hd].view(t, heads, hd), cos, sin)
    assert torch.equal(got[:, :heads * hd].view(t, heads, hd), want)
    assert torch.equal(got[:, heads * hd:], packed[:, heads * hd:])


@pytest.mark.parametrize("rows, dim", [(1, 576), (7, 576), (64, 576), (300, 576), (5, 100), (3, 12)])
def test_float32_rms_norm_is_torchs_but_for_its_sums_order_and_the_residual_add_is_bit_equal(ops, rows, dim):
    x, w, d = (torch.randn(rows, dim, generator=torch.Generator().manual_seed(s)) for s in (1, 2, 3))
    w = w[0]
    want = _norm(x, w, 1e-5)
    got = ops.rms_norm(x, w, 1e-5)
    # the sum of squares in another order: each order is within (dim - 1) roundings of the exact sum (2^-24 each),
    # the scale within half that relatively, and each output two products rounded once each
    bound = (dim + 4) * 2.0 ** -24
    assert torch.allclose(got, want, rtol=bound, atol=0) and got.dtype == torch.float32
    exact = w.double() * x.double() / (x.double().pow(2).mean(-1, keepdim=True) + 1e-5).sqrt()
    assert torch.allclose(got.double(), exact, rtol=bound, atol=0)
    x2 = x.clone()
    normed = ops.add_rms_norm(x2, d, w, 1e-5)
    assert torch.equal(x2, x + d)  # in place, torch's float32 add
    assert torch.allclose(normed, _norm(x + d, w, 1e-5), rtol=bound, atol=0)


@pytest.mark.parametrize("rows, inter", [(1, 1536), (64, 1536), (4, 40)])
def test_float32_silu_mul_is_torchs_within_its_exp_and_rope_is_bit_equal(ops, rows, inter):
    gen = torch.Generator().manual_seed(4)
    gu = 4.0 * torch.randn(rows, 2 * inter, generator=gen)
    gu[0, :5] = torch.tensor([-100.0, -88.8, 88.0, 90.0, 0.0])  # exp's overflow and underflow ends
    want = F.silu(gu[:, :inter]) * gu[:, inter:]
    got = ops.silu_mul(gu)
    # exp is Cephes', not Sleef's: a few ulps at most, and most products bit-equal
    assert torch.allclose(got, want, rtol=2 ** -21, atol=1e-30)
    assert (got == want).float().mean().item() > 0.95
    assert torch.equal(got[0, :5], want[0, :5])
    # the 16-lane path and the scalar tail are the same operations: the same bits (inter 1: the tail alone)
    g = gu[0, :64]
    alone = torch.stack([ops.silu_mul(torch.stack([v, torch.tensor(1.0)])[None])[0, 0] for v in g])
    assert torch.equal(ops.silu_mul(torch.cat([g, torch.ones(64)])[None])[0], alone)
    t, heads, hd = 9, 12, 64
    packed = torch.randn(t, heads * hd + 3 * hd, generator=gen)
    cos, sin = torch.randn(t, hd, generator=gen), torch.randn(t, hd, generator=gen)
    want = _rotate(packed[:, :heads * hd].reshape(t, heads, hd), cos[:, None, :], sin[:, None, :])
    got = packed.clone()
    ops.rope_(got[:, :heads * hd].view(t, heads, hd), cos, sin)
    assert torch.equal(got[:, :heads * hd].view(t, heads, hd), want)  # each product rounded, as torch: no FMA
    assert torch.equal(got[:, heads * hd:], packed[:, heads * hd:])


def test_wrong_inputs_are_refused(ops):
    with pytest.raises(ValueError, match="of one dtype"):
        ops.rms_norm(torch.randn(2, 8), _randn(8), 1e-5)  # float32 rows, a bfloat16 weight
    with pytest.raises(ValueError, match="bfloat16 or float32"):
        ops.rms_norm(torch.randn(2, 8).double(), torch.randn(8).double(), 1e-5)
    with pytest.raises(ValueError):
        ops.silu_mul(_randn(8, 4).t())  # not contiguous
    with pytest.raises(ValueError):
        ops.rope_(_randn(2, 3, 7), _randn(2, 7), _randn(2, 7))  # odd head_dim


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_the_lean_forward_gives_the_torch_ops_logits(tiny_llama_dir, dtype):
    loaded = load_model(tiny_llama_dir, dtype=dtype)
    lean = LeanModel(loaded.model)
    # float32 takes the fused ops where this build vectorises them (AVX2 or AVX-512)
    assert (lean.ops is not None) == (dtype == "bfloat16" or CpuOps().vector_f32())
    geo = loaded.kv_geometry(16)
    backend = make_backend("auto", "cpu", geo)
    q_lens, seq_lens = np.array([5, 1, 1]), np.array([5, 9, 30])
    tables = [[1], [2], [3, 4]]
    meta = AttentionMetadata.build(q_lens, seq_lens, tables, 16, "cpu")
    ids = torch.randint(0, loaded.vocab_size, (int(q_lens.sum()),), generator=torch.Generator().manual_seed(0))
    positions = torch.from_numpy(meta.positions_host).long()
    keep = torch.from_numpy(meta.query_start_loc_host[1:] - 1)
    outs = []
    for use_ops in (True, False):
        pool = KVPool(geo, 8)
        pool.kv.normal_(generator=torch.Generator().manual_seed(1))  # the same cached context both times
        lean.ops = CpuOps() if use_ops else None
        with torch.inference_mode():
            outs.append(lean.forward(ids, positions, StepContext(pool.kv, meta, backend, pool.scales), keep).float())
    fused, plain = outs
    assert fused.shape == plain.shape
    # bit-equal ops but for silu's rare one-step differences (and float32's norm sums): the logits agree to the
    # dtype's noise
    tol = 0.05 if dtype == "bfloat16" else 1e-5
    assert (fused - plain).abs().max().item() <= tol * plain.abs().max().item()
    assert torch.equal(fused.argmax(-1), plain.argmax(-1))


@pytest.mark.parametrize("dtype", [torch.float32, BF16])
@pytest.mark.parametrize("rows, cols", [(64, 49152), (5, 37), (1, 16), (3, 1)])
def test_argmax_is_torchs_with_ties_to_the_lowest_id(ops, dtype, rows, cols):
    x = torch.randn(rows, cols, generator=torch.Generator().manual_seed(cols)).to(dtype)
    if cols > 40:
        x[0, 3] = x[0, cols - 2] = 99.0  # a tie across vector lanes and the tail
        x[-1, 17] = x[-1, 33] = 99.0  # a tie within one lane (17 and 33: 16 apart)
    assert torch.equal(ops.argmax(x), x.float().argmax(dim=-1))
    strided = torch.randn(rows, cols + 8, generator=torch.Generator().manual_seed(1)).to(dtype)[:, :cols]
    assert torch.equal(ops.argmax(strided), strided.float().argmax(dim=-1))  # rows `stride` apart


def test_argmax_of_an_all_minus_infinity_row_is_zero_as_torchs(ops):
    x = torch.full((2, 40), float("-inf"))
    x[1, 7] = 0.0
    assert ops.argmax(x).tolist() == [0, 7] == x.argmax(dim=-1).tolist()
