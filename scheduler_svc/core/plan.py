"""Scheduler-side plan of one step, mirroring pagedserve.v1.StepPlan (converted in scheduler_svc.convert)."""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_svc.core.request import SamplingConfig


@dataclass(slots=True)
class NewSeqPlan:
    """A sequence the worker holds no state for, sent whole: all known tokens and its block table."""

    seq_id: int
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int  # KV already in the pool (prefix-cache hit, or the fork parent's prefix)
    num_scheduled_tokens: int
    sampling: SamplingConfig
    seed: int


@dataclass(slots=True)
class RunningSeqPlan:
    """A sequence the worker holds, as a delta. NOTE: block tables only grow, so appended ids suffice."""

    seq_id: int
    new_block_ids: list[int]
    num_scheduled_tokens: int


@dataclass(slots=True)
class StepPlan:
    step_id: int
    new: list[NewSeqPlan] = field(default_factory=list)
    running: list[RunningSeqPlan] = field(default_factory=list)
    finished_seq_ids: list[int] = field(default_factory=list)  # drop: finished, aborted, or forked parents
    preempted_seq_ids: list[int] = field(default_factory=list)  # drop: they come back later as new
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) blocks, before the forward pass
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device, cpu) blocks, first of all
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, device) blocks, after swap_out

    @property
    def num_seqs(self) -> int:
        return len(self.new) + len(self.running)

    @property
    def num_scheduled_tokens(self) -> int:
        return sum(s.num_scheduled_tokens for s in self.new) + sum(s.num_scheduled_tokens for s in self.running)


@dataclass(slots=True, frozen=True)
class WorkerRegistration:
    """What a worker announces when it dials in (pagedserve.v1.WorkerRegistration)."""

    model_id: str
    num_blocks: int
    block_size: int
    dtype: str
    max_model_len: int
    device: str
    num_cpu_blocks: int = 0
    name: str = ""  # HOST:PID, for logs


@dataclass(slots=True, frozen=True)
class StepFailure:
    """A worker's StepError: it could not run a plan (BAD_PLAN: refused it; STEP_FAILED: the step raised)."""

    step_id: int
    kind: str
    message: str
