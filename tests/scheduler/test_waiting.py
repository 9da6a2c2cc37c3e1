"""The waiting queue's policies: fcfs order, priority with aging, and VTC fair share (scheduler_svc.core.waiting)."""

import itertools
import random
from dataclasses import dataclass, field

import pytest

from scheduler_svc.core.waiting import OVERDUE, ServiceCounter, WaitingQueue, read_tenant_weights
from scheduler_svc.identity import MIN_PRIORITY

_clock = itertools.count()


@dataclass(eq=False)
class Req:
    name: str
    priority: int = 0
    tenant: str = ""
    arrival_time: float = field(default_factory=lambda: float(next(_clock)))


def names(q) -> list[str]:
    return [r.name for r in q]


def drain(q, charge=None) -> list[str]:
    out = []
    while q:
        r = q.popleft()
        out.append(r.name)
        if charge:
            q.counter.charge(r.tenant, num_prefill_tokens=charge(r))
    return out


def test_fcfs_is_arrival_order_with_preempted_requests_back_at_the_front():
    q = WaitingQueue("fcfs")
    a, b, c, p1, p2 = Req("a"), Req("b"), Req("c"), Req("p1"), Req("p2")
    for r in (a, b, c):
        q.append(r)
    q.appendleft(p1)
    q.appendleft(p2)  # the later preemption goes first, as deque.appendleft
    assert names(q) == ["p2", "p1", "a", "b", "c"] and len(q) == 5 and q[0] is p2
    assert b in q and Req("b") not in q
    q.remove(b)
    assert drain(q) == ["p2", "p1", "a", "c"] and not q
    with pytest.raises(IndexError):
        q.head()


def test_only_the_head_is_indexable_and_a_request_waits_once():
    q = WaitingQueue("priority")
    a = Req("a")
    q.append(a)
    with pytest.raises(IndexError):
        q[1]
    with pytest.raises(ValueError, match="already waiting"):
        q.append(a)
    q.remove(a)
    with pytest.raises(ValueError, match="not waiting"):
        q.remove(a)


def test_priority_lower_first_ties_by_arrival_and_preempted_before_their_own_priority():
    q = WaitingQueue("priority")
    low1, high1, high2, low2 = Req("low1", 5), Req("high1", 1), Req("high2", 1), Req("low2", 5)
    for r in (low1, high1, high2, low2):
        q.append(r)
    q.appendleft(Req("low_preempted", 5))
    assert names(q) == ["high1", "high2", "low_preempted", "low1", "low2"]
    assert drain(q) == ["high1", "high2", "low_preempted", "low1", "low2"]


def test_priority_aging_admits_a_starved_request_after_a_bounded_number_of_admissions():
    q = WaitingQueue("priority", aging_steps=2)
    starved = Req("starved", priority=10)
    q.append(starved)
    admitted = []
    for i in range(40):  # a steady stream of urgent requests: one arrives per admission
        q.append(Req(f"urgent{i}", priority=0))
        admitted.append(q.popleft().name)
    # after 20 admissions its effective priority is 10 - 20 // 2 = 0, and it arrived before every urgent one
    assert admitted.index("starved") == 20
    assert q.effective_priority(q.head()) == 0


def test_fair_alternates_between_backlogged_tenants_by_counted_service():
    q = WaitingQueue("fair")
    for i in range(5):
        q.append(Req(f"A{i}", tenant="A"))
    for i in range(2):
        q.append(Req(f"B{i}", tenant="B"))
    # both at 0: B first, having fewer requests waiting; then whoever has been served less (ties: fewer waiting)
    assert drain(q, charge=lambda r: 10) == ["B0", "A0", "B1", "A1", "A2", "A3", "A4"]
    assert q.counter.service == {"A": 50.0, "B": 20.0}


def test_fair_a_tenant_returning_from_idle_banks_no_credit():
    q = WaitingQueue("fair")
    for i in range(10):
        q.append(Req(f"A{i}", tenant="A"))
    for _ in range(5):  # A alone is served 5 x 20 tokens while B is idle
        q.counter.charge(q.popleft().tenant, num_prefill_tokens=20)
    q.append(Req("B0", tenant="B"))
    assert q.counter.service["B"] == 100.0  # lifted to the least backlogged counter, not left at 0
    assert q.head().name == "B0"  # a tie at 100: B has fewer requests waiting (1 against A's 5)
    q.counter.charge(q.popleft().tenant, num_prefill_tokens=20)
    assert q.head().name == "A5"  # then A, at 100 against B's 120


def test_fair_lifts_to_where_the_queue_stood_when_it_drained():
    q = WaitingQueue("fair")
    q.append(Req("A0", tenant="A"))
    q.counter.charge(q.popleft().tenant, num_prefill_tokens=30)
    assert not q
    q.append(Req("B0", tenant="B"))  # nobody backlogged: B starts where the last backlogged tenant stood
    assert q.counter.service["B"] == 0.0  # A stood at 0 when it was last backlogged (charged after it left)
    q.append(Req("A1", tenant="A"))
    assert q.counter.service["A"] == 30.0 and q.head().name == "B0"


def test_fair_weights_and_token_costs():
    c = ServiceCounter(prefill_weight=0.5, decode_weight=2.0, weights={"gold": 2.0})
    c.charge("gold", num_prefill_tokens=100, num_decode_tokens=10)
    c.charge("free", num_prefill_tokens=100, num_decode_tokens=10)
    assert c.service == {"gold": (50 + 20) / 2, "free": 70.0}


def test_fair_service_gap_between_backlogged_tenants_stays_within_one_request_cost():
    rng = random.Random(7)
    q = WaitingQueue("fair")
    max_cost = 50
    cost = {}
    for i in range(300):
        for t in ("A", "B"):
            r = Req(f"{t}{i}", tenant=t)
            cost[r.name] = rng.randint(1, max_cost)
            q.append(r)
    gaps = []
    while len({r.tenant for r in q}) == 2:  # both backlogged
        r = q.popleft()
        q.counter.charge(r.tenant, num_prefill_tokens=cost[r.name])
        s = q.counter.service
        gaps.append(abs(s.get("A", 0.0) - s.get("B", 0.0)))
    assert len(gaps) > 500 and max(gaps) <= max_cost


def test_an_unknown_policy_is_refused_by_name():
    with pytest.raises(ValueError, match="scheduling_policy must be one of fcfs, priority, fair"):
        WaitingQueue("lottery")


def test_the_queue_counts_each_tenants_waiting_requests():
    q = WaitingQueue("fcfs")
    a0, a1, b0 = Req("a0", tenant="A"), Req("a1", tenant="A"), Req("b0", tenant="B")
    for r in (a0, a1, b0):
        q.append(r)
    assert q.num_waiting_by_tenant == {"A": 2, "B": 1}
    q.popleft()
    q.remove(b0)
    assert q.num_waiting_by_tenant == {"A": 1}
    q.clear()
    assert q.num_waiting_by_tenant == {}


def test_fair_shares_follow_the_tenants_weights():
    q = WaitingQueue("fair", ServiceCounter(weights={"A": 2.0}))
    for i in range(10):
        q.append(Req(f"A{i}", tenant="A"))
    for i in range(10):
        q.append(Req(f"B{i}", tenant="B"))
    # every request costs 10: A's counter grows by 5 a request, B's by 10, so A is served twice as often
    order = drain(q, charge=lambda r: 10)[:9]
    assert [n[0] for n in order] == ["A", "B", "A", "A", "B", "A", "A", "B", "A"]


def test_tenant_weights_file(tmp_path):
    f = tmp_path / "w"
    f.write_text("# comment\n\nteam a  2.5\nteam-b 1\n")
    assert read_tenant_weights(str(f)) == {"team a": 2.5, "team-b": 1.0}
    for text, message in (("a x\n", r":1: expected `TENANT WEIGHT`, the weight a number: 'x'"),
                          ("3\n", r":1: expected `TENANT WEIGHT`: no tenant before the weight"),
                          ("a nan\n", r":1: the weight must be > 0"), ("a -1\n", r":1: the weight must be > 0"),
                          ("a 1\nb 1\na 2\n", r":3: tenant 'a' is listed twice")):
        f.write_text(text)
        with pytest.raises(ValueError, match=message):
            read_tenant_weights(str(f))
    with pytest.raises(ValueError, match="cannot be read"):
        read_tenant_weights(str(tmp_path / "missing"))


def test_prune_drops_the_least_served_idle_tenants_never_an_active_one():
    c = ServiceCounter()
    c.service.update(a=5.0, b=1.0, c=3.0, d=0.5, e=9.0)
    assert c.prune(active={"d"}, keep=3) == ["b", "c"]  # d (0.5) is active: kept although the least served
    assert c.service == {"a": 5.0, "d": 0.5, "e": 9.0}
    assert c.prune(active={"a", "d", "e"}, keep=1) == []  # nobody idle: nothing dropped, whatever `keep` says
    q = WaitingQueue("fair", c)
    q.append(Req("B0", tenant="b"))
    assert c.service["b"] == 0.0  # a dropped tenant comes back as a new one: lifted to the floor (0 here)



class Clock:
    """Simulated monotonic seconds (WaitingQueue's clock)."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_priority_ageing_bounds_every_wait_in_time_whatever_the_priority_gap():
    # issue 50: a flood at -2^31 starved a priority-0 request; ageing one level per 64 admissions never closes that
    clock = Clock()
    q = WaitingQueue("priority", max_wait=10.0, clock=clock)
    q.append(Req("low", priority=0))  # queued at t=0
    admitted = []
    for t in range(14):  # one admission a second, an urgent request arriving before each
        clock.now = float(t)
        q.append(Req(f"urgent{t}", priority=MIN_PRIORITY))
        admitted.append(q.popleft().name)
    # at t=10 low has waited max_wait: overdue, it goes before every priority
    assert admitted == [*(f"urgent{t}" for t in range(10)), "low", "urgent10", "urgent11", "urgent12"]


def test_the_overdue_go_first_in_arrival_order_and_a_new_stay_waits_anew():
    clock = Clock()
    q = WaitingQueue("priority", aging_steps=1, max_wait=5.0, clock=clock)
    a, b, u = Req("a", priority=7), Req("b", priority=3), Req("u", priority=MIN_PRIORITY)
    for t, r in enumerate((a, b, u)):
        clock.now = float(t)
        q.append(r)
    clock.now = 5.5  # a has waited 5.5 s, b 4.5, u 3.5
    assert names(q) == ["a", "u", "b"] and q.effective_priority(a) == OVERDUE
    clock.now = 6.0  # b too: the overdue in arrival order, before the most urgent priority
    assert names(q) == ["a", "b", "u"]
    assert q.popleft() is a
    # u has waited through an admission (aging_steps 1), but ageing stops at the most urgent priority: the overdue
    # b still goes first
    assert q.effective_priority(u) == MIN_PRIORITY and names(q) == ["b", "u"]
    assert q.popleft() is b
    q.appendleft(b)  # preempted: a new stay in the queue, its wait counted from now
    assert names(q) == ["u", "b"] and q.effective_priority(b) == 3
    clock.now = 11.0
    assert names(q) == ["b", "u"]  # both overdue: among them the queue's own order, a preempted request first
