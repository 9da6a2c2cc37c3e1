"""Per-step attention metadata: packed-query offsets, context lengths, block tables and KV write slots."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Built once per step by the caller and shared, read-only, by every layer.

    B sequences contribute T = sum(query_lens) new tokens, packed sequence after sequence into the [T, ...]
    query/key/value tensors. Sequences may come in any order: decodes (q_len 1) need not be first.

    NOTE: for sequence i with q_len_i = query_start_loc[i+1] - query_start_loc[i], the new tokens sit at
    positions seq_lens[i] - q_len_i .. seq_lens[i] - 1 and query token at position p attends to keys 0..p
    (causal within the chunk, full over the previously cached tokens). 1 <= q_len_i <= seq_lens[i].
    """

    query_start_loc: torch.Tensor  # int32 [B+1]: cu_seqlens of the packed query tokens
    seq_lens: torch.Tensor  # int32 [B]: context length after this step's tokens are written
    block_tables: torch.Tensor  # int32 [B, max_num_blocks]: pad 0; first ceil(seq_lens[i]/block_size) valid
    slot_mapping: torch.Tensor  # int64 [T]: pool slot (block_id * block_size + offset) of each new token
    max_query_len: int
    max_seq_len: int
    num_decodes: int  # sequences with q_len 1 (== their token count); all-decode iff num_decodes == num_seqs
    decode_seqs: torch.Tensor  # int64 [num_decodes]: indices (into B) of the q_len-1 sequences, ascending
    max_decode_seq_len: int  # max seq_len over the decode sequences (0 if none): sizes the batched gather
    # Host mirrors, so backends can loop over sequences without a device->host sync per layer.
    query_start_loc_host: np.ndarray  # int64 [B+1]
    seq_lens_host: np.ndarray  # int64 [B]
    positions_host: np.ndarray  # int64 [T]: each new token's position in its sequence (the model's position ids)

    @property
    def num_seqs(self) -> int:
        return int(self.seq_lens_host.shape[0])

    @property
    def num_tokens(self) -> int:
        return int(self.query_start_loc_host[-1])

    @property
    def is_all_decode(self) -> bool:
        return self.num_decodes == self.num_seqs

    @classmethod
    def build(
        cls,
        query_lens: Sequence[int] | np.ndarray,
        seq_lens: Sequence[int] | np.ndarray,
        block_tables: Sequence[Sequence[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Build all tensors with numpy on the host, then move them to `device` in one copy each. NOTE: it trusts
        its arguments (1 <= q_len <= seq_len, tables long enough, ids in the pool): the worker's one check of a
        plan is worker_svc.batch.check_plan, before anything is built."""
        q = np.asarray(query_lens, dtype=np.int64).reshape(-1)
        s = np.asarray(seq_lens, dtype=np.int64).reshape(-1)
        n = q.shape[0]
        if s.shape[0] != n or len(block_tables) != n:
            raise ValueError(f"{n} query_lens, {s.shape[0]} seq_lens, {len(block_tables)} block tables")
        if block_size <= 0:
            raise ValueError(f"block_size must be positive, got {block_size}")

        # Padded block tables: one boolean-mask scatter instead of a row-by-row copy.
        nb = np.fromiter((len(t) for t in block_tables), dtype=np.int64, count=n)
        width = int(nb.max()) if n else 0
        bt = np.zeros((n, width), dtype=np.int64)
        if width:
            bt[np.arange(width)[None, :] < nb[:, None]] = np.concatenate(
                [np.asarray(t, dtype=np.int64) for t in block_tables if len(t)]
            )

        qsl = np.zeros(n + 1, dtype=np.int64)
        np.cumsum(q, out=qsl[1:])
        # Per token: its sequence, then its position = first new position + offset within the chunk.
        seq_of = np.repeat(np.arange(n, dtype=np.int64), q)
        pos = np.arange(qsl[-1], dtype=np.int64) - qsl[seq_of] + (s - q)[seq_of]
        slots = bt[seq_of, pos // block_size] * block_size + pos % block_size

        decode_seqs = np.flatnonzero(q == 1)

        def dev(a: np.ndarray, dtype: torch.dtype) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device=device, dtype=dtype)

        return cls(
            query_start_loc=dev(qsl, torch.int32),
            seq_lens=dev(s, torch.int32),
            block_tables=dev(bt, torch.int32),
            slot_mapping=dev(slots, torch.int64),
            max_query_len=int(q.max()) if n else 0,
            max_seq_len=int(s.max()) if n else 0,
            num_decodes=int(decode_seqs.shape[0]),
            decode_seqs=dev(decode_seqs, torch.int64),
            max_decode_seq_len=int(s[decode_seqs].max()) if decode_seqs.size else 0,
            query_start_loc_host=qsl,
            seq_lens_host=s,
            positions_host=pos,
        )
