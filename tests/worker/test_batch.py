"""The worker refuses a plan that would write outside its pool or name sequences it does not hold."""

from __future__ import annotations

import pytest

from pagedserve_common.step import NewSequence, SequenceDelta, StepPlan
from worker_svc.batch import BadPlan, PersistentBatch, check_plan

NUM_BLOCKS, NUM_CPU_BLOCKS, BS, VOCAB = 8, 2, 4, 10


def holding_seq_0() -> PersistentBatch:
    batch = PersistentBatch()
    batch.apply(StepPlan(0, new_seqs=[NewSequence(0, [1, 2, 3, 4, 5], [0, 1], 0, 5)]))
    batch.seqs[0].num_computed_tokens, batch.seqs[0].num_scheduled_tokens = 5, 0
    batch.seqs[0].token_ids.append(6)
    return batch


def check(plan: StepPlan, batch: PersistentBatch | None = None) -> None:
    check_plan(plan, (batch or holding_seq_0()).seqs, NUM_BLOCKS, NUM_CPU_BLOCKS, BS, VOCAB)


@pytest.mark.parametrize("plan, message", [
    (StepPlan(1, new_seqs=[NewSequence(1, [1, 2], [8], 0, 2)]), "seq 1: block 8 is outside the pool (0..7)"),
    (StepPlan(1, new_seqs=[NewSequence(0, [1], [2], 0, 1)]), "new seq 0 is already on this worker"),
    (StepPlan(1, new_seqs=[NewSequence(1, [1, 2, 3, 4, 5], [2], 0, 5)]), "seq 1: 5 tokens need 2 blocks, its table has 1"),
    (StepPlan(1, new_seqs=[NewSequence(1, [1, 2], [2], 0, 3)]), "seq 1: 3 tokens scheduled after 0 computed, but only 2"),
    (StepPlan(1, running=[SequenceDelta(7, [], 1)]), "running seq 7 is not on this worker"),
    (StepPlan(1, running=[SequenceDelta(0, [], 1)], finished_seq_ids=[0]), "running seq 0 is not on this worker"),
    (StepPlan(1, running=[SequenceDelta(0, [9], 1)]), "seq 0: block 9 is outside the pool"),
    (StepPlan(1, running=[SequenceDelta(0, [], 2)]), "seq 0: 2 tokens scheduled after 5 computed, but only 6 known"),
    (StepPlan(1, finished_seq_ids=[3]), "finished/preempted seq 3 is not on this worker"),
    (StepPlan(1, copies=[(0, 8)]), "copy: block 8 is outside the pool"),
    (StepPlan(1, swap_out=[(0, 2)]), "swap_out: CPU block 2 is outside the pool (0..1)"),
    (StepPlan(1, swap_in=[(1, 99)]), "swap_in: block 99 is outside the pool"),
    (StepPlan(1, new_seqs=[NewSequence(1, [1, 10], [2], 0, 2)]), "seq 1: a token id is outside the vocabulary (0..9)"),
    (StepPlan(1, new_seqs=[NewSequence(1, [-1, 2], [2], 0, 2)]), "seq 1: a token id is outside the vocabulary"),
    (StepPlan(1, new_seqs=[NewSequence(1, [1] * 5, [2, 2], 0, 5)]), "seq 1: block 2 would stand twice in its block table"),
    (StepPlan(1, running=[SequenceDelta(0, [1], 1)]), "seq 0: block 1 would stand twice in its block table"),
])
def test_bad_plans_are_refused_naming_what_is_wrong(plan, message):
    with pytest.raises(BadPlan, match=message.replace("(", r"\(").replace(")", r"\)")):
        check(plan)


def test_a_good_plan_passes_and_a_refused_one_changes_nothing():
    batch = holding_seq_0()
    check(StepPlan(1, new_seqs=[NewSequence(1, [1, 2], [2], 0, 2)], running=[SequenceDelta(0, [], 1)],
                   copies=[(0, 7)], swap_out=[(1, 1)], swap_in=[(1, 3)]), batch)
    with pytest.raises(BadPlan):
        check(StepPlan(1, new_seqs=[NewSequence(1, [1, 2], [2], 0, 2)], running=[SequenceDelta(0, [99], 1)]), batch)
    assert list(batch.seqs) == [0] and batch.seqs[0].block_ids == [0, 1]


BITMASK_BYTES = 4  # a vocabulary of 10: one uint32 word


@pytest.mark.parametrize("bitmasks, message", [
    ({1: b"\xff\x03\x00"}, "token_bitmasks: seq 1: the bitmask has 3 bytes; a vocabulary of 10 takes 4"),
    ({1: b"\xff\x03\x00\x00\x00"}, "token_bitmasks: seq 1: the bitmask has 5 bytes"),
    ({1: b"\x00\xfc\xff\xff"}, "token_bitmasks: seq 1: the bitmask allows no token"),  # only padding bits set
    ({5: b"\x01\x00\x00\x00"}, "token_bitmasks: seq 5 is not in this plan"),
    ({2: b"\x01\x00\x00\x00"}, "token_bitmasks: seq 2 does not sample this step"),  # mid chunked prefill
])
def test_bad_token_bitmasks_are_refused_naming_their_sequence(bitmasks, message):
    plan = StepPlan(1, new_seqs=[NewSequence(1, [1, 2], [2], 0, 2), NewSequence(2, [1, 2, 3], [3], 0, 2)],
                    running=[SequenceDelta(0, [], 1)], token_bitmasks=bitmasks)
    with pytest.raises(BadPlan, match=message.replace("(", r"\(").replace(")", r"\)")):
        check(plan)


def test_good_token_bitmasks_pass_for_new_and_running_sequences():
    check(StepPlan(1, new_seqs=[NewSequence(1, [1, 2], [2], 0, 2)], running=[SequenceDelta(0, [], 1)],
                   token_bitmasks={1: b"\x00\x02\x00\x00", 0: b"\xff\x03\x00\x00"}))  # token 9; tokens 0..9


def test_with_kv_groups_a_freed_sliding_block_may_come_back_but_a_live_one_may_not_stand_twice():
    from pagedserve_common.kv_geometry import KVGroups

    groups = KVGroups.of((0, 4))  # layer 0 full, layer 1 a 4-token window: 2 groups; blocks of BS = 4 tokens
    batch = PersistentBatch()
    # 12 tokens computed: logical blocks 0..2 as (group 0, group 1) = (0, 1), (2, 3), (4, 5)
    batch.apply(StepPlan(0, new_seqs=[NewSequence(0, list(range(13)), [0, 1, 2, 3, 4, 5], 0, 12)]))
    batch.seqs[0].num_computed_tokens, batch.seqs[0].num_scheduled_tokens = 12, 0

    def grouped(plan: StepPlan) -> None:
        check_plan(plan, batch.seqs, NUM_BLOCKS, NUM_CPU_BLOCKS, BS, VOCAB, groups)

    # the query at 12 sees 9..12: group 1's blocks of logical 0 and 1 (1, 3) are out of its window, so the
    # scheduler may have handed block 1 back to this very sequence
    grouped(StepPlan(1, running=[SequenceDelta(0, [6, 1], 1)]))
    with pytest.raises(BadPlan, match="seq 0: block 5 would stand twice"):  # logical 2 of group 1 is live
        grouped(StepPlan(1, running=[SequenceDelta(0, [6, 5], 1)]))
    with pytest.raises(BadPlan, match="seq 0: block 0 would stand twice"):  # a full group's block is always live
        grouped(StepPlan(1, running=[SequenceDelta(0, [0, 7], 1)]))
    with pytest.raises(BadPlan, match="13 tokens need 4 blocks, its table has 3"):  # logical blocks: 6 entries / 2
        grouped(StepPlan(1, running=[SequenceDelta(0, [], 1)]))
