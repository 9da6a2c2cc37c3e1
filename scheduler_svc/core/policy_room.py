"""What the priority and fair policies do in a step beyond admission order: preemptions, and budget given way."""

from __future__ import annotations

from pagedserve_common.step import SequenceDelta, StepPlan
from scheduler_svc.core.request import Request


class PolicyRoom:
    """Part of Scheduler (a mixin over its state, as Handover is): how a waiting request that its policy puts first
    gets room in a step (scheduler_svc.core.waiting orders the queue; this makes room for its head)."""

    def _preempt_for_priority(self, plan: StepPlan, budget: int) -> None:
        """The priority policy, before the step's running sequences: while the waiting head outranks the running
        sequence of the worst admitted priority (the latest admitted of those) and has no room (no sequence slot, or
        fewer free blocks than its first chunk needs, prefix hits not counted), that sequence is preempted, as under
        memory pressure (recomputed or swapped; its client sees no gap). NOTE: a running sequence is judged by the
        effective priority it was admitted with, so one that aged its way in is not preempted by the next urgent
        request: aging then bounds every request's wait. An overdue head (waiting.OVERDUE: it waited --priority-
        max-wait) outranks every priority, and one admitted overdue is never preempted here."""
        waiting, running = self.waiting, self.running
        while waiting and running:
            head = waiting.head()
            rank = waiting.effective_priority(head)
            at = max(range(len(running)), key=lambda i: (running[i].admitted_priority, i))
            if running[at].admitted_priority <= rank:
                return
            if self._has_room(head, budget):
                return
            victim = running.pop(at)
            self._preempt(victim, plan)
            self.num_policy_preemptions += 1

    def _preempt_for_fair_share(self, plan: StepPlan, budget: int) -> None:
        """The fair policy, before the step's running sequences: while the waiting head has no room (no sequence slot,
        or fewer free blocks than its first chunk needs) and its tenant holds less than its share of the
        max_num_seqs slots (split by weight among the tenants running or waiting), the latest admitted sequence of
        the tenant furthest over its share is preempted (recomputed or swapped; its client sees no gap), unless that
        tenant was served less than the head's. NOTE: a victim's tenant never drops below its share, and never was
        served less than the head's, so two backlogged tenants cannot preempt each other back and forth."""
        waiting, running, cfg = self.waiting, self.running, self.config
        counter = waiting.counter
        slots: dict[str, int] | None = None
        while waiting and running:
            head = waiting.head()
            if self._has_room(head, budget):
                return
            width = head.fork_into or 1
            if slots is None:
                slots = {}
                for r in running:
                    slots[r.tenant] = slots.get(r.tenant, 0) + (r.fork_into or 1)
            active = slots.keys() | waiting.num_waiting_by_tenant.keys()
            total = sum(counter.weight(t) for t in active)
            share = {t: cfg.max_num_seqs * counter.weight(t) / total for t in active}
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
            self._preempt(victim, plan)
            self.num_policy_preemptions += 1

    def _has_room(self, head: Request, budget: int) -> bool:
        """Whether the waiting head can be admitted now: a sequence slot, and free blocks for its first chunk (prefix
        hits not counted). NOTE: a static kv_allocation reserves at admission: slots only."""
        if self._num_seq_slots + (head.fork_into or 1) > self.config.max_num_seqs:
            return False
        pool = getattr(self.kv, "pool", None)
        num_new = min(head.num_target_tokens() - head.num_computed_tokens, budget)
        return pool is None or pool.num_free_blocks >= self.kv.num_blocks_for(num_new)

    def _resume_yielded(self, yielded: list[Request], plan: StepPlan, scheduled: list, budget: int, cap: int) -> int:
        """fair: the budget the admissions left (the head may have found no room) goes to the running chunks that
        gave way to it, in admission order, without preempting anyone: a step never idles for a yield. Returns the
        budget left."""
        kv = self.kv
        for req in yielded:
            if budget <= 0:
                break
            num_new = min(req.num_target_tokens() - req.num_computed_tokens, budget, cap)
            alloc = kv.allocate(req.seq_id, self._num_table_tokens(req, num_new), req.all_token_ids)
            if alloc is None:
                continue
            plan.copies.extend(alloc.copies)
            if req.on_worker:
                plan.running.append(SequenceDelta(req.seq_id, list(alloc.new_block_ids), num_new, []))
            else:
                plan.new_seqs.append(self._new_plan(req, num_new))
            scheduled.append((req, num_new))
            budget -= num_new
        return budget

    def _fair_head(self, cap: int) -> tuple[str, int]:
        """fair: (the waiting head's tenant, the tokens of the head's first chunk)."""
        head = self.waiting.head()
        return head.tenant, max(1, min(head.num_target_tokens() - head.num_computed_tokens, cap))

    def _fair_yields(self, req: Request, fair_head: tuple[str, int]) -> bool:
        """fair: whether running `req`'s prefill chunk yields budget to the waiting head: another tenant's, served no
        more than `req`'s (NOTE: no more, not less: a tenant turning backlogged is lifted to a tie)."""
        tenant = fair_head[0]
        service = self.waiting.counter.service
        return req.tenant != tenant and service.get(req.tenant, 0.0) >= service.get(tenant, 0.0)

    def _charge(self, scheduled: list[tuple[Request, int]]) -> None:
        """The fair policy counts each tenant's service as its tokens are scheduled: the known tokens computed
        (prompt, or a recomputation) as prefill, the rest (the token sampled next, drafts) as decode."""
        charge = self.waiting.counter.charge
        for req, num_new in scheduled:
            known = len(req.all_token_ids) - req.num_computed_tokens - 1  # known tokens before the last one
            num_prefill = min(num_new, max(0, known))
            charge(req.tenant, num_prefill, num_new - num_prefill)
