"""What the priority and fair policies do in a step beyond admission order: preemptions, and budget given way."""

from __future__ import annotations

from collections.abc import Callable

from scheduler_svc.core.request import Request
from scheduler_svc.core.waiting import WaitingQueue


class PolicyRoom:
    """Owned by a Scheduler: how a waiting request that its policy puts first gets room in a step
    (scheduler_svc.core.waiting orders the queue; this decides whom to preempt for its head, which running prefill
    chunks give way to it, and charges the fair policy's service).

    It reads the scheduler's queue and running list (shared, never replaced) and acts through two callbacks the
    scheduler passes per call: `has_room(head)` (a sequence slot and free blocks for its first chunk) and
    `preempt(victim)` (the victim, popped off `running` here, gives its blocks back and waits at the front).
    """

    def __init__(self, policy: str, waiting: WaitingQueue, max_num_seqs: int) -> None:
        self.priority = policy == "priority"
        self.fair = policy == "fair"
        self.waiting = waiting
        self.max_num_seqs = max_num_seqs
        self.num_preemptions = 0  # made room for a waiting request its policy puts first

    def make_room(self, running: list[Request], has_room: Callable[[Request], bool],
                  preempt: Callable[[Request], None]) -> None:
        """Before a step's running sequences: the preemptions the policy makes for the waiting head."""
        if self.priority:
            self._preempt_for_priority(running, has_room, preempt)
        elif self.fair:
            self._preempt_for_fair_share(running, has_room, preempt)

    def _preempt_for_priority(self, running: list[Request], has_room: Callable[[Request], bool],
                              preempt: Callable[[Request], None]) -> None:
        """The priority policy: while the waiting head outranks the running sequence of the worst admitted priority
        (the latest admitted of those) and has no room (no sequence slot, or fewer free blocks than its first chunk
        needs, prefix hits not counted), that sequence is preempted, as under memory pressure (recomputed or
        swapped; its client sees no gap). NOTE: a running sequence is judged by the effective priority it was
        admitted with, so one that aged its way in is not preempted by the next urgent request: aging then bounds
        every request's wait. An overdue head (waiting.OVERDUE: it waited --priority-max-wait) outranks every
        priority, and one admitted overdue is never preempted here."""
        waiting = self.waiting
        while waiting and running:
            head = waiting.head()
            rank = waiting.effective_priority(head)
            at = max(range(len(running)), key=lambda i: (running[i].admitted_priority, i))
            if running[at].admitted_priority <= rank or has_room(head):
                return
            preempt(running.pop(at))
            self.num_preemptions += 1

    def _preempt_for_fair_share(self, running: list[Request], has_room: Callable[[Request], bool],
                                preempt: Callable[[Request], None]) -> None:
        """The fair policy: while the waiting head has no room (no sequence slot, or fewer free blocks than its first
        chunk needs) and its tenant holds less than its share of the max_num_seqs slots (split by weight among the
        tenants running or waiting), the latest admitted sequence of the tenant furthest over its share is preempted
        (recomputed or swapped; its client sees no gap), unless that tenant was served less than the head's.
        NOTE: a victim's tenant never drops below its share, and never was served less than the head's, so two
        backlogged tenants cannot preempt each other back and forth."""
        waiting = self.waiting
        counter = waiting.counter
        slots: dict[str, int] | None = None
        while waiting and running:
            head = waiting.head()
            if has_room(head):
                return
            width = head.fork_into or 1
            if slots is None:
                slots = {}
                for r in running:
                    slots[r.tenant] = slots.get(r.tenant, 0) + (r.fork_into or 1)
            active = slots.keys() | waiting.num_waiting_by_tenant.keys()
            total = sum(counter.weight(t) for t in active)
            share = {t: self.max_num_seqs * counter.weight(t) / total for t in active}
            if slots.get(head.tenant, 0) + width > share[head.tenant]:
                return  # its tenant has its share: it waits, as under fcfs
            over = max(slots, key=lambda t: slots[t] - share[t])
            at = max(i for i, r in enumerate(running) if r.tenant == over)
            if slots[over] - (running[at].fork_into or 1) < share[over]:
                return  # nobody holds more than a share
            if counter.service.get(over, 0.0) < counter.service.get(head.tenant, 0.0):
                return  # served less than the head's tenant: it took a free slot that tenant had no claim to
            victim = running.pop(at)
            slots[over] -= victim.fork_into or 1
            preempt(victim)
            self.num_preemptions += 1

    def fair_head(self, cap: int) -> tuple[str, int] | None:
        """fair, with a request waiting: (the waiting head's tenant, the tokens of the head's first chunk), which
        running prefill chunks of other tenants served no less leave in the step's budget (yields); else None."""
        if not self.fair or not self.waiting:
            return None
        head = self.waiting.head()
        return head.tenant, max(1, min(head.num_target_tokens() - head.num_computed_tokens, cap))

    def yields(self, req: Request, fair_head: tuple[str, int]) -> bool:
        """fair: whether running `req`'s prefill chunk yields budget to the waiting head: another tenant's, served no
        more than `req`'s (NOTE: no more, not less: a tenant turning backlogged is lifted to a tie)."""
        tenant = fair_head[0]
        service = self.waiting.counter.service
        return req.tenant != tenant and service.get(req.tenant, 0.0) >= service.get(tenant, 0.0)

    def charge(self, scheduled: list[tuple[Request, int]]) -> None:
        """fair: each tenant's service counted as its tokens are scheduled: the known tokens computed (prompt, or a
        recomputation) as prefill, the rest (the token sampled next, drafts) as decode."""
        charge = self.waiting.counter.charge
        for req, num_new in scheduled:
            known = len(req.all_token_ids) - req.num_computed_tokens - 1  # known tokens before the last one
            num_prefill = min(num_new, max(0, known))
            charge(req.tenant, num_prefill, num_new - num_prefill)
