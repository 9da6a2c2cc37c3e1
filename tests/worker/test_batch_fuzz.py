"""Hypothesis state machine over the worker's plan layer (check_plan, then PersistentBatch.apply, as
ModelRunner.step does) with a stand-in for the forward: random valid and broken plans, random sampled tokens."""

from __future__ import annotations

import copy
import math
from collections import Counter
from dataclasses import dataclass

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from pagedserve_common.step import NewSequence, SequenceDelta, StepPlan
from worker_svc.batch import BadPlan, PersistentBatch, check_plan

NUM_BLOCKS, NUM_CPU_BLOCKS, BS, VOCAB = 24, 6, 4, 50


def run_plan(batch: PersistentBatch, plan: StepPlan, sampled) -> None:
    """ModelRunner.step without the model: check, apply, then advance as the forward would, the sequences that
    reach the end of their known tokens taking the next of `sampled` (token ids)."""
    check_plan(plan, batch.seqs, NUM_BLOCKS, NUM_CPU_BLOCKS, BS)
    scheduled = batch.apply(plan)
    samplers = [s for s in scheduled if s.samples_this_step]
    for s in scheduled:
        s.num_computed_tokens += s.num_scheduled_tokens
        s.num_scheduled_tokens = 0
    for s in samplers:
        s.token_ids.append(next(sampled))


@dataclass
class Expected:
    """What the scheduler believes a sequence holds on the worker."""

    tokens: list[int]
    blocks: list[int]
    computed: int


class BatchMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.batch = PersistentBatch()
        self.expected: dict[int, Expected] = {}
        self.preempted: dict[int, list[int]] = {}  # seq id -> its tokens: it may come back as a new sequence
        self.next_id, self.step_id = 0, 0

    # -- plan building ------------------------------------------------------------------------------------
    def _plan(self, data) -> tuple[StepPlan, dict[int, Expected]]:
        """A valid plan (drawn) and what the sequences hold after it, before sampling."""
        ids = sorted(self.expected)
        finished = self._some(data, ids, 3)
        rest = [i for i in ids if i not in finished]
        preempted = self._some(data, rest, 2)
        after = {i: copy.deepcopy(self.expected[i]) for i in rest if i not in preempted}
        held = Counter(b for e in after.values() for b in e.blocks)
        free = [b for b in range(NUM_BLOCKS) if not held[b]]
        plan = StepPlan(self.step_id, finished_seq_ids=finished, preempted_seq_ids=preempted)
        for seq_id, e in after.items():
            if not data.draw(st.integers(0, 3), label=f"schedule {seq_id}"):  # mostly scheduled
                continue
            k = data.draw(st.integers(1, len(e.tokens) - e.computed))
            need = math.ceil((e.computed + k) / BS) - len(e.blocks)
            if need > len(free):
                continue
            new_blocks, free = free[:max(need, 0)], free[max(need, 0):]
            plan.running.append(SequenceDelta(seq_id, new_blocks, k))
            e.blocks += new_blocks
        for _ in range(data.draw(st.integers(0, 3))):
            back = [i for i in self.preempted if i not in after and i not in (n.seq_id for n in plan.new_seqs)]
            if back and data.draw(st.booleans()):
                seq_id = data.draw(st.sampled_from(back))
                tokens = list(self.preempted[seq_id])
            else:
                seq_id, self.next_id = self.next_id, self.next_id + 1
                tokens = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=1, max_size=14))
            shared = self._shared_prefix(data, after, len(tokens))
            computed = len(shared) * BS
            k = data.draw(st.integers(1, len(tokens) - computed))
            need = math.ceil((computed + k) / BS) - len(shared)
            if need > len(free):
                continue
            blocks, free = shared + free[:need], free[need:]
            plan.new_seqs.append(NewSequence(seq_id, tokens, blocks, computed, k))
            after[seq_id] = Expected(list(tokens), list(blocks), computed)
        plan.copies = data.draw(st.lists(st.tuples(*[st.integers(0, NUM_BLOCKS - 1)] * 2), max_size=2))
        plan.swap_out = data.draw(st.lists(st.tuples(st.integers(0, NUM_BLOCKS - 1),
                                                     st.integers(0, NUM_CPU_BLOCKS - 1)), max_size=2))
        plan.swap_in = [(c, d) for d, c in data.draw(st.lists(st.tuples(
            st.integers(0, NUM_BLOCKS - 1), st.integers(0, NUM_CPU_BLOCKS - 1)), max_size=2))]
        return plan, after

    @staticmethod
    def _some(data, ids: list[int], most: int) -> list[int]:
        """A few of `ids`, in one step of three: sequences live for several steps."""
        if not ids or data.draw(st.integers(0, 2)):
            return []
        return data.draw(st.lists(st.sampled_from(ids), unique=True, min_size=1, max_size=most))

    def _shared_prefix(self, data, after: dict[int, Expected], num_tokens: int) -> list[int]:
        """Prefix-cache hit: full, computed leading blocks of a sequence that stays (read-only, so shareable),
        leaving at least one token of the new sequence to compute."""
        donors = [e for e in after.values() if e.computed >= BS]
        if not donors or not data.draw(st.booleans(), label="prefix hit"):
            return []
        donor = data.draw(st.sampled_from(donors))
        most = min(donor.computed // BS, (num_tokens - 1) // BS)
        return list(donor.blocks[:data.draw(st.integers(0, most))])

    # -- rules --------------------------------------------------------------------------------------------
    @rule(data=st.data())
    def valid_step(self, data) -> None:
        plan, after = self._plan(data)
        for n in plan.new_seqs:
            self.preempted.pop(n.seq_id, None)
        for seq_id in plan.preempted_seq_ids:
            self.preempted[seq_id] = list(self.expected[seq_id].tokens)
        scheduled = [(n.seq_id, n.num_computed_tokens + n.num_scheduled_tokens) for n in plan.new_seqs] + \
                    [(d.seq_id, after[d.seq_id].computed + d.num_scheduled_tokens) for d in plan.running]
        num_samplers = sum(end == len(after[seq_id].tokens) for seq_id, end in scheduled)
        sampled = data.draw(st.lists(st.integers(0, VOCAB - 1), min_size=num_samplers, max_size=num_samplers))
        run_plan(self.batch, plan, iter(sampled))
        tokens = iter(sampled)
        for seq_id, end in scheduled:
            if end == len(after[seq_id].tokens):
                after[seq_id].tokens.append(next(tokens))
            after[seq_id].computed = end
        self.expected = after
        self.step_id += 1

    @rule(data=st.data(), defect=st.sampled_from((
        "unknown_finished", "unknown_running", "new_already_running", "duplicate_new", "running_and_finished",
        "duplicate_running", "block_out_of_range", "negative_block", "table_too_short", "zero_scheduled",
        "beyond_known", "copy_out_of_range", "swap_out_out_of_range", "swap_in_out_of_range",
        "block_twice_in_new_table", "block_twice_in_running_table")))
    def broken_step(self, data, defect: str) -> None:
        plan, _ = self._plan(data)
        if not break_plan(plan, defect, sorted(self.expected), self.batch.seqs):
            plan.finished_seq_ids.append(10**9)  # the defect does not apply to this plan: an unknown id does
        before = copy.deepcopy(self.batch.seqs)
        with pytest.raises(BadPlan):
            run_plan(self.batch, plan, iter(()))
        assert self.batch.seqs == before, f"a refused plan ({defect}) changed the batch"

    # -- invariants ---------------------------------------------------------------------------------------
    @invariant()
    def batch_is_what_the_scheduler_believes(self) -> None:
        got = {i: Expected(s.token_ids, s.block_ids, s.num_computed_tokens) for i, s in self.batch.seqs.items()}
        assert got == self.expected
        assert all(s.num_scheduled_tokens == 0 for s in self.batch.seqs.values())

    @invariant()
    def blocks_in_range_and_shared_only_when_read_only(self) -> None:
        """A block in two tables (or twice in one) is a full, computed block in each: never written again."""
        holders = Counter(b for s in self.batch.seqs.values() for b in s.block_ids)
        for s in self.batch.seqs.values():
            assert all(0 <= b < NUM_BLOCKS for b in s.block_ids), s
            for i, b in enumerate(s.block_ids):
                if holders[b] > 1:
                    assert (i + 1) * BS <= s.num_computed_tokens, (s.seq_id, i, b)
                    assert s.block_ids.count(b) == 1, (s.seq_id, b)

    def teardown(self) -> None:
        """Every sequence can be finished, leaving nothing."""
        run_plan(self.batch, StepPlan(self.step_id, finished_seq_ids=sorted(self.batch.seqs)), iter(()))
        assert len(self.batch) == 0


def break_plan(plan: StepPlan, defect: str, ids: list[int], seqs) -> bool:
    """Gives `plan` one defect; False when this plan has nothing the defect applies to."""
    dropped = set(plan.finished_seq_ids) | set(plan.preempted_seq_ids)
    staying = [i for i in ids if i not in dropped]
    tables = [n.block_ids for n in plan.new_seqs] + [d.new_block_ids for d in plan.running]
    if defect == "unknown_finished":
        plan.preempted_seq_ids.append(10**9 + 1)
    elif defect == "unknown_running":
        plan.running.append(SequenceDelta(10**9 + 2, [], 1))
    elif defect == "new_already_running" and staying:
        plan.new_seqs.append(NewSequence(staying[0], [1, 2], [0], 0, 1))
    elif defect == "duplicate_new" and plan.new_seqs:
        plan.new_seqs.append(copy.deepcopy(plan.new_seqs[-1]))
    elif defect == "running_and_finished" and plan.finished_seq_ids:
        plan.running.append(SequenceDelta(plan.finished_seq_ids[0], [], 1))
    elif defect == "duplicate_running" and plan.running:
        plan.running.append(copy.deepcopy(plan.running[0]))
    elif defect in ("block_out_of_range", "negative_block") and any(tables):
        next(t for t in tables if t)[-1] = NUM_BLOCKS if defect == "block_out_of_range" else -1
    elif defect == "table_too_short" and any(n.block_ids for n in plan.new_seqs):
        next(n for n in plan.new_seqs if n.block_ids).block_ids.pop()
    elif defect == "zero_scheduled" and (plan.new_seqs or plan.running):
        (plan.new_seqs or plan.running)[0].num_scheduled_tokens = 0
    elif defect == "beyond_known" and plan.new_seqs:
        n = plan.new_seqs[0]
        n.num_scheduled_tokens = len(n.token_ids) - n.num_computed_tokens + 1
        n.block_ids += [b for b in range(NUM_BLOCKS) if b not in n.block_ids][:4]  # only the token count is wrong
    elif defect == "copy_out_of_range":
        plan.copies.append((0, NUM_BLOCKS))
    elif defect == "swap_out_out_of_range":
        plan.swap_out.append((0, NUM_CPU_BLOCKS))
    elif defect == "swap_in_out_of_range":
        plan.swap_in.append((NUM_CPU_BLOCKS, 0))
    elif defect == "block_twice_in_new_table" and plan.new_seqs:
        n = plan.new_seqs[0]
        n.block_ids.append(n.block_ids[0])  # one physical block for two positions of one sequence
    elif defect == "block_twice_in_running_table" and any(seqs[d.seq_id].block_ids for d in plan.running):
        d = next(d for d in plan.running if seqs[d.seq_id].block_ids)
        d.new_block_ids.append(seqs[d.seq_id].block_ids[0])
    else:
        return False
    return True


TestBatchFuzz = BatchMachine.TestCase
TestBatchFuzz.settings = settings(derandomize=True, deadline=None, max_examples=80, stateful_step_count=30)
