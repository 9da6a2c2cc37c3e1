"""One step's plan, as the scheduler makes it and the worker applies it (pagedserve.v1.StepPlan on the wire)."""

from __future__ import annotations

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


@dataclass(slots=True)
class SequenceDelta:
    """A sequence the worker holds, as this step's change. NOTE: block tables only grow while a sequence runs,
    so the appended block ids are the whole change."""

    seq_id: int
    new_block_ids: list[int]
    num_scheduled_tokens: int


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

    @property
    def num_seqs(self) -> int:
        return len(self.new_seqs) + len(self.running)

    @property
    def num_scheduled_tokens(self) -> int:
        return (sum(s.num_scheduled_tokens for s in self.new_seqs)
                + sum(s.num_scheduled_tokens for s in self.running))
