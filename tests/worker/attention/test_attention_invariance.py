"""The CPU attention kernel under batch invariance, on every CPU path this machine runs (each its own build and
run-time cap: worker_svc/cpu_path.py): a query row's output has the same bits as a decode, inside a prefill chunk
that starts anywhere before it, and beside other sequences, for float32, bfloat16 and int8 pools (int8: with the
int8 Q.K path where the build has it)."""

from __future__ import annotations

import pytest
import torch

from worker_svc import cpu_path
from worker_svc.attention import AttentionMetadata
from worker_svc.attention.cpu_backend import CpuAttentionBackend, int8_qk_width, load_library
from worker_svc.cpu_features import cpu_flags

PATHS = [p for p in cpu_path.supported(cpu_flags()) if p != "native"] or ["native"]


@pytest.fixture(scope="module", params=PATHS)
def lib(request):
    return load_library(cpu=cpu_path.PATHS[request.param])


def _pool(dtype, gen):
    kv = torch.randn(2, 16, 16, 3, 64, generator=gen)
    if dtype != torch.int8:
        return kv.to(dtype), None
    scales = kv.abs().amax(-1) / 127
    return torch.round(kv / scales[..., None]).to(torch.int8), scales.contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_a_row_has_the_same_bits_however_it_is_batched(lib, dtype):
    gen = torch.Generator().manual_seed(3)
    kv, scales = _pool(dtype, gen)
    qdtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
    q = torch.randn(70, 9, 64, generator=gen).to(qdtype)
    other_q = torch.randn(40, 9, 64, generator=gen).to(qdtype)
    table, other_table = list(range(5)), list(range(5, 10))
    backends = [CpuAttentionBackend(lib=lib)]
    if dtype == torch.int8 and int8_qk_width(lib):
        backends.append(CpuAttentionBackend(lib=lib, int8_qk=True))
    for be in backends:
        def attend(qs, q_lens, seq_lens, tables):
            meta = AttentionMetadata.build(q_lens, seq_lens, tables, 16)
            return be.forward(torch.cat(qs), kv, meta, 0.125, scales)

        full = attend([q], [70], [70], [table])  # the whole prompt as one chunk
        for start in (1, 16, 17, 50, 64, 68):  # a chunk from `start` to the end: every row's tile moves
            assert torch.equal(attend([q[start:]], [70 - start], [70], [table]), full[start:]), (be.int8_qk, start)
        for pos in (17, 18, 45, 69):  # as a decode, alone and beside other sequences
            decode = attend([q[pos:pos + 1]], [1], [pos + 1], [table])[0]
            assert torch.equal(decode, full[pos]), (be.int8_qk, pos)
            beside = attend([other_q, q[pos:pos + 1], other_q[:1]], [40, 1, 1], [40, pos + 1, 30],
                            [other_table, table, other_table])
            assert torch.equal(beside[40], full[pos]), (be.int8_qk, pos)
