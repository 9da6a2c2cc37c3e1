"""Speculative decoding on the worker: a speculating sequence's drafts are verified against its own forward rows."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from worker_svc.batch import SeqState
from worker_svc.sampling import Sampler


@dataclass(slots=True)
class Verification:
    """The speculating sequences of one step (each scheduled as its last known token then its K drafts).

    Exactness: row j of a sequence with L committed tokens is sampled as plain decoding samples token L + j, with
    the same settings and the same uniform (worker_svc.uniforms: f(seed, position)), and draft j is accepted iff
    it is that token. So the tokens a sequence emits are the very ones it would emit without speculation, one a
    step (greedy: the argmax; sampled: the same inverse-CDF draw). In distribution this is rejection sampling
    against a deterministic draft d: d is accepted with probability p_j(d) (u falls in d's interval of the CDF),
    and on a refusal u is uniform over the rest, so the token drawn follows p_j with d removed, renormalised.
    """

    seqs: list[SeqState]
    indices: list[int]  # their indices among the step's scheduled sequences

    @staticmethod
    def of(scheduled: list[SeqState], sampling_rows: list[int]) -> Verification | None:
        """The step's speculating sequences among those sampling; None when none speculates (the common case)."""
        indices = [i for i in sampling_rows if scheduled[i].num_draft_tokens]
        return Verification([scheduled[i] for i in indices], indices) if indices else None

    @property
    def num_rows(self) -> int:
        return sum(1 + s.num_draft_tokens for s in self.seqs)

    def rows(self, query_start_loc: np.ndarray) -> np.ndarray:
        """The packed rows whose logits verify: each sequence's last 1 + K (its last known token's, its drafts')."""
        ends = query_start_loc[1:]
        return np.concatenate([np.arange(ends[i] - 1 - s.num_draft_tokens, ends[i])
                               for i, s in zip(self.indices, self.seqs)])

    def verify(self, sampler: Sampler, logits: torch.Tensor) -> list[tuple[int, int]]:
        """(drafts accepted, the token sampled after them) per sequence, from its rows' logits [num_rows, vocab].
        NOTE: no logits processing: the scheduler drafts only for sequences without logits rules, logprobs or
        bitmasks (worker_svc.batch._check_drafts refuses the rest)."""
        options, positions = [], []
        for s in self.seqs:
            k = s.num_draft_tokens
            num_known = len(s.token_ids) - k  # the committed tokens; row j samples token num_known + j
            options.extend([s.sampling] * (k + 1))
            positions.extend(range(num_known, num_known + k + 1))
        token_ids = sampler.sample(logits.float(), options, positions).token_ids
        out, at = [], 0
        for s in self.seqs:
            k = s.num_draft_tokens
            drafts, drawn = s.token_ids[len(s.token_ids) - k:], token_ids[at:at + k + 1]
            n = 0
            while n < k and drawn[n] == drafts[n]:
                n += 1
            out.append((n, drawn[n]))
            at += k + 1
        return out

    def settle(self, verdicts: list[tuple[int, int]]) -> None:
        """After the step's advance: each sequence keeps its accepted drafts and the token after them; its KV is
        valid up to its last accepted draft (the refused drafts' slots are written again when their positions are
        computed for real)."""
        for s, (n, tok) in zip(self.seqs, verdicts):
            refused = s.num_draft_tokens - n
            if refused:
                del s.token_ids[len(s.token_ids) - refused:]
                s.num_computed_tokens -= refused
            s.token_ids.append(tok)
            s.num_draft_tokens = 0
