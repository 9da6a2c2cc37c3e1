"""One step of the worker protocol: the plan a worker applies (StepPlan) and its answer (StepResult, or StepError
when it ran none). Both services use these types; pagedserve_common.wire puts them on the wire."""

from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedserve_common.sampling import SamplingParams


@dataclass(slots=True)
class NewSequence:
    """A sequence the worker holds no state for, sent whole: every known token and its block table."""

    seq_id: int  # unique across the fleet while the sequence lives
    token_ids: Sequence[int]  # the prompt, then any tokens generated before a preemption or a migration
    block_ids: list[int]  # block table: logical block i -> physical block id
    num_computed_tokens: int  # KV already in the pool (a prefix-cache hit, or a fork parent's prefix)
    num_scheduled_tokens: int  # tokens to compute this step, from num_computed_tokens on
    sampling: SamplingParams = SamplingParams()
    seed: int = 0  # the seed in use (the client's, or drawn by the scheduler), so a recomputed sequence draws alike
    num_prompt_tokens: int = 0  # token_ids[:num_prompt_tokens] is the prompt, the rest outputs (penalties count them)


@dataclass(slots=True)
class SequenceDelta:
    """A sequence the worker holds, as this step's change. NOTE: block tables only grow while a sequence runs,
    so the appended block ids are the whole change."""

    seq_id: int
    new_block_ids: list[int]
    num_scheduled_tokens: int  # 1 + len(draft_token_ids) when it speculates
    # Speculative decoding: the tokens the scheduler guesses follow the sequence's last known token (the one it
    # computes this step); the worker verifies them in the same forward (StepResult.num_accepted_drafts).
    draft_token_ids: list[int] = field(default_factory=list)


@dataclass(slots=True)
class StepPlan:
    """Everything a worker needs for one forward pass. NOTE: the worker applies it in this order: drop
    finished and preempted sequences, swap out, swap in, copy, then run new_seqs and running."""

    step_id: int
    new_seqs: list[NewSequence] = field(default_factory=list)
    running: list[SequenceDelta] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)  # drop: finished, aborted, or forked parents
    preempted_seq_ids: list[int] = field(default_factory=list)  # drop: they come back later as new
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) blocks: copy-on-write
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu) blocks, first of all
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, device) blocks, after swap_out
    # seq_id -> the tokens it may sample this step (structured output): little-endian uint32 words, bit i of word j
    # allows token 32 * j + i. Sequences not listed sample freely.
    token_bitmasks: dict[int, bytes] = field(default_factory=dict)

    @property
    def num_seqs(self) -> int:
        return len(self.new_seqs) + len(self.running)

    @property
    def num_scheduled_tokens(self) -> int:
        return (sum(s.num_scheduled_tokens for s in self.new_seqs)
                + sum(s.num_scheduled_tokens for s in self.running))


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float  # natural log, of the model's raw distribution (before temperature, top-k, top-p, min-p)


@dataclass(slots=True, frozen=True)
class PositionLogprobs:
    """Logprobs of one position: the sampled token's (a prompt position: the prompt token's), and the top ones,
    most likely first."""

    sampled: TokenLogprob
    top: tuple[TokenLogprob, ...] = ()
    # `sampled`'s rank, vLLM's: the tokens whose logprob is >= its own (1: the most likely). 0: not computed (the
    # sampled tokens' logprobs carry none; prompt positions always do).
    rank: int = 0


@dataclass(slots=True, frozen=True)
class PromptLogprobs:
    """One sequence's prompt logprobs from one step: positions first_position .. first_position + len(positions) - 1,
    in order. Position p is the prompt token p given tokens 0 .. p - 1, read off the logits of row p - 1: a step that
    computes rows [c, c + k) of a prompt of P tokens returns positions c + 1 .. min(c + k, P - 1) (position 0 has
    none: no token precedes it)."""

    first_position: int
    positions: tuple[PositionLogprobs, ...]


@dataclass(slots=True)
class StepResult:
    """One token for each sequence that reached the end of its known tokens this step; logprobs only for the
    sequences that asked. A speculating sequence's tokens this step are its first num_accepted_drafts drafts, then
    its sampled token (the correction of the first draft refused, or the one after the last draft)."""

    step_id: int
    sampled: dict[int, int] = field(default_factory=dict)  # seq_id -> the token it sampled
    logprobs: dict[int, PositionLogprobs] = field(default_factory=dict)  # seq_id -> its position's logprobs
    step_seconds: float = 0.0  # the step's wall time on the worker
    idle_seconds: float = 0.0  # the worker's wait between its previous answer and this plan (0 for its first)
    # seq_id -> how many of its drafts (SequenceDelta.draft_token_ids) it accepted, in order; absent: none. NOTE: a
    # count, not the tokens: the accepted ones are the scheduler's own drafts, so an answer cannot contradict them
    num_accepted_drafts: dict[int, int] = field(default_factory=dict)
    # seq_id -> the prompt logprobs its scheduled prompt rows gave this step (SamplingParams.prompt_logprobs set),
    # whether or not it samples this step (a chunk of a chunked prefill)
    prompt_logprobs: dict[int, PromptLogprobs] = field(default_factory=dict)


class StepErrorKind(enum.IntEnum):
    """NOTE: values match pagedserve.v1.StepError.Kind."""

    BAD_PLAN = 1  # the worker refused the plan; nothing was written
    STEP_FAILED = 2  # running the step raised (out of device memory, a kernel fault, ...)


@dataclass(slots=True, frozen=True)
class StepError:
    """The answer to a plan that produced no result; the scheduler recomputes the worker's requests elsewhere."""

    step_id: int
    kind: StepErrorKind
    message: str
