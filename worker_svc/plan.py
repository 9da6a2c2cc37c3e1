"""The worker's in-memory view of a per-step plan and its result (protobuf is converted at the edge)."""

from __future__ import annotations

from dataclasses import dataclass, field

from worker_svc.sampling import LogprobEntry, SamplingOptions


@dataclass(slots=True)
class NewSeq:
    """A sequence the worker holds no state for: its full state."""

    seq_id: int
    token_ids: list[int]  # prompt, then any tokens generated before a preemption
    block_ids: list[int]  # block table: logical block i -> physical block id
    num_computed_tokens: int  # tokens whose KV is already in the pool (prefix-cache hits)
    num_scheduled_tokens: int  # tokens to compute this step
    sampling: SamplingOptions = field(default_factory=SamplingOptions)


@dataclass(slots=True)
class SeqDelta:
    """A running sequence's change this step. NOTE: block tables only grow, so deltas are enough."""

    seq_id: int
    new_block_ids: list[int]
    num_scheduled_tokens: int


@dataclass(slots=True)
class StepPlan:
    step_id: int
    new_seqs: list[NewSeq] = field(default_factory=list)
    running: list[SeqDelta] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)
    preempted_seq_ids: list[int] = field(default_factory=list)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) blocks, copied before the forward
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu) blocks, first of all
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, device) blocks, after swap_out


@dataclass(slots=True)
class StepOutput:
    step_id: int
    seq_ids: list[int]  # sequences that sampled a token this step (reached the end of their known tokens)
    token_ids: list[int]
    logprobs: list[LogprobEntry | None]
    step_seconds: float
