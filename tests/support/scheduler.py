"""Helpers for scheduler tests: a fake worker that checks the delta protocol and models KV memory, requests, and
loops that drive a Scheduler through it (tests/scheduler/test_scheduler.py, test_static_alloc.py, test_migration.py)."""

from __future__ import annotations

from pagedserve_common.sampling import SamplingParams
from pagedserve_common.step import StepPlan
from pagedserve_common.wire import plan_to_pb
from scheduler_svc.core.request import Request
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.scheduler import Scheduler

BS = 8
# the scheduling policy make() and config() default to: tests/scheduler/conftest.py runs the scheduler's own tests
# under each one (a single tenant and priority 0 admit in arrival order under all three)
DEFAULT_POLICY = "fcfs"


def config(num_blocks: int = 64, max_model_len: int = 256, **kw) -> SchedulerConfig:
    kw.setdefault("scheduling_policy", DEFAULT_POLICY)
    kw.setdefault("block_size", BS)
    return SchedulerConfig(num_blocks=num_blocks, max_model_len=max_model_len, **kw)


def make(num_blocks: int = 64, max_model_len: int = 256, **kw) -> Scheduler:
    return Scheduler(config(num_blocks, max_model_len, **kw))


def req(rid: str, prompt: list[int], max_tokens: int = 4, **kw) -> Request:
    return Request(rid, prompt, SamplingParams(max_tokens=max_tokens, **kw))


def toks(start: int, n: int) -> list[int]:
    return list(range(start, start + n))


def position_token(seq_id: int, position: int) -> int:
    return 10_000 + 1000 * seq_id + position


class FakeWorker:
    """Holds what a real worker would (tokens, computed count, block table) and checks the delta protocol.

    It also models KV memory: each slot holds the token prefix its K/V depends on, moved by swaps and copies
    like the real pool, so a wrong prefix hit, copy or swap shows up as a sequence that cannot read itself back.
    Drafts (speculative decoding) are computed like known tokens, then accepted while each is the token next_token
    gives for its position (`num_accepted`: the last step's counts), as a greedy worker verifies them.
    KV groups (`group_windows`, as SchedulerConfig.kv_group_windows): a table's entries i * num_groups + g are group
    g's blocks; every group's slot is written, and a sliding group's (window w) is read back only from the window
    of the step's first query on (start - w + 1), as the attention backends read it.
    """

    def __init__(self, next_token=position_token, block_size: int = BS, group_windows: tuple[int, ...] = (0,)) -> None:
        self.next_token, self.block_size, self.group_windows = next_token, block_size, group_windows
        self.seqs: dict[int, dict] = {}
        self.kv: dict[tuple[int, int], tuple[int, ...]] = {}  # (device block, slot) -> prefix
        self.cpu: dict[tuple[int, int], tuple[int, ...]] = {}  # (cpu block, slot) -> prefix
        self.num_accepted: dict[int, int] = {}  # the last step's: seq_id -> drafts accepted (absent: none)

    def _move(self, src_mem: dict, dst_mem: dict, pairs) -> None:
        for src, dst in pairs:
            for slot in range(self.block_size):
                if (src, slot) in src_mem:
                    dst_mem[(dst, slot)] = src_mem[(src, slot)]
                else:
                    dst_mem.pop((dst, slot), None)

    def _kv_value(self, group: int, prefix: list[int]) -> tuple:
        """What a slot of `group` holds for a token: the prefix its K/V depends on (and its group, with several)."""
        return tuple(prefix) if len(self.group_windows) == 1 else (group, tuple(prefix))

    def step(self, plan: StepPlan) -> dict[int, int]:
        for seq_id in [*plan.finished_seq_ids, *plan.preempted_seq_ids]:
            del self.seqs[seq_id]  # NOTE: KeyError = told to drop a sequence it never had
        # NOTE: the real worker's order: swap out, swap in, copy-on-write copies, then the forward.
        self._move(self.kv, self.cpu, plan.swap_out)
        self._move(self.cpu, self.kv, plan.swap_in)
        self._move(dict(self.kv), self.kv, plan.copies)
        sampled, bs, ng = {}, self.block_size, len(self.group_windows)
        starts = {}
        for p in plan.new_seqs:
            assert p.seq_id not in self.seqs, f"seq {p.seq_id} sent whole while the worker holds it"
            assert len(p.block_ids) // ng * bs >= p.num_computed_tokens + p.num_scheduled_tokens
            self.seqs[p.seq_id] = dict(tokens=list(p.token_ids), blocks=list(p.block_ids),
                                       computed=p.num_computed_tokens, scheduled=p.num_scheduled_tokens)
        for r in plan.running:
            s = self.seqs[r.seq_id]  # NOTE: KeyError = a delta for a sequence the worker does not hold
            s["blocks"] += r.new_block_ids
            s["scheduled"] = r.num_scheduled_tokens
            assert r.num_scheduled_tokens == 1 + len(r.draft_token_ids) or not r.draft_token_ids
            s["tokens"] += r.draft_token_ids
            s["drafts"] = len(r.draft_token_ids)
        for p in [*plan.new_seqs, *plan.running]:
            s = self.seqs[p.seq_id]
            start, end, tokens, blocks = s["computed"], s["computed"] + s["scheduled"], s["tokens"], s["blocks"]
            assert len(blocks) // ng * bs >= end
            for pos in range(start, end):  # the forward writes this step's K/V
                for g in range(ng):
                    self.kv[(blocks[pos // bs * ng + g], pos % bs)] = self._kv_value(g, tokens[:pos + 1])
            s["computed"], starts[p.seq_id] = end, start
        self.num_accepted = {}
        for p in plan.running:  # drafts: kept while each is what the model gives, the KV valid up to the last kept
            s = self.seqs[p.seq_id]
            if k := s.pop("drafts", 0):
                tokens, n = s["tokens"], 0
                while n < k and tokens[len(tokens) - k + n] == self.next_token(p.seq_id, len(tokens) - k + n):
                    n += 1
                del tokens[len(tokens) - k + n:]
                s["computed"] -= k - n
                if n:
                    self.num_accepted[p.seq_id] = n
        for p in [*plan.new_seqs, *plan.running]:  # every context read back whole: hits, copies and swaps were right
            s = self.seqs[p.seq_id]
            tokens, blocks = s["tokens"], s["blocks"]
            for g, window in enumerate(self.group_windows):
                for pos in range(max(0, starts[p.seq_id] - window + 1) if window else 0, s["computed"]):
                    assert self.kv.get((blocks[pos // bs * ng + g], pos % bs)) == self._kv_value(g, tokens[:pos + 1]), \
                        (p.seq_id, g, pos)
            if s["computed"] == len(tokens):
                tok = self.next_token(p.seq_id, len(tokens))
                tokens.append(tok)
                sampled[p.seq_id] = tok
        return sampled


def drive(s: Scheduler, worker: FakeWorker | None = None, max_steps: int = 1000) -> list[StepPlan]:
    worker = worker or FakeWorker()
    plans = []
    while s.has_unfinished_requests() and len(plans) < max_steps:
        scheduled = s.schedule()
        plans.append(scheduled.plan)
        s.update(scheduled, worker.step(scheduled.plan), worker.num_accepted)
    assert not s.has_unfinished_requests()
    return plans


def step(s: Scheduler, worker: FakeWorker) -> tuple[StepPlan, list]:
    scheduled = s.schedule()
    return scheduled.plan, s.update(scheduled, worker.step(scheduled.plan), worker.num_accepted)



def random_steps(s: Scheduler, rng, new_request, num_iterations: int, check) -> tuple[FakeWorker, list[Request]]:
    """Drives `s` with random arrivals (up to 20, from new_request(i); those that never fit are skipped) and
    aborts, a step at a time, calling check(worker) after each; returns the worker and the requests added."""
    w = FakeWorker(lambda seq_id, position: rng.randrange(3, 40), group_windows=s.config.kv_group_windows)
    reqs = []
    for _ in range(num_iterations):
        if len(reqs) < 20 and rng.random() < 0.3:
            r = new_request(len(reqs))
            try:
                s.add_request(r)
                reqs.append(r)
            except ValueError:
                pass  # too big for this pool
        if reqs and rng.random() < 0.03:
            s.abort(rng.choice(reqs).request_id)
        scheduled = s.schedule()
        if scheduled is None:
            if len(reqs) >= 20:
                break
            continue
        plan_to_pb(scheduled.plan)
        s.update(scheduled, w.step(scheduled.plan), w.num_accepted)
        check(w)
    return w, reqs


