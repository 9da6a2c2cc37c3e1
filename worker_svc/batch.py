"""The persistent batch: per-sequence state kept across steps, updated by each plan's deltas."""

from __future__ import annotations

from dataclasses import dataclass

from worker_svc.plan import StepPlan
from worker_svc.sampling import SamplingOptions


@dataclass(slots=True)
class SeqState:
    seq_id: int
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    sampling: SamplingOptions
    num_scheduled_tokens: int = 0  # this step's

    @property
    def samples_this_step(self) -> bool:
        """A sequence samples once its scheduled tokens reach the end of its known tokens."""
        return self.num_computed_tokens + self.num_scheduled_tokens == len(self.token_ids)


class PersistentBatch:
    """Sequences by id. Running sequences change only by their plan deltas; new ones arrive whole."""

    def __init__(self) -> None:
        self.seqs: dict[int, SeqState] = {}

    def __len__(self) -> int:
        return len(self.seqs)

    def apply(self, plan: StepPlan) -> list[SeqState]:
        """Applies a plan; returns the sequences scheduled this step, in plan order (new ones first)."""
        for seq_id in plan.finished_seq_ids:
            self.seqs.pop(seq_id, None)
        for seq_id in plan.preempted_seq_ids:
            self.seqs.pop(seq_id, None)  # NOTE: recompute preemption: it comes back as a new sequence
        scheduled = []
        for new in plan.new_seqs:
            if new.seq_id in self.seqs:
                raise ValueError(f"seq {new.seq_id} is already running on this worker")
            s = SeqState(new.seq_id, list(new.token_ids), list(new.block_ids), new.num_computed_tokens,
                         new.sampling, new.num_scheduled_tokens)
            self._check(s)
            self.seqs[new.seq_id] = s
            scheduled.append(s)
        for delta in plan.running:
            s = self.seqs.get(delta.seq_id)
            if s is None:
                raise ValueError(f"seq {delta.seq_id} is not running on this worker")
            s.block_ids.extend(delta.new_block_ids)
            s.num_scheduled_tokens = delta.num_scheduled_tokens
            self._check(s)
            scheduled.append(s)
        return scheduled

    @staticmethod
    def _check(s: SeqState) -> None:
        end = s.num_computed_tokens + s.num_scheduled_tokens
        if s.num_scheduled_tokens < 1 or end > len(s.token_ids):
            raise ValueError(f"seq {s.seq_id}: {s.num_scheduled_tokens} tokens scheduled after "
                             f"{s.num_computed_tokens} computed, but only {len(s.token_ids)} known")
