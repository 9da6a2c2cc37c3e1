"""The persistent batch: per-sequence state kept across steps, updated by each plan's deltas."""

from __future__ import annotations

from dataclasses import dataclass, replace

from pagedserve_common.plan import StepPlan
from pagedserve_common.sampling import SamplingParams


@dataclass(slots=True)
class SeqState:
    seq_id: int
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    sampling: SamplingParams  # NOTE: its seed is the one in use (the plan's): a sampled token depends on it
    num_scheduled_tokens: int = 0  # this step's

    @property
    def samples_this_step(self) -> bool:
        """A sequence samples once its scheduled tokens reach the end of its known tokens."""
        return self.num_computed_tokens + self.num_scheduled_tokens == len(self.token_ids)


class PersistentBatch:
    """Sequences by id. Running sequences change only by their plan deltas; new ones arrive whole.
    NOTE: apply() trusts its plan: plan_check.check_plan has refused any plan that does not fit this batch."""

    def __init__(self) -> None:
        self.seqs: dict[int, SeqState] = {}

    def __len__(self) -> int:
        return len(self.seqs)

    def apply(self, plan: StepPlan) -> list[SeqState]:
        """Applies a checked plan; returns the sequences scheduled this step, in plan order (new ones first)."""
        seqs = self.seqs
        for seq_id in plan.finished_seq_ids:
            del seqs[seq_id]
        for seq_id in plan.preempted_seq_ids:
            del seqs[seq_id]  # NOTE: recompute preemption: it comes back as a new sequence
        scheduled = []
        for new in plan.new_seqs:
            sampling = new.sampling if new.sampling.seed == new.seed else replace(new.sampling, seed=new.seed)
            s = SeqState(new.seq_id, list(new.token_ids), list(new.block_ids), new.num_computed_tokens, sampling,
                         new.num_scheduled_tokens)
            seqs[new.seq_id] = s
            scheduled.append(s)
        for delta in plan.running:
            s = seqs[delta.seq_id]
            s.block_ids.extend(delta.new_block_ids)
            s.num_scheduled_tokens = delta.num_scheduled_tokens
            scheduled.append(s)
        return scheduled
