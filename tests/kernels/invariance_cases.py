"""The batch-invariance scene of cuda/paged_attention.cu's tests (host shim and GPU): one target sequence whose rows
are computed every way a step can hold them (a whole-prompt prefill, a chunk after a cached prefix, a decode; alone,
beside decodes, beside a prefill and chunks; first or last in the batch), with a sliding window or not."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from tests.support.attention import scattered_tables
from worker_svc.attention import AttentionMetadata

BLOCK = 16
TARGET_LEN = 150  # the target sequence's keys: two whole key tiles (64) and a partial one


@dataclass(slots=True)
class Scene:
    """One pool holding the target sequence's keys and its neighbours', each at scattered blocks."""

    kv: torch.Tensor  # [2, nb, BLOCK, kvh, hd] (codes for an 8-bit cache)
    scales: torch.Tensor | None  # [2, nb, BLOCK, kvh] for an 8-bit cache
    tables: list[list[int]]  # 0: the target's; then the neighbours'
    lens: list[int]
    target_q: torch.Tensor  # [TARGET_LEN, H, hd]: the target's query at every position
    rng: np.random.Generator


def make_scene(backend, rng, dtype, cache, heads, hd, device="cpu") -> Scene:
    num_heads, num_kv_heads = heads
    lens = [TARGET_LEN, 260, 90, 33, 201]
    tables, num_blocks = scattered_tables(rng, lens, BLOCK)
    shape = (2, num_blocks, BLOCK, num_kv_heads, hd)
    kv = torch.zeros(shape, dtype=dtype if cache is None else cache, device=device)
    scales = None if cache is None else torch.zeros(shape[:-1], dtype=torch.float32, device=device)
    full = AttentionMetadata.build(lens, lens, tables, BLOCK, device=device)
    k = torch.from_numpy(rng.standard_normal((sum(lens), num_kv_heads, hd))).to(device, dtype)
    v = torch.from_numpy(rng.standard_normal((sum(lens), num_kv_heads, hd))).to(device, dtype)
    backend.write_kv(kv, k, v, full.slot_mapping, kv_scales=scales)
    target_q = torch.from_numpy(rng.standard_normal((TARGET_LEN, num_heads, hd))).to(device, dtype)
    return Scene(kv, scales, tables, lens, target_q, rng)


def target_rows(backend, scene: Scene, seq_len: int, q_len: int, neighbours: list[tuple[int, int]], first: bool,
                window: int) -> torch.Tensor:
    """The target's output rows (positions seq_len - q_len .. seq_len - 1) from one forward in which it has seq_len
    keys and q_len queries, beside `neighbours` ((neighbour index, q_len) each, with their whole context)."""
    seqs = [(0, seq_len, q_len)] + [(i, scene.lens[i], q) for i, q in neighbours]
    if not first:
        seqs = seqs[1:] + seqs[:1]
    queries = []
    for i, s, q in seqs:
        if i == 0:
            queries.append(scene.target_q[s - q:s])
        else:
            h, hd = scene.target_q.shape[1:]
            queries.append(torch.from_numpy(scene.rng.standard_normal((q, h, hd))).to(scene.target_q))
    meta = AttentionMetadata.build([q for _, _, q in seqs], [s for _, s, _ in seqs],
                                   [scene.tables[i] for i, _, _ in seqs], BLOCK, device=scene.kv.device)
    query = torch.cat(queries)
    out = backend.forward(query, scene.kv, meta, 1 / math.sqrt(query.shape[-1]), kv_scales=scene.scales,
                          window=window)
    start = 0 if first else query.shape[0] - q_len  # the target is first or last
    return out[start:start + q_len]


def decode_and_chunk_cases(scene, backend, window):
    """(name, rows of positions TARGET_LEN - 1 and 100) for each way the target's rows can be computed."""
    last, mid = TARGET_LEN - 1, 100
    prefill = target_rows(backend, scene, TARGET_LEN, TARGET_LEN, [], True, window)
    yield "prefill", prefill[[last, mid]]
    batches = {"alone": ([], True), "beside decodes": ([(1, 1), (2, 1), (4, 1)], False),
               "beside a prefill and chunks": ([(1, 1), (3, 33), (4, 40)], True)}
    for name, (neighbours, first) in batches.items():
        chunk = target_rows(backend, scene, TARGET_LEN, TARGET_LEN - 37, neighbours, first, window)
        decode_last = target_rows(backend, scene, TARGET_LEN, 1, neighbours, first, window)
        decode_mid = target_rows(backend, scene, mid + 1, 1, neighbours, not first, window)
        yield f"chunk {name}", chunk[[last - 37, mid - 37]]
        yield f"decode {name}", torch.cat([decode_last, decode_mid])
