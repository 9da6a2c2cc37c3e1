"""worker_svc/linear.py: each weight layout computes F.linear's result, the CPU picks them as documented, and the
float32 layouts share the transformers modules' storage (no second copy)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from worker_svc import linear
from worker_svc.lean_model import LeanModel
from worker_svc.linear import (F32_COPY_SHARE, F32_ONEDNN_ROWS, PLAIN_ROWS, Linear, choose_plain_rows, f32_copies_fit,
                               make_linear, onednn_available, transposed)
from worker_svc.models import load_model

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _data(dtype, out=96, inp=64, rows=7, seed=0):
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(out, inp, generator=gen).to(dtype)
    b = torch.randn(out, generator=gen).to(dtype)
    x = torch.randn(rows, inp, generator=gen).to(dtype)
    return w, b, x


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_bias", [False, True])
@pytest.mark.parametrize("vocab", [False, True])
def test_every_layout_computes_f_linear(dtype, with_bias, vocab):
    w, b, x = _data(dtype)
    bias = b if with_bias else None
    lin = make_linear(w, bias, vocab=vocab)
    for rows in (1, 7, 64):  # any row count runs on a layout made once
        xs = torch.randn(rows, x.shape[1], generator=torch.Generator().manual_seed(rows)).to(dtype)
        want = F.linear(xs.double(), w.double(), None if bias is None else bias.double())
        got = lin(xs)
        assert got.shape == (rows, w.shape[0]) and got.dtype == dtype
        err = ((got.double() - want).abs().max() / want.abs().max()).item()
        assert err < TOL[dtype], (lin.kind, err)


def test_the_cpu_picks_the_layouts_the_measurements_chose():
    w32, _, _ = _data(torch.float32)
    assert make_linear(w32, None).kind == "mm"
    assert make_linear(w32, None, vocab=True).kind == ("onednn" if onednn_available(torch.float32) else "linear")
    w16, _, _ = _data(torch.bfloat16)
    assert make_linear(w16, None).kind == ("onednn" if onednn_available(torch.bfloat16) else "linear")
    assert make_linear(w32.half(), None).kind == "linear"  # float16 on a CPU: F.linear, unchanged


def test_f_linear_takes_over_from_the_fewest_rows_where_it_wins_at_every_larger_count():
    # {rows: (onednn s, F.linear s)}; F.linear must be 1.15x faster to count as a win
    assert choose_plain_rows({256: (1.0, 1.2), 384: (2.0, 1.0), 512: (2.5, 1.4)}) == 384
    assert choose_plain_rows({256: (2.0, 1.0), 384: (1.0, 1.2), 512: (2.5, 1.4)}) == 512  # not at 384: from 512
    assert choose_plain_rows({256: (2.0, 1.0), 384: (2.0, 1.0), 512: (2.0, 1.0)}) == 256
    assert choose_plain_rows({256: (1.0, 1.0), 384: (1.1, 1.0), 512: (1.0, 2.0)}) is None  # 1.1x is no win
    assert choose_plain_rows({}) is None


@pytest.mark.skipif(not onednn_available(torch.bfloat16), reason="oneDNN's bfloat16 linear does not run here")
def test_an_onednn_layer_runs_f_linear_on_its_plain_weight_from_plain_rows_on():
    w, b, _ = _data(torch.bfloat16, out=64, inp=96)
    lin = make_linear(w, b)
    assert lin.kind == "onednn" and (lin.plain is None) == (lin.plain_rows == 0)
    assert lin.plain is None or (lin.plain.data_ptr() == w.data_ptr() and lin.plain_rows in PLAIN_ROWS)  # no copy
    lin = Linear("onednn", lin.weight, b, 64, w, 40)
    for rows in (1, 39, 40, 300):
        x = torch.randn(rows, 96, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)
        want = F.linear(x, w, b) if rows >= 40 else torch.ops.mkldnn._linear_pointwise(x, lin.weight, b, "none", [], "")
        assert torch.equal(lin(x), want), rows
    assert make_linear(w, None, vocab=True).plain is None  # the lm_head runs on sampled rows only: never timed
    big = torch.zeros(4096, 2048, dtype=torch.bfloat16)  # a 512-row call of 8.6 GFLOP: kept on oneDNN, untimed
    assert make_linear(big, None).plain is None


@pytest.mark.skipif(not onednn_available(torch.float32), reason="oneDNN's float32 linear does not run here")
@pytest.mark.parametrize("with_bias", [False, True])
def test_without_the_panel_kernel_a_float32_layer_with_its_copy_runs_onednn_for_small_calls_and_mm_otherwise(
        with_bias, monkeypatch):
    monkeypatch.setattr(linear, "_PANELS_OK", [None])  # a CPU without AVX-512 (test_f32_gemm.py covers those)
    w, b, _ = _data(torch.float32, out=96, inp=64)
    bias = b if with_bias else None
    lin = make_linear(transposed(w), bias, f32_copy=True)
    assert lin.panels is None
    assert lin.kind == "mm" and lin.small is not None
    assert make_linear(transposed(w), bias).small is None  # no copy unless asked (f32_copies_fit)
    lo, hi = F32_ONEDNN_ROWS
    for rows in (1, lo - 1, lo, 16, hi, hi + 1, 64):
        x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
        small = lo <= rows <= hi
        want = torch.ops.mkldnn._linear_pointwise(x, lin.small, bias, "none", [], "") if small else \
            (torch.mm(x, lin.weight) if bias is None else torch.addmm(bias, x, lin.weight))
        assert torch.equal(lin(x), want), rows  # the call goes where the row count says
        ref = F.linear(x.double(), w.double(), None if bias is None else bias.double())
        assert ((lin(x).double() - ref).abs().max() / ref.abs().max()).item() < TOL[torch.float32], rows


def test_float32_copies_are_made_only_where_they_fit_in_a_share_of_available_memory():
    with open("/proc/meminfo", encoding="ascii") as f:
        available = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    assert f32_copies_fit(2**20)  # a megabyte fits on any machine that runs this suite
    assert not f32_copies_fit(int(2 * F32_COPY_SHARE * available))  # twice the share never does


def test_a_transposed_weight_is_used_in_place():
    w, _, x = _data(torch.float32)
    view = transposed(w)
    assert torch.equal(view, w) and view.t().is_contiguous() and not view.is_contiguous()
    lin = make_linear(view, None)
    assert lin.kind == "mm" and lin.weight.data_ptr() == view.data_ptr()  # no copy
    assert torch.equal(lin(x), torch.mm(x, view.t()))


def test_the_layout_is_a_dataclass_with_a_named_kind():
    w, b, x = _data(torch.float32)
    lin = Linear("linear", w, b, w.shape[0])
    assert torch.equal(lin(x), F.linear(x, w, b))


def test_float32_lean_weights_are_the_modules_storage(tiny_llama_dir):
    loaded = load_model(tiny_llama_dir, dtype="float32")
    lean = LeanModel(loaded.model)
    attn, mlp = loaded.model.model.layers[0].self_attn, loaded.model.model.layers[0].mlp
    layer = lean.layers[0]
    qkv = layer.qkv.weight  # [in, out] contiguous
    assert layer.qkv.kind == "mm" and qkv.is_contiguous()
    start, end = qkv.data_ptr(), qkv.data_ptr() + qkv.numel() * qkv.element_size()
    for m in (attn.q_proj, attn.k_proj, attn.v_proj):
        assert start <= m.weight.data_ptr() < end  # a view, not a copy
    assert attn.o_proj.weight.data_ptr() == layer.o.weight.data_ptr()
    assert mlp.down_proj.weight.data_ptr() == layer.down.weight.data_ptr()
    # the transformers modules still compute what they did
    x = torch.randn(3, attn.q_proj.in_features)
    assert torch.allclose(torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], 1), layer.qkv(x), atol=1e-5)
    # a second lean model over the same modules (two runners on one model) lays nothing out again
    again = LeanModel(loaded.model)
    assert again.layers[0].o.weight.data_ptr() == layer.o.weight.data_ptr()
    # a tiny model's copies for small calls fit anywhere: the (AVX-512) panel kernel's where it runs, else oneDNN's
    panels = linear.fast_panel_ops(qkv) is not None
    assert (layer.o.panels is not None) == panels and (lean.lm_head.panels is not None) == panels
    assert (layer.o.small is not None) == (not panels and onednn_available(torch.float32))
