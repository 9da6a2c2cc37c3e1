"""Batch invariance of cuda/paged_attention.cu (issue 48), built for the host (conftest.py) and run through
CupyAttentionBackend(batch_invariant=True): a row's output is the same bits whether it is computed in a whole-prompt
prefill, in a chunk after a cached prefix, or as a decode, alone or beside other sequences of other lengths, first or
last in the batch; float32 and bfloat16, with a sliding window that is not a multiple of the key tile, and over an
int8 cache. The fast mode (batch_invariant False) splits a decode by the batch and does not agree: checked too, so
that the comparison is shown able to fail."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.kernels.invariance_cases import decode_and_chunk_cases, make_scene
from pagedserve_common.kv_geometry import KVGeometry
from worker_svc.attention.cupy_backend import CupyAttentionBackend
from worker_svc.worker import make_backend, wants_batch_invariance

pytestmark = pytest.mark.timeout(600)


@pytest.mark.parametrize("window", [0, 37])
@pytest.mark.parametrize("dtype,cache", [(torch.float32, None), (torch.bfloat16, None), (torch.float32, torch.int8)])
@pytest.mark.parametrize("heads", [(4, 1), (6, 2)])
def test_a_rows_output_is_the_same_bits_however_its_step_is_made_up(launcher, heads, dtype, cache, window):
    rng = np.random.default_rng([len(heads), heads[0], window, 0 if cache is None else 8, dtype.itemsize])
    backend = CupyAttentionBackend(launcher, num_threads=64, batch_invariant=True)
    scene = make_scene(backend, rng, dtype, cache, heads, 64)
    cases = dict(decode_and_chunk_cases(scene, backend, window))
    want = cases.pop("prefill")
    assert torch.isfinite(want).all()
    for name, got in cases.items():
        assert torch.equal(got, want), f"{name}: not the prefill's bits"
    decodes = [grid for name, grid, _ in launcher.launches if name.startswith("paged_decode_")]
    assert decodes and all(grid[2] == 1 for grid in decodes)  # never split
    assert not any("reduce" in name for name, _, _ in launcher.launches)


def test_the_fast_mode_splits_decodes_by_the_batch_and_gives_other_bits(launcher):
    """Without batch invariance a lone decode is split over CTAs (the batch alone cannot fill the SMs) and merged:
    other sums, other bits; so the test above is able to tell."""
    rng = np.random.default_rng(48)
    backend = CupyAttentionBackend(launcher, num_threads=64, min_partition=32)
    scene = make_scene(backend, rng, torch.float32, None, (4, 1), 64)
    cases = dict(decode_and_chunk_cases(scene, backend, 0))
    want = cases.pop("prefill")
    assert any(grid[2] > 1 for name, grid, _ in launcher.launches if name.startswith("paged_decode_"))
    assert not torch.equal(cases["decode alone"], want)
    assert torch.allclose(cases["decode alone"], want, rtol=1e-5, atol=1e-6)


def test_a_forced_split_and_batch_invariance_are_refused_together(launcher):
    with pytest.raises(ValueError, match="partition_size forces a decode split"):
        CupyAttentionBackend(launcher, partition_size=64, batch_invariant=True)


@pytest.mark.parametrize("invariant", [True, False])
def test_the_worker_gives_the_gpu_backend_its_batch_invariant_flag(invariant):
    geometry = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=64, dtype="bfloat16")
    backend = make_backend("auto", "cuda:0", geometry, batch_invariant=invariant)  # cupy is imported lazily
    assert isinstance(backend, CupyAttentionBackend) and backend.batch_invariant is invariant


@pytest.mark.parametrize("setting,device,want", [("auto", "cpu", True), ("auto", "cuda:0", False), ("on", "cuda", True),
                                                 ("on", "cpu", True), ("off", "cpu", False), ("off", "cuda:1", False)])
def test_batch_invariance_is_on_by_default_on_a_cpu_and_asked_for_on_a_gpu(setting, device, want):
    """auto: on where the invariant kernels' cost is measured (the CPU); a GPU's dense_gemm.cu is not, yet."""
    assert wants_batch_invariance(setting, device) is want


def test_an_unknown_batch_invariant_setting_is_refused():
    with pytest.raises(ValueError, match="batch_invariant must be one of auto, on, off, got 'yes'"):
        wants_batch_invariance("yes", "cpu")
