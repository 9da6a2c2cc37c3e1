"""cuda/paged_attention.cu's sliding window (window > 0: the row at position p sees keys p - window < q <= p), built
for the host (conftest.py) and run through CupyAttentionBackend against the float64 reference: every block wholly
before a sequence's window NaN (codes and scales too, for an 8-bit cache), decodes split over several CTAs."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.support.attention import check, windowed_batch
from worker_svc.attention import reference_attention
from worker_svc.attention.cupy_backend import CupyAttentionBackend
from worker_svc.attention.quant import quantize, raw

pytestmark = pytest.mark.timeout(600)

NUM_THREADS = 64
KINDS = [["decode"] * 4, ["decode", "chunk", "prefill", "decode", "chunk"]]


def backend(launcher, **kw):
    return CupyAttentionBackend(launcher, num_threads=NUM_THREADS, poison_workspace=True, **kw)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("heads", [(4, 1), (6, 2)])
@pytest.mark.parametrize("kinds", KINDS)
@pytest.mark.parametrize("block_size,window,partition", [(16, 37, 16), (8, 5, None), (16, 80, 48)])
def test_windowed_batches_match_the_reference(launcher, block_size, window, partition, kinds, heads, head_dim, dtype):
    rng = np.random.default_rng([block_size, window, len(kinds), *heads, head_dim])
    be = backend(launcher, partition_size=partition)
    query, pool, meta, poisoned = windowed_batch(rng, kinds, block_size, *heads, head_dim, dtype, window)
    assert poisoned > 0
    check(query, pool, meta, dtype, be, window=window)
    if partition is not None and partition < window:  # the decode split over the window's keys, then merged
        decode = [grid for name, grid, _ in launcher.launches if name.startswith("paged_decode_") and
                  "reduce" not in name]
        assert decode[-1][2] == -(-window // partition)


@pytest.mark.parametrize("cache", [torch.int8, torch.float8_e4m3fn])
def test_8bit_caches_with_a_window_match_the_reference_on_the_same_codes(launcher, cache):
    rng = np.random.default_rng(8)
    be = backend(launcher, partition_size=16)
    query, pool, meta, _ = windowed_batch(rng, KINDS[1], 16, 4, 1, 64, torch.float32, 23)
    codes, scales = quantize(pool, cache)
    unseen = torch.isnan(pool).any(-1)
    raw(codes)[unseen] = 0x7F
    scales[unseen] = float("nan")
    out = be.forward(query, codes, meta, 0.125, scales, window=23)
    ref = reference_attention(query, codes, meta, 0.125, scales, window=23)
    assert torch.isfinite(out).all()
    assert (torch.linalg.norm(out.double() - ref) / torch.linalg.norm(ref)).item() < 1e-5


def test_an_unsupported_head_dim_falls_back_to_torch_with_the_window(launcher):
    rng = np.random.default_rng(9)
    query, pool, meta, _ = windowed_batch(rng, KINDS[1], 8, 4, 2, 16, torch.float32, 9)
    check(query, pool, meta, torch.float32, backend(launcher), window=9)
    assert not any(name.startswith("paged_") for name, _, _ in launcher.launches)


def test_a_negative_window_is_refused(launcher):
    rng = np.random.default_rng(0)
    query, pool, meta, _ = windowed_batch(rng, ["decode"], 8, 4, 2, 64, torch.float32, 5)
    with pytest.raises(ValueError, match="window must be 0"):
        backend(launcher).forward(query, pool, meta, 1 / math.sqrt(64), window=-1)
