"""Speculative decoding's scheduler half: which sequences draft this step, how many tokens, and the counters."""

from __future__ import annotations

from dataclasses import dataclass, field

# NGRAM_MAX, NGRAM_MIN: the n-gram lengths looked up, longest first (vLLM's prompt_lookup_max / _min)
from pagedserve_common.config import NGRAM_MAX, NGRAM_MIN, SPECULATIVE
from scheduler_svc.core.ngram import propose
from scheduler_svc.core.request import Request

SPECULATIVE_METHODS = SPECULATIVE  # --speculative's methods (the Scheduler checks its config against them)
MAX_BACKOFF_STEPS = 32  # a sequence whose drafts keep failing drafts again after at most this many steps
# NOTE: drafts only while the step's tokens stay below this: a decode step of few sequences is bound by reading
# the weights, so verifying more tokens costs little; one of many sequences is compute-bound and each draft costs
# about what a token costs (measured on a 2-core CPU with the default model: docs/speculative.md).
MAX_STEP_TOKENS = 48


@dataclass(slots=True)
class SpecCounters:
    """Drafts verified since the last export (scheduler_svc.fleet.export drains them into /metrics)."""

    num_drafts: int = 0  # sequences that drafted, once per step
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)  # [j]: drafts accepted at draft position j


class Speculator:
    """Proposes n-gram drafts for decoding sequences (scheduler_svc.core.ngram) and backs off where they fail.

    NOTE: no drafts for a sequence whose samples need anything but the raw distribution (logprobs, penalties,
    logit_bias, allowed_token_ids, min_tokens, bad words, structured output): the worker verifies by sampling the
    raw rows.
    """

    def __init__(self, num_speculative_tokens: int, max_step_tokens: int = MAX_STEP_TOKENS) -> None:
        if num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens must be >= 1, got {num_speculative_tokens}")
        self.k = num_speculative_tokens
        self.max_step_tokens = max_step_tokens
        self.counters = SpecCounters(accepted_per_pos=[0] * num_speculative_tokens)

    def drafts(self, req: Request, num_room: int, max_model_len: int) -> list[int]:
        """The drafts of decoding sequence `req` this step, at most `num_room` (the step's room for them): [] when
        it may not draft, backs off, or finds no n-gram. NOTE: never more than its outputs can still use: the last
        of K drafts is followed by one more token, within max_tokens and max_model_len."""
        if req.spec_backoff:
            req.spec_backoff -= 1
            return []
        sp = req.sampling
        if sp.logprobs is not None or sp.needs_processing or req.constraint is not None:
            return []
        tokens = req.all_token_ids
        k = min(self.k, num_room, sp.max_tokens - len(req.output_token_ids) - 1, max_model_len - len(tokens) - 1)
        return propose(tokens, k, NGRAM_MAX, NGRAM_MIN) if k > 0 else []

    def verified(self, req: Request, num_drafts: int, num_accepted: int) -> None:
        """Counts one sequence's verified drafts; one that accepted none waits 1, 2, 4, ... steps before it drafts
        again (MAX_BACKOFF_STEPS at most), one that accepted any drafts at once."""
        c = self.counters
        c.num_drafts += 1
        c.num_draft_tokens += num_drafts
        c.num_accepted_tokens += num_accepted
        for j in range(num_accepted):
            c.accepted_per_pos[j] += 1
        if num_accepted:
            req.spec_misses = 0
        else:
            req.spec_misses += 1
            req.spec_backoff = min(1 << (req.spec_misses - 1), MAX_BACKOFF_STEPS)

    def take_counters(self) -> SpecCounters:
        """The counters since the last call, reset."""
        c, self.counters = self.counters, SpecCounters(accepted_per_pos=[0] * self.k)
        return c
