"""The C++ CPU kernel's sliding window (window > 0: the row at position p sees keys p - window < q <= p) against the
float64 reference, on paged batches whose blocks wholly before the window are NaN (codes and scales too, for 8-bit
caches): the walk starts at the block holding the first visible key, so none of them may reach the output."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from tests.support.attention import check, windowed_batch
from worker_svc.attention import AttentionMetadata, reference_attention
from worker_svc.attention import cpu_backend
from worker_svc.attention.cpu_backend import CpuAttentionBackend, int8_qk_width
from worker_svc.attention.quant import quantize, raw

KINDS = [["decode"] * 6, ["chunk", "prefill"], ["decode", "chunk", "prefill", "decode", "chunk", "decode"]]


@pytest.fixture(scope="module")
def backend() -> CpuAttentionBackend:
    return CpuAttentionBackend()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [256, 64, 12])  # Gemma 3's; the 16-key block paths' size without a window; scalar
@pytest.mark.parametrize("heads", [(4, 1), (6, 2)])
@pytest.mark.parametrize("kinds", KINDS)
@pytest.mark.parametrize("block_size,window", [(16, 16), (16, 37), (8, 5), (32, 1)])
def test_windowed_batches_match_the_reference(backend, block_size, window, kinds, heads, head_dim, dtype):
    rng = np.random.default_rng([block_size, window, len(kinds), *heads, head_dim])
    query, pool, meta, poisoned = windowed_batch(rng, kinds, block_size, *heads, head_dim, dtype, window)
    assert poisoned > 0
    check(query, pool, meta, dtype, backend, window=window)


@pytest.mark.parametrize("dtype", [torch.int8, torch.float8_e4m3fn])
@pytest.mark.parametrize("head_dim", [64, 256])
def test_8bit_caches_with_a_window_match_the_reference_on_the_same_codes(backend, dtype, head_dim):
    rng = np.random.default_rng(head_dim)
    query, pool, meta, _ = windowed_batch(rng, KINDS[2], 16, 4, 1, head_dim, torch.float32, 23)
    codes, scales = quantize(pool, dtype)
    unseen = torch.isnan(pool).any(-1)
    raw(codes)[unseen] = 0x7F
    scales[unseen] = float("nan")
    backends = [backend] + ([CpuAttentionBackend(int8_qk=True)] if dtype == torch.int8 and int8_qk_width(
        backend.lib) else [])
    scale = 1 / math.sqrt(head_dim)
    ref = reference_attention(query, codes, meta, scale, scales, window=23)
    for b in backends:  # the int8 Q.K path scores whole blocks from the codes; its rows start inside them
        out = b.forward(query, codes, meta, scale, scales, window=23)
        assert torch.isfinite(out).all()
        rel = (torch.linalg.norm(out.double() - ref) / torch.linalg.norm(ref)).item()
        assert rel < (2e-2 if b.int8_qk else 1e-5), (b.int8_qk, rel)


@pytest.mark.parametrize("head_dim", [64, 256])
def test_a_row_gets_the_same_bits_as_a_decode_and_inside_a_prefill_chunk(backend, head_dim):
    """Batch invariance with a window: each row of a 40-token chunk (its first rows' windows inside the context's
    start, its last ones' cut) equals that position attended alone as a decode, bit for bit."""
    rng = np.random.default_rng(1)
    s, q_len, window, bs = 90, 40, 30, 16
    table = rng.permutation(-(-s // bs)).tolist()
    pool = torch.randn(2, len(table), bs, 1, head_dim)
    query = torch.randn(q_len, 4, head_dim)
    chunk = backend.forward(query, pool, AttentionMetadata.build([q_len], [s], [table], bs), 0.0625, window=window)
    for j in range(q_len):
        p = s - q_len + j
        alone = backend.forward(query[j:j + 1], pool, AttentionMetadata.build([1], [p + 1], [table], bs), 0.0625,
                                window=window)
        assert torch.equal(alone[0], chunk[j]), j


def test_a_chunk_longer_than_the_kernel_takes_goes_to_sdpa_with_the_window(monkeypatch):
    backend = CpuAttentionBackend(batch_invariant=False)
    rng = np.random.default_rng(2)
    long_q = cpu_backend.MAX_KERNEL_Q_LEN + 5
    lens, q_lens = [700, long_q + 100, 90], [1, long_q, 30]
    need = [-(-s // 16) for s in lens]
    tables = [list(range(sum(need[:i]), sum(need[:i + 1]))) for i in range(3)]
    pool = torch.from_numpy(rng.standard_normal((2, sum(need), 16, 1, 64))).float()
    meta = AttentionMetadata.build(q_lens, lens, tables, 16)
    query = torch.from_numpy(rng.standard_normal((sum(q_lens), 4, 64))).float()
    calls = []
    prefills = backend._prefills
    monkeypatch.setattr(backend, "_prefills", lambda *a, **k: calls.append(k["window"]) or prefills(*a, **k))
    check(query, pool, meta, torch.float32, backend, window=64)
    assert calls == [64]


def test_a_negative_window_is_refused(backend):
    rng = np.random.default_rng(0)
    query, pool, meta, _ = windowed_batch(rng, ["decode"], 8, 4, 2, 16, torch.float32, 5)
    with pytest.raises(ValueError, match="window must be 0"):
        backend.forward(query, pool, meta, 0.25, window=-1)
