"""Paged attention in plain torch ops: a batched path for decodes, SDPA per sequence for prefill chunks."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from worker_svc.attention.backend import AttentionBackend, check_shapes
from worker_svc.attention.metadata import AttentionMetadata
from worker_svc.attention.quant import dequantize, quantize, raw

_UPCAST = (torch.float16, torch.bfloat16)


class TorchAttentionBackend(AttentionBackend):
    """Works on any torch device; written for the CPU worker and as a fallback.

    Pool layout: kv_layer is [2, num_blocks, block_size, num_kv_heads, head_dim] (0 = K, 1 = V), so one block
    of K is a contiguous [block_size, num_kv_heads, head_dim] tile and gathering a block table row yields the
    sequence's keys in position order.

    float32 is computed in float32; float16/bfloat16 are upcast to float32 for the matmuls and softmax, and the
    output is cast back to the query dtype. An 8-bit cache's blocks are dequantised (codes x scales, in float32)
    as they are gathered, then attended like a float32 pool.
    """

    name = "torch"

    def __init__(self) -> None:
        # NOTE: the decode gather reuses one buffer across layers and steps: a fresh tensor of tens of MB per
        # layer spends most of its time faulting its pages in (measured 33 ms vs 5.5 ms at 64 x 512 tokens).
        self._gather_buf: torch.Tensor | None = None

    def _gather(self, kv_layer: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """kv_layer's blocks `ids` into a reused buffer: [2, len(ids), block_size, kv_heads, head_dim]."""
        shape = (2, ids.numel(), *kv_layer.shape[2:])
        numel = shape[0] * shape[1] * shape[2] * shape[3] * shape[4]
        buf = self._gather_buf
        if buf is None or buf.numel() < numel or buf.dtype != kv_layer.dtype or buf.device != kv_layer.device:
            buf = self._gather_buf = torch.empty(numel, dtype=kv_layer.dtype, device=kv_layer.device)
        return torch.index_select(kv_layer, 1, ids, out=buf[:numel].view(shape))

    def _gather_values(self, kv_layer: torch.Tensor, ids: torch.Tensor, kv_scales: torch.Tensor | None) -> torch.Tensor:
        """_gather, and for an 8-bit cache the dequantised float32 values of those blocks."""
        if kv_scales is None:
            return self._gather(kv_layer, ids)
        codes = torch.index_select(raw(kv_layer), 1, ids).view(kv_layer.dtype)
        return dequantize(codes, torch.index_select(kv_scales, 1, ids))

    def write_kv(
        self, kv_layer: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
        kv_scales: torch.Tensor | None = None,
    ) -> None:
        two, num_blocks, block_size, kvh, hd = kv_layer.shape
        # NOTE: view (not reshape/flatten) so a non-viewable pool raises instead of writing into a copy.
        flat = raw(kv_layer).view(two, num_blocks * block_size, kvh, hd)
        slots = slot_mapping.to(device=kv_layer.device, dtype=torch.int64)
        if kv_scales is None:
            flat[0].index_copy_(0, slots, key.to(kv_layer.dtype))
            flat[1].index_copy_(0, slots, value.to(kv_layer.dtype))
            return
        # Quantised on the way in: only this step's rows are ever converted, never the cache.
        flat_scales = kv_scales.view(two, num_blocks * block_size, kvh)
        for i, x in enumerate((key, value)):
            codes, scales = quantize(x, kv_layer.dtype)
            flat[i].index_copy_(0, slots, raw(codes))
            flat_scales[i].index_copy_(0, slots, scales)

    def forward(
        self, query: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float,
        kv_scales: torch.Tensor | None = None, window: int = 0,
    ) -> torch.Tensor:
        check_shapes(query, kv_layer, kv_scales)
        if query.shape[0] != meta.num_tokens:
            raise ValueError(f"query has {query.shape[0]} tokens, metadata {meta.num_tokens}")
        if window < 0:
            raise ValueError(f"window must be 0 (none) or positive, got {window}")
        if meta.is_all_decode:
            # Decode row i is sequence i: no query gather, no output scatter.
            return self._decode(
                query, kv_layer, meta.block_tables, meta.seq_lens, meta.seq_lens_host, meta.max_decode_seq_len, scale,
                kv_scales, window,
            )
        out = torch.empty_like(query)
        if meta.num_decodes:
            idx = meta.decode_seqs
            rows = meta.query_start_loc.index_select(0, idx).long()
            host_idx = np.flatnonzero(np.diff(meta.query_start_loc_host) == 1)
            out[rows] = self._decode(
                query.index_select(0, rows),
                kv_layer,
                meta.block_tables.index_select(0, idx),
                meta.seq_lens.index_select(0, idx),
                meta.seq_lens_host[host_idx],
                meta.max_decode_seq_len,
                scale,
                kv_scales,
                window,
            )
        self._prefills(query, kv_layer, meta, scale, out, kv_scales=kv_scales, window=window)
        return out

    def _decode(
        self,
        query: torch.Tensor,
        kv_layer: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        seq_lens_host: np.ndarray,
        max_seq_len: int,
        scale: float,
        kv_scales: torch.Tensor | None = None, window: int = 0,
    ) -> torch.Tensor:
        """One query token per sequence: query [B, H, hd] -> [B, H, hd]. window > 0: each sequence's gather starts
        at the block holding its first visible key (seq_len - window), so blocks wholly before it are not read."""
        _, _, block_size, kvh, hd = kv_layer.shape
        b, h, _ = query.shape
        group = h // kvh
        if window > 0:
            first = np.maximum(seq_lens_host - window, 0) // block_size  # each sequence's first block read
            nb = int((-(-seq_lens_host // block_size) - first).max())
            cols = torch.from_numpy(first).to(block_tables.device)[:, None] + torch.arange(nb, device=block_tables.device)
            # NOTE: a column past a short sequence's table reads its last entry again: positions there are masked
            table = block_tables.gather(1, cols.clamp(max=block_tables.shape[1] - 1))
            base = torch.from_numpy(first * block_size).to(seq_lens.device)  # position of each gather's first row
        else:
            first, nb, table, base = None, -(-max_seq_len // block_size), block_tables, None
        length = nb * block_size
        # One gather for all sequences: [2, B*nb, bs, kvh, hd] -> [2, B, L, kvh, hd] (a fresh copy).
        ids = table[:, :nb].reshape(-1).long()
        kv = self._gather_values(kv_layer, ids, kv_scales).view(2, b, length, kvh, hd)
        if kv.dtype in _UPCAST:
            kv = kv.float()
        # NOTE: zero V past seq_len (and before the window): there 0 * NaN would still poison the output even with
        # probability 0. K needs no cleaning: its scores are overwritten with -inf below.
        end = seq_lens.long() if base is None else seq_lens.long() - base  # per row: visible rows are [start, end)
        rows = torch.arange(length, device=kv.device)[None, :]
        valid = rows < end[:, None]  # [B, L]
        if base is not None:
            start = (seq_lens.long() - window).clamp(min=0) - base
            valid &= rows >= start[:, None]
        if kv.device.type == "cpu":
            # Touch only the invalid heads and tails (cheap slices) rather than rewriting all of V through a mask.
            lens = seq_lens_host if first is None else seq_lens_host - first * block_size
            starts = [0] * b if first is None else (np.maximum(seq_lens_host - window, 0) - first * block_size).tolist()
            for i, (lo, n) in enumerate(zip(starts, lens.tolist())):
                if lo > 0:
                    kv[1, i, :lo].zero_()
                if n < length:
                    kv[1, i, n:].zero_()
        else:
            kv[1].masked_fill_(~valid[:, :, None, None], 0.0)
        # GQA without repeating KV: per kv head, one bmm over the batch whose rows are that head's query group.
        # NOTE: kv[0, :, :, j] is a strided [B, L, hd] view (row stride kvh*hd) that bmm reads in place; a
        # 4-D matmul over [B, kvh, L, hd] would first copy all of K and V to fold the batch dims.
        q = (query.to(kv.dtype) * scale).view(b, kvh, group, hd)  # scale the small side, not the scores
        scores = torch.stack([torch.bmm(q[:, j], kv[0, :, :, j].transpose(1, 2)) for j in range(kvh)], 1)
        scores.masked_fill_(~valid[:, None, None, :], float("-inf"))  # [B, kvh, group, L]
        probs = torch.softmax(scores, dim=-1)
        out = torch.stack([torch.bmm(probs[:, j], kv[1, :, :, j]) for j in range(kvh)], 1)  # [B, kvh, group, hd]
        return out.reshape(b, h, hd).to(query.dtype)

    def _prefills(
        self, query: torch.Tensor, kv_layer: torch.Tensor, meta: AttentionMetadata, scale: float, out: torch.Tensor,
        min_q_len: int = 2, kv_scales: torch.Tensor | None = None, window: int = 0,
    ) -> None:
        """Sequences with q_len >= min_q_len, one SDPA call each; writes their rows of `out`. window > 0: from the
        block holding the chunk's first visible key on, each query masked to its window."""
        _, _, block_size, kvh, hd = kv_layer.shape
        qsl, lens = meta.query_start_loc_host, meta.seq_lens_host
        for i in range(meta.num_seqs):
            start, end, s = int(qsl[i]), int(qsl[i + 1]), int(lens[i])
            q_len = end - start
            if q_len < min_q_len:
                continue
            nb = -(-s // block_size)
            first = max(0, s - q_len - window + 1) // block_size if window > 0 else 0  # blocks before: unseen
            base = first * block_size  # the position of the gather's first row
            ids = meta.block_tables[i, first:nb].long()
            # Slicing to :s drops the garbage past seq_len, so nothing needs masking for NaN here.
            kv = self._gather_values(kv_layer, ids, kv_scales).view(2, (nb - first) * block_size, kvh, hd)[:, :s - base]
            q = query[start:end]
            if q.dtype in _UPCAST or kv.dtype != q.dtype:  # NOTE: the CPU backend passes a float32 query
                q, kv = q.float(), kv.float()
            k = kv[0].transpose(0, 1).unsqueeze(0)  # [1, kvh, s, hd]
            v = kv[1].transpose(0, 1).unsqueeze(0)
            q = q.transpose(0, 1).unsqueeze(0)  # [1, H, q_len, hd]
            if s == q_len and (window <= 0 or s <= window):
                # Whole context is new (and inside any window): SDPA's top-left causal mask is exactly right.
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            else:
                # Query j sits at position s - q_len + j and sees keys 0..that position (bottom-right causal), or
                # with a window only the last `window` of them.
                qpos = torch.arange(s - q_len, s, device=q.device)[:, None]
                kpos = torch.arange(base, s, device=q.device)[None, :]
                mask = kpos <= qpos
                if window > 0:
                    mask &= kpos > qpos - window
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
            out[start:end] = o[0].transpose(0, 1).to(out.dtype)
