"""Prompt logprobs on the worker, in the step's one packed forward: the lm_head also runs on the scheduled prompt rows
of the sequences that ask (SamplingParams.prompt_logprobs), and each row's float32 log_softmax gives the next prompt
token's logprob, its rank and the top ones.

Exactness: row j's logits are those of the prompt's tokens 0 .. j, whatever else the step packs (the lean forward's
linear layers are M-invariant: a row's logits do not depend on how many rows run), so a chunked prefill, a
recomputation after a preemption or a migration, and a request alone give the same values.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from pagedserve_common.step import PositionLogprobs, PromptLogprobs, TokenLogprob
from worker_svc.batch import SeqState

# log_softmax runs over at most this many rows at a time: each slice makes a [rows, vocab] float32 copy (64 MiB
# at a 64k vocabulary), not one the size of a whole chunk of prompt rows.
SLICE_ROWS = 256


@dataclass(slots=True)
class PromptRows:
    """The step's sequences whose scheduled tokens include prompt rows with a next prompt token, and those rows.

    Invariant: sequence i's prompt rows this step are token indices [first_rows[i], first_rows[i] + counts[i]),
    all below its num_prompt_tokens - 1 (the last prompt token's row predicts the first output: it is a sample's,
    not a prompt logprob's); row j gives position j + 1."""

    indices: list[int]  # the sequences' indices among the step's scheduled sequences
    seqs: list[SeqState]
    first_rows: list[int]
    counts: list[int]
    target_ids: list[int]  # the next prompt token of every row, packed in order

    @staticmethod
    def of(scheduled: list[SeqState]) -> PromptRows | None:
        """Before the step's advance (it reads num_computed_tokens); None when no sequence has such rows (the
        common case: one attribute read a sequence)."""
        found = None
        for i, s in enumerate(scheduled):
            if s.sampling.prompt_logprobs is None:
                continue
            lo = s.num_computed_tokens
            hi = min(lo + s.num_scheduled_tokens, s.num_prompt_tokens - 1)
            if hi <= lo:
                continue
            if found is None:
                found = PromptRows([], [], [], [], [])
            found.indices.append(i)
            found.seqs.append(s)
            found.first_rows.append(lo)
            found.counts.append(hi - lo)
            found.target_ids.extend(s.token_ids[lo + 1:hi + 1])
        return found

    @property
    def num_rows(self) -> int:
        return len(self.target_ids)

    def rows(self, query_start_loc: np.ndarray) -> np.ndarray:
        """The packed rows, in order: a sequence's scheduled tokens start at query_start_loc[i], its first
        scheduled token being its first prompt row here."""
        return np.concatenate([np.arange(query_start_loc[i], query_start_loc[i] + n, dtype=np.int64)
                               for i, n in zip(self.indices, self.counts)])

    def gather(self, logits: torch.Tensor) -> dict[int, PromptLogprobs]:
        """seq_id -> its PromptLogprobs, from the rows' logits [num_rows, vocab] (any dtype: float32 from here on)."""
        num_rows, vocab = logits.shape
        if num_rows != self.num_rows:
            raise ValueError(f"{num_rows} logits rows for {self.num_rows} prompt rows")
        num_top = min(max(s.sampling.prompt_logprobs for s in self.seqs), vocab)
        targets = torch.tensor(self.target_ids, dtype=torch.long, device=logits.device)
        own, ranks, top_vals, top_ids = [], [], [], []
        for a in range(0, num_rows, SLICE_ROWS):
            lp = torch.log_softmax(logits[a:a + SLICE_ROWS].float(), dim=-1)
            tok = lp.gather(1, targets[a:a + SLICE_ROWS, None])
            own.append(tok.squeeze(1))
            ranks.append((lp >= tok).sum(dim=-1))  # NOTE: vLLM's rank: ties count as ahead; >= 1 (itself)
            if num_top:
                vals, ids = lp.topk(num_top, dim=-1)  # sorted, most likely first
                top_vals.append(vals)
                top_ids.append(ids)
        own_l, rank_l = torch.cat(own).tolist(), torch.cat(ranks).tolist()
        vals_l = torch.cat(top_vals).tolist() if num_top else [()] * num_rows
        ids_l = torch.cat(top_ids).tolist() if num_top else [()] * num_rows
        out, at = {}, 0
        for s, first, n in zip(self.seqs, self.first_rows, self.counts):
            k = s.sampling.prompt_logprobs
            out[s.seq_id] = PromptLogprobs(first + 1, tuple(
                PositionLogprobs(TokenLogprob(self.target_ids[r], own_l[r]),
                                 tuple(TokenLogprob(t, v) for t, v in zip(ids_l[r][:k], vals_l[r][:k])), rank_l[r])
                for r in range(at, at + n)))
            at += n
        return out
