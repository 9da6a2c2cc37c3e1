"""The Scheduler admits in its scheduling policy's order: fcfs, priority, fair (scheduler_svc.core.waiting)."""

import pytest

from scheduler_svc.core.request import Request
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
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
    assert admitted(drive(s)) == ["A0", "B0", "A1", "A2"]
    assert s.waiting.counter.service == {"A": 30.0, "B": 10.0}


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
    assert [o.request_id for o in out] == ["a", "c"] and s.num_priority_preemptions == 1
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
    assert all(not p.preempted_seq_ids for p in plans) and s.num_priority_preemptions == 0
    assert admitted(plans) == ["b", "c"]


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
