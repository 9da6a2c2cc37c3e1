"""Continuous batching at iteration level: chunked prefill, prefix-cache hits, recompute preemption, forks."""

from __future__ import annotations

import itertools
import random
import time
from collections.abc import Iterator

from pagedserve_common.step import NewSequence, PromptLogprobs, SequenceDelta, StepPlan
from scheduler_svc.core import capacity, handover, reservation
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.outputs import append_token, constraint_failed, merge_prompt_logprobs
from scheduler_svc.core.policy_room import PolicyRoom
from scheduler_svc.core.request import FinishReason, Request, RequestOutput, RequestStatus
from scheduler_svc.core.speculation import SPECULATIVE_METHODS, Speculator
from scheduler_svc.core.step import ScheduledStep, StepRoom, new_sequence
from scheduler_svc.core.waiting import ServiceCounter, WaitingQueue
from scheduler_svc.kv.block_pool import BlockPool
from scheduler_svc.kv.manager import KVCacheManager
from scheduler_svc.kv.static import KV_ALLOCATIONS, STATIC_KV_ALLOCATIONS, StaticKVCacheManager

_RUNNING, _FINISHED = RequestStatus.RUNNING, RequestStatus.FINISHED
_NO_IDS: frozenset[int] = frozenset()


class Scheduler:
    """Decides each step's batch; owns every sequence's block table through a KVCacheManager (a
    StaticKVCacheManager in the static kv_allocation modes: one contiguous run per sequence, reserved at admission).

    Protocol: step = schedule() -> send step.plan -> update(step, sampled) -> schedule() ..., one step in flight,
    held by the caller (ScheduledStep): nothing about it is kept here.
    NOTE: a sequence the worker holds (on_worker) is only ever sent as a delta: its table is append-only.
    A fork child's first write may replace its shared last block (copy-on-write), so it is sent as new.
    NOTE: the KV manager keys block tables by seq_id, which is unique among live sequences.
    """

    def __init__(self, config: SchedulerConfig, seq_ids: Iterator[int] | None = None,
                 service: ServiceCounter | None = None) -> None:
        """`seq_ids` hands out sequence ids; the engine shares one among its workers' schedulers, so that a
        sequence id names one sequence across the whole fleet (and a migrated sequence gets a fresh one).
        `service`: the fair policy's per-tenant counters, shared the same way (a tenant's service is fleet-wide)."""
        if config.max_num_seqs < 1 or config.max_num_batched_tokens < 1:
            raise ValueError("max_num_seqs and max_num_batched_tokens must be >= 1")
        if config.kv_allocation not in KV_ALLOCATIONS:
            raise ValueError(f"kv_allocation must be one of {', '.join(KV_ALLOCATIONS)}, "
                             f"got {config.kv_allocation!r}")
        if config.speculative not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative must be one of {', '.join(SPECULATIVE_METHODS)}, got {config.speculative!r}")
        self.config = config
        self.static = config.kv_allocation in STATIC_KV_ALLOCATIONS
        self.spec = Speculator(config.num_speculative_tokens) if config.speculative == "ngram" else None
        self.kv: KVCacheManager | StaticKVCacheManager
        windows = config.kv_group_windows
        if (len(windows) > 1 or any(windows)) and (self.static or config.num_cpu_blocks):
            # NOTE: a swap or a reservation would move or reserve the stale entries of freed sliding blocks too
            raise ValueError(f"KV groups {windows} (sliding-window layers) support neither swap space (num_cpu_blocks "
                             f"{config.num_cpu_blocks}) nor kv_allocation {config.kv_allocation}: preemption "
                             "recomputes; use kv_allocation paged")
        if self.static:
            if config.num_cpu_blocks:
                raise ValueError(f"kv_allocation {config.kv_allocation} does not support swap space (num_cpu_blocks "
                                 f"{config.num_cpu_blocks}): a reservation is never swapped out")
            self.kv = StaticKVCacheManager(config.num_blocks, config.block_size)
        else:
            self.kv = KVCacheManager(config.num_blocks, config.block_size, config.enable_prefix_caching, windows)
        # NOTE: CPU swap blocks hold no prefix cache: a plain pool of ids.
        self.cpu_pool = BlockPool(config.num_cpu_blocks) if config.num_cpu_blocks else None
        self.num_swaps = 0
        self.requests: dict[str, Request] = {}  # unfinished client requests (parents for n > 1)
        # Admission order (scheduler_svc.core.waiting): fcfs, priority or fair; preempted sequences go back first
        self.waiting = WaitingQueue(config.scheduling_policy, service, max_wait=config.priority_max_wait)
        self.policy = PolicyRoom(config.scheduling_policy, self.waiting, config.max_num_seqs)
        self.running: list[Request] = []  # in admission order: the last is the first preemption victim
        self.num_preemptions = 0
        self.num_prefill_tokens = 0  # prompt tokens computed: prefix hits excluded, recomputation included
        self.waiting_for_blocks = False  # the last schedule() left the queue head waiting for free KV blocks
        self.steps = 0
        self._seq_ids = seq_ids if seq_ids is not None else itertools.count()
        self._num_seq_slots = 0  # running sequences, counting an unforked parent as its n future children
        self._finished_seq_ids: list[int] = []  # the worker's to drop, told in the next plan
        self._eos = frozenset(config.eos_token_ids)
        # NOTE: the request ids with min_tokens that may still be live (pruned lazily): a step's banned_samples costs
        # nothing while there are none, the common case
        self.min_tokens_request_ids: set[str] = set()
        self._rng = random.Random()
        self.num_constrained = 0  # client requests here with structured output (their samples need bitmasks)

    # -- admission ----------------------------------------------------------------------------------------
    def add_request(self, req: Request) -> None:
        """Queues a request; raises ValueError naming the offending field when it can never be served."""
        sp = req.sampling
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in flight")
        self.check_fits(req)
        req.status = RequestStatus.WAITING
        req.seq_id = self._new_seq_id()
        req.seed = sp.seed if sp.seed is not None else self._rng.getrandbits(63)
        req.fork_into = sp.n if sp.n > 1 else 0
        eos = _NO_IDS if sp.ignore_eos else self._eos
        # NOTE: shared, not one set per request, when there are no stop ids of its own (~200 B a queued request)
        req.stop_ids = frozenset(sp.stop_token_ids) | eos if sp.stop_token_ids else eos
        self.requests[req.request_id] = req
        self.num_constrained += req.constraint is not None
        self.waiting.append(req)
        if sp.min_tokens:
            self.min_tokens_request_ids.add(req.request_id)

    def check_fits(self, req: Request) -> None:
        """Raises InvalidField naming the field when this worker can never serve `req`: capacity only (its prompt
        does not fit max_model_len, or its worst case alone needs more than the pool). NOTE: the front end checked
        the request's shape and ranges (FrontEnd._check) before it reached a scheduler."""
        capacity.check_fits(self.config, len(req.prompt_token_ids), req.sampling)

    def num_reserved_tokens(self, num_prompt_tokens: int, max_tokens: int) -> int:
        """Static modes: the tokens a request reserves at admission (scheduler_svc.core.reservation)."""
        return reservation.num_reserved_tokens(self.config, num_prompt_tokens, max_tokens)

    def max_output_tokens(self, num_prompt_tokens: int, n: int = 1) -> int:
        """The largest max_tokens check_fits accepts for a prompt this long with n samples (0: none)."""
        return capacity.max_output_tokens(self.config, num_prompt_tokens, n)

    def _new_seq_id(self) -> int:
        return next(self._seq_ids)

    # -- finishing ----------------------------------------------------------------------------------------
    def abort(self, request_id: str) -> None:
        """Drops a request and all its samples; the worker is told in the next plan. Unknown ids are ignored."""
        req = self.requests.get(request_id)
        if req is None:
            return
        for seq in req.children or (req,):
            if not seq.is_finished:
                self._finish(seq, FinishReason.ABORT)

    def finish(self, request_id: str, reason: FinishReason = FinishReason.STOP_STRING, index: int = 0) -> None:
        """Finishes one sample early: the hook for stop strings, which need detokenized text."""
        req = self.requests.get(request_id)
        if req is None:
            return
        seq = req.children[index] if req.children else req
        if not seq.is_finished:
            self._finish(seq, reason)

    def _finish(self, seq: Request, reason: FinishReason) -> None:
        was = seq.status
        seq.status, seq.finish_reason = _FINISHED, reason
        if was is _RUNNING:
            self.running.remove(seq)
            self._num_seq_slots -= seq.fork_into or 1
            self.kv.free(seq.seq_id)
        elif seq in self.waiting:  # only aborts and stop strings reach here while queued
            self.waiting.remove(seq)
            if seq.cpu_block_ids is not None:
                self.cpu_pool.free(seq.cpu_block_ids)
                seq.cpu_block_ids = None
        if seq.on_worker:
            self._finished_seq_ids.append(seq.seq_id)
            seq.on_worker = False
        parent = seq.parent
        if parent is None:
            del self.requests[seq.request_id]
            self.num_constrained -= seq.constraint is not None
        elif all(c.status is _FINISHED for c in parent.children):
            parent.status, parent.finish_reason = _FINISHED, reason
            del self.requests[parent.request_id]
            self.num_constrained -= parent.constraint is not None
            for child in parent.children:  # NOTE: no parent <-> child cycle outlives the request (Request.parent)
                child.parent = None

    # -- moving requests between workers (scheduler_svc.core.handover) ------------------------------------------
    def release_all(self, in_flight: ScheduledStep | None = None) -> list[Request]:
        """The worker is gone: every unfinished client request, oldest first, reset to be recomputed elsewhere
        (adopt()). Every block goes back to the pool, the CPU blocks the step `in_flight` swapped in included."""
        out = sorted(self.requests.values(), key=lambda r: r.arrival_time)
        for seq in self.running:
            self.kv.free(seq.seq_id)
        for req in out:
            for seq in handover.unfinished(req):
                handover.reset_for_recompute(seq, self.cpu_pool)
        self.running.clear()
        self.waiting.clear()
        self.requests.clear()
        self._num_seq_slots, self.num_constrained = 0, 0
        self._finished_seq_ids = []
        self.min_tokens_request_ids.clear()
        if in_flight is not None and in_flight.cpu_block_ids_to_free:
            self.cpu_pool.free(in_flight.cpu_block_ids_to_free)
            in_flight.cpu_block_ids_to_free = []
        return out

    def take_queued(self) -> list[Request]:
        """Removes the client requests none of whose samples holds blocks here (queued: never started, or
        preempted), reset for another worker to adopt(); for a worker that is leaving."""
        out = []
        for req in list(self.requests.values()):
            seqs = handover.unfinished(req)
            if any(s.status is _RUNNING for s in seqs):
                continue
            for seq in seqs:
                self.waiting.remove(seq)
                handover.reset_for_recompute(seq, self.cpu_pool)
            del self.requests[req.request_id]
            self.num_constrained -= req.constraint is not None
            out.append(req)
        return out

    def adopt(self, req: Request) -> None:
        """Queues a request released by another worker: its samples get fresh sequence ids and are recomputed
        from all their known tokens (prompt and streamed output) with their own seeds, so they continue exactly
        where they stopped. It queues by arrival time, ahead of younger requests (of its priority, of its tenant).
        Raises ValueError like add_request when this worker can never serve it."""
        if req.request_id in self.requests:
            raise ValueError(f"request_id {req.request_id!r} is already in flight")
        self.check_fits(req)
        seqs = handover.unfinished(req)
        for seq in seqs:
            seq.seq_id = self._new_seq_id()
        for seq in seqs:
            self.waiting.insert_by_arrival(seq)
        self.requests[req.request_id] = req
        self.num_constrained += req.constraint is not None
        if req.sampling.min_tokens:
            self.min_tokens_request_ids.add(req.request_id)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- one step -----------------------------------------------------------------------------------------
    def schedule(self) -> ScheduledStep | None:
        """The next step; None when there is nothing to run and nothing to tell the worker. Its phases, in order:
        preemptions the policy makes for its waiting head, the running sequences (decodes and prefill chunks, in
        admission order, preempting under memory pressure), admissions in the policy's order, the budget the fair
        policy's yields left, then the step's accounting."""
        cfg = self.config
        plan = StepPlan(self.steps, finished_seq_ids=self._finished_seq_ids)
        self._finished_seq_ids = []
        room = StepRoom(ScheduledStep(plan), cfg.max_num_batched_tokens,
                        cfg.long_prefill_token_threshold or cfg.max_num_batched_tokens)
        self.waiting_for_blocks = False
        self._make_room_by_policy(room)
        self._schedule_running(room)
        self._admit_waiting(room)
        if room.yielded and room.budget > 0:
            self._resume_yielded(room)
        step = room.step
        if not step.scheduled and not plan.finished_seq_ids and not plan.preempted_seq_ids:
            return None
        self._account(room)
        self.steps += 1
        return step

    def _make_room_by_policy(self, room: StepRoom) -> None:
        """priority and fair: preemptions for the waiting head (PolicyRoom), and (fair) the head's first chunk kept
        in the budget from the prefill chunks of running sequences of other tenants served no less (decodes are
        never held back)."""
        if self.waiting and self.running:
            plan = room.step.plan
            self.policy.make_room(self.running, lambda head: self._has_room(head, room.budget),
                                  lambda victim: self._preempt(victim, plan))
        room.fair_head = self.policy.fair_head(room.cap)

    def _has_room(self, head: Request, budget: int) -> bool:
        """Whether the waiting head can be admitted now: a sequence slot, and free blocks for its first chunk (prefix
        hits not counted). NOTE: a static kv_allocation reserves at admission: slots only."""
        if self._num_seq_slots + (head.fork_into or 1) > self.config.max_num_seqs:
            return False
        pool = getattr(self.kv, "pool", None)
        num_new = min(head.num_target_tokens() - head.num_computed_tokens, budget)
        return pool is None or pool.num_free_blocks >= self.kv.num_blocks_for(num_new)

    def _schedule_running(self, room: StepRoom) -> None:
        """Running sequences first, in admission order: each its decode or its next prefill chunk (and drafts,
        under speculation), recompute-preempting the most recently admitted under memory pressure."""
        kv, running, spec, plan = self.kv, self.running, self.spec, room.step.plan
        budget, cap, fair_head, scheduled = room.budget, room.cap, room.fair_head, room.step.scheduled
        new_plans, running_plans, copies = plan.new_seqs, plan.running, plan.copies  # NOTE: locals: a hot loop
        # NOTE: room for drafts: a step of many decodes is compute-bound, where each draft costs what a token costs
        num_draft_room = spec.max_step_tokens - len(running) if spec is not None else 0
        i = 0
        while i < len(running) and budget > 0:
            req = running[i]
            tokens = req.all_token_ids
            # NOTE: inlined num_target_tokens(): this loop runs once per running sequence per step.
            num_new = min(len(tokens) - (1 if req.fork_into else 0) - req.num_computed_tokens, budget, cap)
            # NOTE: before drafting: num_new > 1 is a prefill chunk here (a decode schedules 1)
            if fair_head is not None and num_new > 1 and self.policy.yields(req, fair_head):
                num_new = min(num_new, budget - fair_head[1])
                if num_new < 1:  # its chunk waits for the admissions: what they leave it is its (_resume_yielded)
                    room.yielded.append(req)
                    i += 1
                    continue
            alloc = None
            if spec is not None:
                alloc, num_new = self._draft(req, num_new, min(num_draft_room, budget - num_new), room.step.drafted)
                num_draft_room -= len(req.draft_token_ids)
            if alloc is None:
                alloc = kv.allocate(req.seq_id, self._num_table_tokens(req, num_new), tokens,
                                    num_computed=req.num_computed_tokens)
            while alloc is None:  # out of blocks: recompute-preempt the most recently admitted sequence
                victim = running.pop()
                self._preempt(victim, plan)
                room.num_preempted += 1
                if victim is req:
                    break
                alloc = kv.allocate(req.seq_id, self._num_table_tokens(req, num_new), tokens,
                                    num_computed=req.num_computed_tokens)
            if alloc is None:
                break  # it was the last one itself
            if alloc.copies:
                copies.extend(alloc.copies)
            if req.on_worker:
                # NOTE: most steps add no block: a literal [] then, not list(()) (~0.1 us a sequence a step)
                new_ids = alloc.new_block_ids
                running_plans.append(SequenceDelta(req.seq_id, list(new_ids) if new_ids else [], num_new,
                                                   req.draft_token_ids or []))
            else:  # a fork child's first step: its table after copy-on-write goes whole
                new_plans.append(self._new_plan(req, num_new))
            scheduled.append((req, num_new))
            budget -= num_new
            i += 1
        room.budget = budget

    def _admit_waiting(self, room: StepRoom) -> None:
        """Then waiting requests in the policy's order, while slots, budget and blocks last; nobody when memory is
        so tight that someone was just preempted. A swapped-out one has its KV restored instead of recomputed."""
        waiting, kv, step, fair = self.waiting, self.kv, room.step, self.policy.fair
        if room.num_preempted:
            self.waiting_for_blocks = bool(waiting)
            return
        while waiting and room.budget > 0:
            if fair:  # NOTE: charged as it goes, so the next head is picked by the service so far
                self.policy.charge(step.scheduled[room.num_charged:])
                room.num_charged = len(step.scheduled)
            req = waiting[0]
            if self._num_seq_slots + (req.fork_into or 1) > self.config.max_num_seqs:
                break
            if req.cpu_block_ids is not None:  # swapped out: restore its KV instead of recomputing it
                if not self._swap_in(req, step, min(req.num_target_tokens() - req.num_computed_tokens, room.budget)):
                    self.waiting_for_blocks = True
                    break
                self._scheduled_one(room, req, step.plan.new_seqs[-1].num_scheduled_tokens)
                continue
            log = req.prompt_log
            # NOTE: prompt logprobs: no hit over rows whose positions it lacks (their logits must be computed)
            hit = kv.find_prefix(req.all_token_ids, req.cache_salt, None if log is None or log.complete
                                 else log.max_hit_tokens())
            num_new = min(req.num_target_tokens() - hit.num_tokens, room.budget, room.cap)
            if self.static and not self._reserve(req, num_new):
                self.waiting_for_blocks = True  # no free run that long, though the holes may add up to enough
                break
            if kv.allocate(req.seq_id, hit.num_tokens + num_new, req.all_token_ids, hit, req.cache_salt,
                           num_computed=hit.num_tokens) is None:
                self.waiting_for_blocks = True  # wait for running sequences to finish
                break
            self._admitted(req, hit.num_tokens)
            if num_new == 0:  # a fork parent whose whole prefix hit the cache: fork now
                self._fork_admitted(room, req)
                continue
            step.plan.new_seqs.append(self._new_plan(req, num_new))
            self._scheduled_one(room, req, num_new)

    def _admitted(self, req: Request, num_hit_tokens: int) -> None:
        """The waiting head, its blocks allocated, runs from this step on."""
        # NOTE: counted once admitted: a queue head that waits for blocks is looked up again every step.
        self.kv.record_prefix_query(len(req.all_token_ids), num_hit_tokens)
        req.admitted_priority = self.waiting.effective_priority(req)
        self.waiting.popleft()
        if req.status is RequestStatus.WAITING:
            req.num_cached_prompt_tokens = num_hit_tokens
            req.first_scheduled_time = req.first_scheduled_time or time.monotonic()
        req.status, req.num_computed_tokens = _RUNNING, num_hit_tokens
        self.running.append(req)
        self._num_seq_slots += req.fork_into or 1

    def _fork_admitted(self, room: StepRoom, req: Request) -> None:
        """A fork parent admitted with its whole prefix cached forks at once; each child computes the last prompt
        token (one without room or budget does next step)."""
        self._fork(req)
        for child in req.children:
            if room.budget <= 0:
                break
            alloc = self.kv.allocate(child.seq_id, child.num_computed_tokens + 1, child.all_token_ids,
                                     num_computed=child.num_computed_tokens)
            if alloc is None:
                break
            room.step.plan.copies.extend(alloc.copies)
            room.step.plan.new_seqs.append(self._new_plan(child, 1))
            self._scheduled_one(room, child, 1)

    def _resume_yielded(self, room: StepRoom) -> None:
        """fair: the budget the admissions left (the head may have found no room) goes to the running chunks that
        gave way to it, in admission order, without preempting anyone: a step never idles for a yield."""
        plan = room.step.plan
        for req in room.yielded:
            if room.budget <= 0:
                break
            num_new = min(req.num_target_tokens() - req.num_computed_tokens, room.budget, room.cap)
            alloc = self.kv.allocate(req.seq_id, self._num_table_tokens(req, num_new), req.all_token_ids,
                                     num_computed=req.num_computed_tokens)
            if alloc is None:
                continue
            plan.copies.extend(alloc.copies)
            if req.on_worker:
                plan.running.append(SequenceDelta(req.seq_id, list(alloc.new_block_ids), num_new, []))
            else:
                plan.new_seqs.append(self._new_plan(req, num_new))
            self._scheduled_one(room, req, num_new)

    @staticmethod
    def _scheduled_one(room: StepRoom, req: Request, num_new: int) -> None:
        room.step.scheduled.append((req, num_new))
        room.budget -= num_new

    def _account(self, room: StepRoom) -> None:
        """The step's counts: prompt tokens computed, the fair policy's charges, what the step's checks look at."""
        step = room.step
        num_prefill = 0  # NOTE: num_computed_tokens is still the count before this step; decodes add nothing
        for req, num_new in step.scheduled:
            pending = len(req.prompt_token_ids) - req.num_computed_tokens
            if pending > 0:
                num_prefill += num_new if num_new < pending else pending
        self.num_prefill_tokens += num_prefill
        if self.policy.fair:
            self.policy.charge(step.scheduled[room.num_charged:])
        if self.min_tokens_request_ids:
            self.min_tokens_request_ids &= self.requests.keys()
        step.any_constrained, step.any_min_tokens = bool(self.num_constrained), bool(self.min_tokens_request_ids)

    def _num_table_tokens(self, req: Request, num_new: int) -> int:
        """The tokens a running sequence's table must cover this step. NOTE: under speculation a table may already
        cover more (blocks allocated for refused drafts): it keeps them for the tokens to come (tables only grow)."""
        need = req.num_computed_tokens + num_new
        return need if self.spec is None else max(need, self.kv.num_tokens(req.seq_id))

    def _draft(self, req: Request, num_new: int, num_room: int, drafted: dict[int, int]):
        """Speculation: (allocation, tokens scheduled) of a decoding sequence that drafts this step (its drafts in
        req.draft_token_ids), or (None, num_new) with no drafts. NOTE: drafts never preempt anyone: without room for
        their blocks the sequence decodes plainly."""
        req.draft_token_ids = ()
        if num_new != 1 or num_room < 1 or not req.on_worker or req.num_computed_tokens + 1 != len(req.all_token_ids):
            return None, num_new
        drafts = self.spec.drafts(req, num_room, self.config.max_model_len)
        if not drafts:
            return None, num_new
        alloc = self.kv.allocate(req.seq_id, self._num_table_tokens(req, 1 + len(drafts)), req.all_token_ids,
                                 num_computed=req.num_computed_tokens)
        if alloc is None:
            return None, num_new
        req.draft_token_ids = drafts
        drafted[req.seq_id] = len(drafts)
        return alloc, 1 + len(drafts)

    def _reserve(self, req: Request, num_new: int) -> bool:
        """Static modes: reserves the run `req` keeps while it runs (and no shorter than its first step needs)."""
        num_tokens = self.num_reserved_tokens(len(req.prompt_token_ids), req.sampling.max_tokens)
        return self.kv.reserve(req.seq_id, max(num_tokens, num_new))

    def _new_plan(self, req: Request, num_new: int) -> NewSequence:
        return new_sequence(req, self.kv.block_table(req.seq_id), num_new)

    def _swap_in(self, req: Request, step: ScheduledStep, num_new: int) -> bool:
        """Admits a swapped-out sequence: fresh device blocks, its KV restored from CPU before the forward."""
        cpu_ids = req.cpu_block_ids
        alloc = self.kv.allocate(req.seq_id, req.num_computed_tokens + num_new, req.all_token_ids,
                                 num_computed=req.num_computed_tokens)
        if alloc is None:
            return False
        self.waiting.popleft()
        table = self.kv.block_table(req.seq_id)
        step.plan.swap_in.extend(zip(cpu_ids, table))
        step.cpu_block_ids_to_free.extend(cpu_ids)  # NOTE: not reusable until the worker has copied them in
        req.cpu_block_ids, req.status = None, _RUNNING
        self.running.append(req)
        self._num_seq_slots += req.fork_into or 1
        step.plan.new_seqs.append(self._new_plan(req, num_new))  # a new table: sent whole, never as a delta
        return True

    def _preempt(self, victim: Request, plan: StepPlan) -> None:
        """Preempts a victim just popped off `running`: it drops its device blocks and waits at the front.
        With swap space its computed KV is saved to CPU blocks; otherwise it is recomputed later, which prefix
        hits make cheap."""
        self._num_seq_slots -= victim.fork_into or 1
        table = self.kv.block_table(victim.seq_id)
        num_kv_blocks = self.kv.num_blocks_for(victim.num_computed_tokens)
        cpu = self.cpu_pool
        if cpu is not None and victim.num_computed_tokens and cpu.can_allocate(num_kv_blocks):
            victim.cpu_block_ids = cpu.allocate(num_kv_blocks)
            plan.swap_out.extend(zip(table, victim.cpu_block_ids))
            self.num_swaps += 1
        self.kv.free(victim.seq_id)
        if victim.on_worker:
            plan.preempted_seq_ids.append(victim.seq_id)
            victim.on_worker = False
        victim.status = RequestStatus.PREEMPTED
        if victim.cpu_block_ids is None:
            victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(victim)

    def _fork(self, parent: Request) -> None:
        """Replaces a parent whose prefix is computed by its n children, which share its blocks."""
        n, kv = parent.fork_into, self.kv
        parent.fork_into = 0
        children = []
        for index in range(n):
            child = parent.fork_child(index, self._new_seq_id())
            kv.fork(parent.seq_id, child.seq_id)
            children.append(child)
        kv.free(parent.seq_id)  # the children now hold every block
        at = self.running.index(parent)
        self.running[at:at + 1] = children  # same priority as the parent had
        parent.children = children
        if parent.on_worker:
            self._finished_seq_ids.append(parent.seq_id)
            parent.on_worker = False

    def update(self, step: ScheduledStep, sampled: dict[int, int], num_accepted_drafts: dict[int, int] | None = None,
               prompt_logprobs: dict[int, PromptLogprobs] | None = None) -> list[RequestOutput]:
        """Applies the worker's result for `step` (seq_id -> sampled token; seq_id -> drafts accepted, for the
        sequences that drafted; seq_id -> the prompt logprobs of its prompt rows, for those that asked); returns
        per-sample outputs. Prompt logprobs go into the request's log (Request.prompt_log) before its first token."""
        plan = step.plan
        if plan.step_id != self.steps - 1:
            raise ValueError(f"step {plan.step_id} is not the last one scheduled ({self.steps - 1})")
        if step.cpu_block_ids_to_free:
            self.cpu_pool.free(step.cpu_block_ids_to_free)
            step.cpu_block_ids_to_free = []
        outputs: list[RequestOutput] = []
        max_model_len = self.config.max_model_len
        for req, num in step.scheduled:
            if req.status is not _RUNNING:
                req.draft_token_ids = ()
                continue  # aborted or finished while the step ran
            if req.draft_token_ids:
                outputs.append(self._update_drafted(req, plan.step_id, sampled, num_accepted_drafts or {}))
                continue
            if req.prompt_logprobs_on_worker:
                merge_prompt_logprobs(req, num, plan.step_id, prompt_logprobs)
            num_computed = req.num_computed_tokens + num
            req.num_computed_tokens = num_computed
            tokens = req.all_token_ids
            if num_computed < len(tokens):  # a prefill chunk: nothing sampled yet
                if req.fork_into and num_computed == len(tokens) - 1:
                    self._fork(req)
                continue
            tok = sampled.get(req.seq_id)
            if tok is None:
                raise ValueError(f"step {plan.step_id}: no token for seq {req.seq_id}, which finished its prompt")
            reason = append_token(req, tok, max_model_len)
            if reason is not None:
                self._finish(req, reason)
            outputs.append(RequestOutput(req.request_id, req.index, [tok], reason, req.seq_id,
                                         constraint_failed(req)))
        return outputs

    def _update_drafted(self, req: Request, step_id: int, sampled: dict[int, int],
                        num_accepted_drafts: dict[int, int]) -> RequestOutput:
        """A drafting sequence's answer: its accepted drafts then its sampled token, each committed as a decode step
        commits one (what follows a stop is dropped); its KV is valid through its last accepted draft."""
        drafts, req.draft_token_ids = req.draft_token_ids, ()
        tok = sampled.get(req.seq_id)
        if tok is None:
            raise ValueError(f"step {step_id}: no token for seq {req.seq_id}, which drafted")
        n = num_accepted_drafts.get(req.seq_id, 0)
        self.spec.verified(req, len(drafts), n)
        req.num_computed_tokens += 1 + n
        new, reason = [], None
        for t in (*drafts[:n], tok):
            new.append(t)
            if (reason := append_token(req, t, self.config.max_model_len)) is not None:
                self._finish(req, reason)
                break
        return RequestOutput(req.request_id, req.index, new, reason, req.seq_id, constraint_failed(req))

    # -- metrics ------------------------------------------------------------------------------------------
    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    @property
    def num_policy_preemptions(self) -> int:
        return self.policy.num_preemptions

    @property
    def num_pending_tokens(self) -> int:
        """Tokens still to run here (handover.num_pending_tokens): the router's measure of a worker's load."""
        return handover.num_pending_tokens((*self.running, *self.waiting))

