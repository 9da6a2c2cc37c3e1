"""The Scheduler admits in its scheduling policy's order: fcfs, priority, fair (scheduler_svc.core.waiting)."""

import pytest

from scheduler_svc.core.request import Request
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.core.waiting import ServiceCounter
from pagedserve_common.sampling import SamplingParams
from tests.support.scheduler import BS, FakeWorker, drive, make, position_token, step, toks


def req(rid: str, prompt: list[int], *, priority: int = 0, tenant: str = "", at: float, max_tokens: int = 1):
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens), arrival_time=at, priority=priority,
                   tenant=tenant)


def admitted(plans) -> list[str]:
    """Request ids in the order their sequences were first sent."""
    return [seq_to_rid[p.seq_id] for plan in plans for p in plan.new_seqs]


seq_to_rid: dict[int, str] = {}


def add(s: Scheduler, r: Request) -> None:
    s.add_request(r)
    seq_to_rid[r.seq_id] = r.request_id


def test_priority_admits_lower_first_ties_by_arrival():
    s = make(max_num_seqs=2, scheduling_policy="priority")
    for i, (rid, p) in enumerate((("a", 5), ("b", 5), ("c", 1), ("d", 1))):
        add(s, req(rid, toks(10 * i, 5), priority=p, at=float(i)))
    plans = drive(s)
    assert admitted(plans) == ["c", "d", "a", "b"]


def test_fcfs_ignores_priority():
    s = make(max_num_seqs=1)
    for i, (rid, p) in enumerate((("a", 5), ("b", 1))):
        add(s, req(rid, toks(10 * i, 5), priority=p, at=float(i)))
    assert admitted(drive(s)) == ["a", "b"]


def test_fair_alternates_tenants_by_the_tokens_they_were_served():
    # one sequence at a time, each a 9-token prompt (8 counted as prefill, at 1) and 1 sampled token (at 2): 10 a request
    s = make(max_num_seqs=1, scheduling_policy="fair")
    for i in range(3):
        add(s, req(f"A{i}", toks(100 * i, 9), tenant="A", at=float(i)))
    add(s, req("B0", toks(900, 9), tenant="B", at=3.0))
    add(s, req("B1", toks(800, 9), tenant="B", at=4.0))
    # both at 0 (B is lifted to A's counter): B0 first, B having fewer waiting; then whoever was served less, ties
    # again to the tenant with fewer requests waiting
    plans = drive(s)
    assert admitted(plans) == ["B0", "A0", "B1", "A1", "A2"]
    assert s.waiting.counter.service == {"A": 30.0, "B": 20.0}


def test_fair_ties_go_to_the_tenant_with_fewer_requests_waiting():
    # a tenant turning backlogged is lifted to the others' least counter: a tie the newcomer (the lighter) wins
    s = make(max_num_seqs=1, scheduling_policy="fair")
    for i in range(3):
        add(s, req(f"A{i}", toks(100 * i, 9), tenant="A", at=float(i)))
    w = FakeWorker()
    plan, _ = step(s, w)  # A0 runs (and ends): A is served 10
    assert admitted([plan]) == ["A0"]
    add(s, req("B0", toks(900, 9), tenant="B", at=3.0))
    assert s.waiting.counter.service == {"A": 10.0, "B": 10.0}
    assert admitted(drive(s, w)) == ["B0", "A1", "A2"]


def test_fair_counts_prefill_and_decode_by_their_weights():
    counter = ServiceCounter(prefill_weight=0.5, decode_weight=2.0)
    s = Scheduler(SchedulerConfig(num_blocks=64, max_model_len=256, block_size=BS, scheduling_policy="fair"),
                  service=counter)
    add(s, req("a", toks(0, 9), tenant="t", at=0.0, max_tokens=3))
    drive(s)
    # 8 prompt tokens before the last at 0.5; the last prompt token and 2 decodes sample a token each, at 2
    assert counter.service == {"t": 8 * 0.5 + 3 * 2.0}


def test_fair_service_is_shared_by_the_schedulers_given_one_counter():
    counter = ServiceCounter()

    def one() -> Scheduler:
        return Scheduler(SchedulerConfig(num_blocks=64, max_model_len=256, block_size=BS, max_num_seqs=1,
                                         scheduling_policy="fair"), service=counter)

    first, second = one(), one()
    add(first, req("A0", toks(0, 33), tenant="A", at=0.0))
    drive(first)  # A was served 32 + 2 on the first worker
    add(second, req("B0", toks(100, 9), tenant="B", at=1.0))
    add(second, req("B1", toks(200, 9), tenant="B", at=2.0))
    add(second, req("A1", toks(300, 9), tenant="A", at=3.0))
    # A keeps its 34 here: B is served twice (10, then 20 < 34) before A's next request; with a counter of its
    # own the second worker would have taken A1 second (A at 0 against B's 10)
    assert admitted(drive(second)) == ["B0", "B1", "A1"]


def test_an_adopted_request_queues_by_arrival_within_its_tenant():
    s = make(max_num_seqs=1, scheduling_policy="fair")
    for i in (0, 2):
        add(s, req(f"A{i}", toks(100 * i, 9), tenant="A", at=float(i)))
    moved = req("A1", toks(100, 9), tenant="A", at=1.0)
    s.adopt(moved)
    seq_to_rid[moved.seq_id] = "A1"
    assert admitted(drive(s, FakeWorker())) == ["A0", "A1", "A2"]


def test_an_unknown_policy_is_refused_by_name():
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority, fair, got 'lottery'"):
        make(scheduling_policy="lottery")


def test_priority_preempts_the_latest_admitted_lowest_priority_sequence_for_a_higher_one():
    s, w = make(max_num_seqs=2, scheduling_policy="priority"), FakeWorker()
    a = req("a", toks(0, 5), priority=5, at=0.0, max_tokens=6)
    b = req("b", toks(100, 5), priority=5, at=1.0, max_tokens=6)
    add(s, a)
    add(s, b)
    step(s, w)  # both run
    c = req("c", toks(200, 5), priority=0, at=2.0, max_tokens=2)
    add(s, c)
    plan, out = step(s, w)  # the next step: b makes room for c, which samples its first token in it
    assert plan.preempted_seq_ids == [b.seq_id] and [n.seq_id for n in plan.new_seqs] == [c.seq_id]
    assert [o.request_id for o in out] == ["a", "c"] and s.num_policy_preemptions == 1
    drive(s, w)
    # b was recomputed: its tokens are the ones it would have had without the preemption
    assert list(b.output_token_ids) == [position_token(b.seq_id, p) for p in range(5, 11)]
    assert list(a.output_token_ids) == [position_token(a.seq_id, p) for p in range(5, 11)]


def test_priority_never_preempts_for_an_equal_or_lower_priority():
    s, w = make(max_num_seqs=1, scheduling_policy="priority"), FakeWorker()
    add(s, req("a", toks(0, 5), priority=1, at=0.0, max_tokens=3))
    step(s, w)
    add(s, req("b", toks(100, 5), priority=1, at=1.0))
    add(s, req("c", toks(200, 5), priority=7, at=2.0))
    plans = drive(s, w)
    assert all(not p.preempted_seq_ids for p in plans) and s.num_policy_preemptions == 0
    assert admitted(plans) == ["b", "c"]


def test_priority_an_overdue_request_preempts_any_priority_and_is_never_preempted_back():
    # --priority-max-wait: a request that has waited that long goes first and makes room, whatever the gap
    s, w = make(max_num_seqs=1, scheduling_policy="priority", priority_max_wait=30.0), FakeWorker()
    now = [0.0]
    s.waiting.clock = lambda: now[0]
    urgent = req("urgent", toks(0, 5), priority=-2**31, at=0.0, max_tokens=20)
    add(s, urgent)
    step(s, w)
    low = req("low", toks(100, 5), priority=0, at=1.0, max_tokens=2)
    add(s, low)
    plans = [step(s, w)[0] for _ in range(3)]
    assert admitted(plans) == [] and not any(p.preempted_seq_ids for p in plans)
    now[0] = 30.0  # low has waited 30 s: overdue
    plan, _ = step(s, w)
    assert plan.preempted_seq_ids == [urgent.seq_id] and admitted([plan]) == ["low"]
    assert low.admitted_priority < -2**31  # OVERDUE: the preempted urgent request cannot take its slot back
    plans = drive(s, w)
    assert admitted(plans) == ["urgent"] and not any(p.preempted_seq_ids for p in plans)
    assert list(urgent.output_token_ids) == [position_token(urgent.seq_id, p) for p in range(5, 25)]


def test_priority_preempts_for_blocks_when_slots_are_free():
    # 4 blocks of 8 tokens: a (priority 5) holds 3 of them, c (priority 0) needs 2 for its 9-token prompt
    s, w = make(num_blocks=4, max_num_seqs=4, scheduling_policy="priority"), FakeWorker()
    a = req("a", toks(0, 21), priority=5, at=0.0, max_tokens=3)
    add(s, a)
    step(s, w)
    c = req("c", toks(100, 9), priority=0, at=1.0, max_tokens=1)
    add(s, c)
    plan, _ = step(s, w)
    assert plan.preempted_seq_ids == [a.seq_id] and [n.seq_id for n in plan.new_seqs] == [c.seq_id]
    drive(s, w)
    assert list(a.output_token_ids) == [position_token(a.seq_id, p) for p in range(21, 24)]


def test_fair_a_running_prefill_chunk_leaves_room_for_another_tenant_served_no_more():
    s, w = make(max_num_batched_tokens=16, scheduling_policy="fair"), FakeWorker()
    a = req("A0", toks(0, 40), tenant="A", at=0.0)
    add(s, a)
    plan, _ = step(s, w)  # A0's first chunk: 16 tokens
    assert [n.num_scheduled_tokens for n in plan.new_seqs] == [16]
    b = req("B0", toks(100, 9), tenant="B", at=1.0)
    add(s, b)  # B, served 0 against A's 16, is the head: A0's chunk shrinks to leave B0's whole prompt its room
    plan, out = step(s, w)
    assert [(d.seq_id, d.num_scheduled_tokens) for d in plan.running] == [(a.seq_id, 7)]
    assert [(n.seq_id, n.num_scheduled_tokens) for n in plan.new_seqs] == [(b.seq_id, 9)]
    assert [o.request_id for o in out] == ["B0"]  # B's first token in the step after its arrival
    drive(s, w)
    assert list(a.output_token_ids) == [position_token(a.seq_id, p) for p in range(40, 41)]


def test_fcfs_lets_a_running_prefill_chunk_take_the_whole_budget():
    s, w = make(max_num_batched_tokens=16), FakeWorker()
    a = req("A0", toks(0, 40), tenant="A", at=0.0)
    add(s, a)
    step(s, w)
    add(s, req("B0", toks(100, 9), tenant="B", at=1.0))
    plan, _ = step(s, w)
    assert [(d.seq_id, d.num_scheduled_tokens) for d in plan.running] == [(a.seq_id, 16)] and not plan.new_seqs


def test_fair_a_decode_never_yields_its_token():
    s, w = make(max_num_batched_tokens=9, scheduling_policy="fair"), FakeWorker()
    a = req("A0", toks(0, 9), tenant="A", at=0.0, max_tokens=4)
    add(s, a)
    step(s, w)  # A0's prompt: it decodes from now on
    b = req("B0", toks(100, 9), tenant="B", at=1.0)
    add(s, b)
    plan, _ = step(s, w)
    assert [(d.seq_id, d.num_scheduled_tokens) for d in plan.running] == [(a.seq_id, 1)]
    assert [(n.seq_id, n.num_scheduled_tokens) for n in plan.new_seqs] == [(b.seq_id, 8)]


def test_fair_preempts_the_latest_admitted_sequence_of_a_tenant_over_its_share_of_the_slots():
    s, w = make(max_num_seqs=2, scheduling_policy="fair"), FakeWorker()
    a0 = req("A0", toks(0, 5), tenant="A", at=0.0, max_tokens=6)
    a1 = req("A1", toks(100, 5), tenant="A", at=0.5, max_tokens=6)
    add(s, a0)
    add(s, a1)
    step(s, w)  # A holds both slots
    b = req("B0", toks(200, 5), tenant="B", at=1.0, max_tokens=2)
    add(s, b)
    plan, out = step(s, w)  # shares: one slot each; A1 makes room, B0 samples its first token in this step
    assert plan.preempted_seq_ids == [a1.seq_id] and [n.seq_id for n in plan.new_seqs] == [b.seq_id]
    assert [o.request_id for o in out] == ["A0", "B0"] and s.num_policy_preemptions == 1
    drive(s, w)
    # A1 was recomputed: its tokens are the ones it would have had without the preemption
    assert list(a1.output_token_ids) == [position_token(a1.seq_id, p) for p in range(5, 11)]
    assert list(a0.output_token_ids) == [position_token(a0.seq_id, p) for p in range(5, 11)]
    assert s.kv.pool.num_free_blocks == s.config.num_blocks


def test_fair_tenants_at_their_share_never_preempt_each_other():
    # two backlogged tenants holding a slot each: whoever was served less waits for a slot, nobody is preempted
    s, w = make(max_num_seqs=2, scheduling_policy="fair"), FakeWorker()
    for i in range(3):
        add(s, req(f"A{i}", toks(100 * i, 5), tenant="A", at=float(i), max_tokens=5))
        add(s, req(f"B{i}", toks(500 + 100 * i, 5), tenant="B", at=float(i) + 0.5, max_tokens=5))
    plans = drive(s, w)
    assert all(not p.preempted_seq_ids for p in plans) and s.num_policy_preemptions == 0
    assert sorted(admitted(plans)) == ["A0", "A1", "A2", "B0", "B1", "B2"]


def test_fair_weights_split_the_slots():
    # A weighs 3, B 1: of 4 slots A's share is 3, so B's head takes back only the 4th
    counter = ServiceCounter(weights={"A": 3.0})
    s = Scheduler(SchedulerConfig(num_blocks=64, max_model_len=256, block_size=BS, max_num_seqs=4,
                                  scheduling_policy="fair"), service=counter)
    w = FakeWorker()
    a = [req(f"A{i}", toks(100 * i, 5), tenant="A", at=float(i), max_tokens=8) for i in range(4)]
    for r in a:
        add(s, r)
    step(s, w)
    add(s, req("B0", toks(900, 5), tenant="B", at=9.0, max_tokens=8))
    add(s, req("B1", toks(950, 5), tenant="B", at=9.5, max_tokens=8))
    plan, _ = step(s, w)
    assert plan.preempted_seq_ids == [a[3].seq_id] and s.num_policy_preemptions == 1
    plan, _ = step(s, w)
    assert not plan.preempted_seq_ids  # B holds its share (1): B1 waits for a slot
    drive(s, w)
    assert s.num_policy_preemptions == 1


def test_fair_charges_as_it_admits_within_one_step():
    # all four fit one step: each admission is charged before the next head is picked, so the tenants alternate
    s = make(max_num_seqs=4, scheduling_policy="fair")
    for i in range(2):
        add(s, req(f"A{i}", toks(100 * i, 5), tenant="A", at=float(i)))
        add(s, req(f"B{i}", toks(500 + 100 * i, 5), tenant="B", at=float(i) + 0.5))
    plan = s.schedule().plan
    assert [seq_to_rid[n.seq_id] for n in plan.new_seqs] == ["A0", "B0", "A1", "B1"]


def test_fair_a_chunk_that_gave_way_runs_when_the_head_finds_no_room():
    # one slot: B0 cannot be admitted, so the budget A0's chunk left it goes back to A0 (the step never idles)
    s, w = make(max_num_batched_tokens=16, max_num_seqs=1, scheduling_policy="fair"), FakeWorker()
    a = req("A0", toks(0, 40), tenant="A", at=0.0)
    add(s, a)
    step(s, w)
    add(s, req("B0", toks(100, 40), tenant="B", at=1.0))  # its first chunk (16) is the whole budget
    plan, _ = step(s, w)
    assert [(d.seq_id, d.num_scheduled_tokens) for d in plan.running] == [(a.seq_id, 16)] and not plan.new_seqs
    drive(s, w)
    assert list(a.output_token_ids) == [position_token(a.seq_id, 40)]
