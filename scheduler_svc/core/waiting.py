"""The waiting queue in the order a scheduling policy admits from: fcfs, priority, or fair share (VTC)."""

from __future__ import annotations

import itertools
import math
import time
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from pagedserve_common.config import (AGING_ADMISSIONS, FAIR_DECODE_WEIGHT, FAIR_PREFILL_WEIGHT,
                                      SCHEDULING_POLICIES)  # --scheduling-policy
from scheduler_svc.identity import MIN_PRIORITY  # the most urgent priority a request may ask (32 bits)

MAX_TENANT_WEIGHT = 1e6
# NOTE: below every priority a request may ask or age into: an overdue request goes first, and a sequence admitted
# overdue is never preempted for priority (policy_room), so the overdue cannot preempt each other back and forth
OVERDUE = MIN_PRIORITY - 1
# NOTE: the tenant is the client's header: counters are bounded (ServiceCounter.prune), not one per name ever sent
MAX_TENANT_COUNTERS = 4096


def read_tenant_weights(path: str) -> dict[str, float]:
    """--tenant-weights: `TENANT WEIGHT` lines (the weight is the last word, the tenant the rest; blank lines and
    lines starting with # skipped). Raises ValueError naming the file, the line and what is wrong."""
    try:
        lines = open(path, encoding="utf-8").read().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--tenant-weights {path}: cannot be read ({e.__class__.__name__})") from None
    weights: dict[str, float] = {}
    for n, line in enumerate(lines, 1):
        text = line.strip()
        if not text or text.startswith("#"):
            continue
        tenant, _, word = text.rpartition(" ")
        tenant = tenant.strip()
        where = f"--tenant-weights {path}:{n}"
        try:
            weight = float(word)
        except ValueError:
            raise ValueError(f"{where}: expected `TENANT WEIGHT`, the weight a number: {word[:40]!r}") from None
        if not tenant:
            raise ValueError(f"{where}: expected `TENANT WEIGHT`: no tenant before the weight")
        if not 0 < weight <= MAX_TENANT_WEIGHT:  # NOTE: also refuses nan and inf
            raise ValueError(f"{where}: the weight must be > 0 and <= {MAX_TENANT_WEIGHT:g}, got {word[:40]}")
        if tenant in weights:
            raise ValueError(f"{where}: tenant {tenant[:128]!r} is listed twice")
        weights[tenant] = weight
    return weights


class Waiting(Protocol):
    """What the queue reads of a request."""

    arrival_time: float  # monotonic seconds
    priority: int  # lower runs first (the priority policy)
    tenant: str  # whose service it counts as (the fair policy)


@dataclass(slots=True)
class ServiceCounter:
    """VTC's virtual token counters ("Fairness in Serving Large Language Models", OSDI '24): each tenant's
    service so far, weighted input + output tokens over the tenant's weight.

    NOTE: a tenant that turns backlogged is lifted to the least counter of the tenants backlogged then (or, with
    none, to where the last backlogged ones stood), so idle time banks no credit: the bound on the service
    difference between backlogged tenants (VTC's Theorem 4.4) then holds at every moment, not only on average.
    """

    # NOTE: a decode token costs about twice a prompt token: bench/routing.py's cost model, calibrated on a 2-core CPU
    # worker with the default model, charges 2.5 ms a scheduled token plus 9 us a token of each sequence's context,
    # so a decode at a context of ~280 costs 2x a prefill token (VTC's paper weighs them 1 and 2 as well)
    prefill_weight: float = FAIR_PREFILL_WEIGHT  # a computed prompt (or recomputed) token
    decode_weight: float = FAIR_DECODE_WEIGHT  # a token sampled (or a draft verified)
    weights: dict[str, float] = field(default_factory=dict)  # tenant -> share weight (absent: 1)
    service: dict[str, float] = field(default_factory=dict)  # tenant -> counted service
    _floor: float = 0.0  # the least counter among the backlogged tenants when the queue last drained

    def weight(self, tenant: str) -> float:
        return self.weights.get(tenant, 1.0)

    def charge(self, tenant: str, num_prefill_tokens: int = 0, num_decode_tokens: int = 0) -> None:
        cost = self.prefill_weight * num_prefill_tokens + self.decode_weight * num_decode_tokens
        self.service[tenant] = self.service.get(tenant, 0.0) + cost / self.weight(tenant)

    def lift(self, tenant: str, backlogged: Iterator[str]) -> None:
        """`tenant` turned backlogged while `backlogged` (the others) were: no banked credit."""
        floor = min((self.service.get(t, 0.0) for t in backlogged), default=self._floor)
        self.service[tenant] = max(self.service.get(tenant, 0.0), floor)

    def prune(self, active: set[str], keep: int) -> list[str]:
        """Drops the counters of idle tenants (not in `active`: no request of theirs unfinished) until `keep` are
        left, the least served first; returns the tenants dropped. NOTE: a dropped tenant that comes back is lifted
        like a new one; one at or below the least counter of the backlogged tenants loses nothing by it (it would
        be lifted there anyway), the rest give up the service above it. An active tenant is never dropped: its
        running sequences are still being charged."""
        idle = sorted((c, t) for t, c in self.service.items() if t not in active)
        dropped = [t for _, t in idle[:max(0, len(self.service) - keep)]]
        for t in dropped:
            del self.service[t]
        return dropped

    def drained(self, last: Iterator[str]) -> None:
        """The queue emptied; `last`: the tenants backlogged just before."""
        self._floor = max(self._floor, min((self.service.get(t, 0.0) for t in last), default=self._floor))


class WaitingQueue:
    """Requests waiting for admission, head first under `policy`:

    - fcfs: arrival order; a preempted request goes back to the front (appendleft).
    - priority: the lowest `priority` first, ties by arrival; a preempted request goes before the waiting ones of
      its own priority. NOTE: ageing bounds starvation: every `aging_steps` admissions that a request waits
      through lower its effective priority by one, and once it has waited `max_wait` seconds it is OVERDUE: before
      every priority (among the overdue: preempted ones first, then by arrival, as within a priority). Admissions alone need gap x aging_steps of them (a gap of
      2^31 levels: forever); the time bound holds whatever the gap.
    - fair: one FIFO per tenant; the head is the first request of the backlogged tenant with the least counted
      service (ties: the earliest arrival), counted by `counter` (the scheduler charges it as tokens are computed).

    NOTE: fcfs is a plain deque, as before policies existed: O(1) at any queue length. priority and fair find the
    head in O(queued) or O(tenants).
    """

    def __init__(self, policy: str = "fcfs", counter: ServiceCounter | None = None, aging_steps: int = AGING_ADMISSIONS,
                 max_wait: float = math.inf, clock: Callable[[], float] = time.monotonic) -> None:
        """`max_wait`: priority: seconds of waiting after which a request is OVERDUE; `clock`: monotonic seconds."""
        if policy not in SCHEDULING_POLICIES:
            raise ValueError(f"scheduling_policy must be one of {', '.join(SCHEDULING_POLICIES)}, got {policy!r}")
        if aging_steps < 1:
            raise ValueError(f"aging_steps must be >= 1, got {aging_steps}")
        if not max_wait > 0:
            raise ValueError(f"max_wait must be > 0 seconds, got {max_wait}")
        self.policy = policy
        self.counter = counter or ServiceCounter()
        self.aging_steps = aging_steps
        self.max_wait = max_wait
        self.clock = clock
        self._since: dict[int, float] = {}  # id(request) -> clock() when it was queued (priority ageing in time)
        self._fifo: deque = deque()  # fcfs and priority: in arrival order, front-pushed ones first
        self._by_tenant: dict[str, deque] = {}  # fair: tenant -> its FIFO (no empty ones)
        self._admitted = 0  # admissions so far (priority aging)
        self._enqueued: dict[int, int] = {}  # id(request) -> self._admitted when it was queued (priority aging)
        self._order = itertools.count()
        self.num_waiting_by_tenant: dict[str, int] = {}  # tenant -> its requests waiting here (no zero entries)
        self._rank: dict[int, tuple] = {}  # id(request) -> (0, -order) front-pushed, (1, arrival, order) appended

    # -- deque's interface (what the scheduler used) --------------------------------------------------------
    def __len__(self) -> int:
        return len(self._rank)  # NOTE: one entry per waiting request, whatever the policy

    def __bool__(self) -> bool:
        return bool(self._rank)

    def __iter__(self) -> Iterator:
        """Every waiting request, head first (the order they would be admitted in, were nothing to change)."""
        if self.policy == "fcfs":
            return iter(self._fifo)  # NOTE: as the deque was: no removal while iterating
        return iter(self._ordered())

    def __contains__(self, req) -> bool:
        return id(req) in self._rank

    def __getitem__(self, i: int):
        if i != 0:
            raise IndexError("only the head ([0]) of a waiting queue is indexable")
        return self.head()

    def append(self, req: Waiting) -> None:
        """A request arrives (or comes back from another worker) at the back of its class."""
        self._add(req, front=False)

    def insert_by_arrival(self, req: Waiting) -> None:
        """A request moved here from another worker: behind the waiting ones that arrived no later, ahead of the
        younger ones (of its priority, of its tenant)."""
        self._add(req, front=False)
        q = self._fifo if self.policy != "fair" else self._by_tenant[req.tenant]
        q.pop()
        at = next((i for i, w in enumerate(q) if w.arrival_time > req.arrival_time), len(q))
        q.insert(at, req)

    def appendleft(self, req: Waiting) -> None:
        """A preempted request goes back before the waiting ones (of its priority, of its tenant)."""
        self._add(req, front=True)

    def popleft(self) -> Waiting:
        req = self.head()
        self.remove(req)
        self._admitted += 1
        return req

    def remove(self, req: Waiting) -> None:
        if id(req) not in self._rank:
            raise ValueError("not waiting")
        del self._rank[id(req)]
        self._enqueued.pop(id(req), None)
        self._since.pop(id(req), None)
        counts = self.num_waiting_by_tenant
        counts[req.tenant] -= 1
        if not counts[req.tenant]:
            del counts[req.tenant]
        if self.policy != "fair":
            self._fifo.remove(req)
            return
        q = self._by_tenant[req.tenant]
        q.remove(req)
        if not q:
            del self._by_tenant[req.tenant]
            if not self._by_tenant:
                self.counter.drained(iter((req.tenant,)))

    def clear(self) -> None:
        self._fifo.clear()
        self._by_tenant.clear()
        self._rank.clear()
        self._enqueued.clear()
        self._since.clear()
        self.num_waiting_by_tenant.clear()

    # -- the policy ------------------------------------------------------------------------------------------
    def head(self) -> Waiting:
        """The next request to admit; IndexError when none waits."""
        if self.policy == "fcfs":
            return self._fifo[0]
        if self.policy == "priority":
            if not self._fifo:
                raise IndexError("no request is waiting")
            now = self.clock()
            return min(self._fifo, key=lambda r: self._priority_key(r, now))
        if not self._by_tenant:
            raise IndexError("no request is waiting")
        return self._by_tenant[self._next_tenant(self._by_tenant)][0]

    def _next_tenant(self, queues) -> str:
        """fair: the tenant of `queues` (tenant -> its waiting requests, none empty) with the least counted service,
        ties to the one with fewer requests waiting, then to the one whose first request arrived first. NOTE: a
        tenant turning backlogged is lifted to the others' least counter, a tie: the lighter tenant goes first."""
        service = self.counter.service
        return min(queues, key=lambda t: (service.get(t, 0.0), len(queues[t]), queues[t][0].arrival_time))

    def effective_priority(self, req: Waiting, now: float | None = None) -> int:
        """OVERDUE once it has waited `max_wait` seconds (by `now`, default: the clock's), else its priority less
        one for every `aging_steps` admissions it has waited through (never below MIN_PRIORITY: the overdue stay
        first)."""
        since = self._since.get(id(req))
        if since is not None and (self.clock() if now is None else now) - since >= self.max_wait:
            return OVERDUE
        waited = self._admitted - self._enqueued.get(id(req), self._admitted)
        return max(MIN_PRIORITY, req.priority - waited // self.aging_steps)

    def _priority_key(self, req: Waiting, now: float) -> tuple:
        return (self.effective_priority(req, now), *self._rank[id(req)])

    def _add(self, req: Waiting, front: bool) -> None:
        if id(req) in self._rank:
            raise ValueError("already waiting")
        # NOTE: front-pushed requests rank before appended ones; among them later front-pushes go first (a deque's
        # appendleft), appended ones go by arrival (then the order they came in)
        order = next(self._order)
        self._rank[id(req)] = (0, -order) if front else (1, req.arrival_time, order)
        self._enqueued.setdefault(id(req), self._admitted)
        self._since.setdefault(id(req), self.clock())  # NOTE: a wait per stay: a preempted request starts anew
        self.num_waiting_by_tenant[req.tenant] = self.num_waiting_by_tenant.get(req.tenant, 0) + 1
        if self.policy != "fair":
            (self._fifo.appendleft if front else self._fifo.append)(req)
            return
        q = self._by_tenant.get(req.tenant)
        if q is None:
            self.counter.lift(req.tenant, iter(self._by_tenant))
            q = self._by_tenant[req.tenant] = deque()
        (q.appendleft if front else q.append)(req)

    def _ordered(self) -> list:
        if self.policy == "priority":
            now = self.clock()
            return sorted(self._fifo, key=lambda r: self._priority_key(r, now))
        # fair: replay the head choice without charging (the order if no service were counted meanwhile)
        queues = {t: deque(q) for t, q in self._by_tenant.items()}
        out = []
        while queues:
            t = self._next_tenant(queues)
            out.append(queues[t].popleft())
            if not queues[t]:
                del queues[t]
        return out
