"""A minimal in-process continuous-batching loop over one ModelRunner, for tests and benchmarks.

It allocates blocks with the scheduler's KVCacheManager and sends the runner real plans (new sequences whole,
running ones as deltas), with chunked prefill, prefix-cache hits, recompute preemption and forks. The real
scheduler (scheduler_svc) does the same over gRPC; this one exists so the worker can be driven alone.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from scheduler_svc.kv.manager import KVCacheManager
from worker_svc.plan import NewSeq, SeqDelta, StepPlan
from worker_svc.runner import ModelRunner
from worker_svc.sampling import SamplingOptions


@dataclass(slots=True)
class DriverSeq:
    seq_id: int
    tokens: list[int]
    num_prompt: int
    max_new_tokens: int
    sampling: SamplingOptions
    arrival_step: int = 0
    fork_into: int = 0  # extra copies forked off once the prompt (but its last token) is computed
    num_computed: int = 0
    on_worker: bool = False
    num_preemptions: int = 0
    children: list[int] = field(default_factory=list)

    @property
    def num_generated(self) -> int:
        return len(self.tokens) - self.num_prompt


class LocalDriver:
    def __init__(self, runner: ModelRunner, max_num_batched_tokens: int = 256, max_num_seqs: int = 64,
                 eos_token_ids: tuple[int, ...] | None = None, enable_prefix_caching: bool = True) -> None:
        self.runner = runner
        self.kv = KVCacheManager(runner.pool.num_blocks, runner.pool.layout.block_size, enable_prefix_caching)
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.eos_token_ids = set(runner.loaded.eos_token_ids if eos_token_ids is None else eos_token_ids)
        self.seqs: dict[int, DriverSeq] = {}
        self.waiting: list[int] = []
        self.running: list[int] = []
        self.step_id = 0
        self.num_preemptions = 0
        self.num_forks = 0
        self.num_copies = 0
        self._finished: list[int] = []  # told to the worker in the next plan

    def add(self, prompt: list[int], max_new_tokens: int, sampling: SamplingOptions | None = None,
            arrival_step: int = 0, fork_into: int = 0) -> int:
        seq_id = len(self.seqs)
        self.seqs[seq_id] = DriverSeq(seq_id, list(prompt), len(prompt), max_new_tokens,
                                      sampling or SamplingOptions(temperature=0.0), arrival_step, fork_into)
        self.waiting.append(seq_id)
        return seq_id

    def run(self, max_steps: int = 100_000) -> dict[int, list[int]]:
        """Runs until every sequence finished; returns each sequence's generated tokens."""
        while (self.waiting or self.running) and self.step_id < max_steps:
            self.step()
        return {i: s.tokens[s.num_prompt:] for i, s in self.seqs.items()}

    # -- one step -----------------------------------------------------------------------------------------
    def step(self) -> None:
        plan = StepPlan(self.step_id, finished_seq_ids=self._finished)
        self._finished = []
        budget = self.max_num_batched_tokens
        for seq_id in list(self.running):  # running first: decodes and unfinished prefills
            if seq_id not in self.running or budget <= 0:
                continue  # preempted below to make room for an earlier one
            s = self.seqs[seq_id]
            n = min(self._target(s) - s.num_computed, budget)
            alloc = self.kv.allocate(str(seq_id), s.num_computed + n, s.tokens)
            while alloc is None:
                if not self._preempt_last(plan, keep=seq_id):
                    raise RuntimeError(f"seq {seq_id} cannot fit in the KV pool even alone")
                alloc = self.kv.allocate(str(seq_id), s.num_computed + n, s.tokens)
            plan.copies.extend(alloc.copies)
            self.num_copies += len(alloc.copies)
            if s.on_worker:
                plan.running.append(SeqDelta(seq_id, list(alloc.new_block_ids), n))
            else:  # a fork's first step: its table (after copy-on-write) goes whole
                self._send_new(plan, s, n)
            budget -= n
        for seq_id in list(self.waiting):
            s = self.seqs[seq_id]
            if s.arrival_step > self.step_id:
                continue
            if len(self.running) >= self.max_num_seqs or budget <= 0:
                break
            hit = self.kv.lookup(s.tokens[:self._target(s)] if s.fork_into else s.tokens)
            n = min(self._target(s) - hit.num_tokens, budget)
            if self.kv.allocate(str(seq_id), hit.num_tokens + n, s.tokens, hit) is None:
                break  # no blocks: wait for running sequences to finish
            s.num_computed = hit.num_tokens
            self.waiting.remove(seq_id)
            self.running.append(seq_id)
            self._send_new(plan, s, n)
            budget -= n
        if not plan.new_seqs and not plan.running:
            self.step_id += 1
            return
        out = self.runner.step(plan)
        self.step_id += 1
        sampled = dict(zip(out.seq_ids, out.token_ids))
        for sched in [*plan.new_seqs, *plan.running]:
            s = self.seqs[sched.seq_id]
            s.num_computed += sched.num_scheduled_tokens
            if sched.seq_id in sampled:
                s.tokens.append(sampled[sched.seq_id])
                if s.num_generated >= s.max_new_tokens or s.tokens[-1] in self.eos_token_ids:
                    self.running.remove(s.seq_id)
                    self.kv.free(str(s.seq_id))
                    self._finished.append(s.seq_id)
            elif s.fork_into and s.num_computed == self._target(s):
                self._fork(s)

    @staticmethod
    def _target(s: DriverSeq) -> int:
        """Tokens to compute before sampling; a sequence to fork stops before its last prompt token."""
        return len(s.tokens) - 1 if s.fork_into else len(s.tokens)

    def _send_new(self, plan: StepPlan, s: DriverSeq, n: int) -> None:
        plan.new_seqs.append(NewSeq(s.seq_id, list(s.tokens), self.kv.block_table(str(s.seq_id)), s.num_computed,
                                    n, s.sampling))
        s.on_worker = True

    def _fork(self, parent: DriverSeq) -> None:
        """Parallel sampling: children share every computed block; each computes the last prompt token."""
        for _ in range(parent.fork_into):
            child_id = len(self.seqs)
            self.seqs[child_id] = DriverSeq(child_id, list(parent.tokens), parent.num_prompt,
                                            parent.max_new_tokens, parent.sampling, num_computed=parent.num_computed)
            self.kv.fork(str(parent.seq_id), str(child_id))
            self.running.append(child_id)
            parent.children.append(child_id)
            self.num_forks += 1
        parent.fork_into = 0

    def _preempt_last(self, plan: StepPlan, keep: int) -> bool:
        """Recompute preemption: the most recently admitted other sequence loses its blocks and waits."""
        victims = [r for r in self.running if r != keep]
        if not victims:
            return False
        victim = self.seqs[victims[-1]]
        self.running.remove(victim.seq_id)
        self.kv.free(str(victim.seq_id))
        plan.new_seqs = [n for n in plan.new_seqs if n.seq_id != victim.seq_id]
        plan.running = [d for d in plan.running if d.seq_id != victim.seq_id]
        if victim.on_worker:
            plan.preempted_seq_ids.append(victim.seq_id)
        victim.on_worker = False
        victim.num_computed = 0
        victim.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.insert(0, victim.seq_id)
        return True
