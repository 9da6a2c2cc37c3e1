"""Prompt logprobs on the scheduler (scheduler_svc.core.prompt_logprobs): no prefix hit over rows whose positions a
request lacks, each chunk's positions collected in order, none lost or delivered twice across preemptions (recompute
and swap), migrations and forks; and the check of a worker's prompt logprobs (result_check)."""

from __future__ import annotations

import random

import pytest

from pagedserve_common.step import PositionLogprobs, PromptLogprobs, StepResult, TokenLogprob
from pagedserve_common.wire import plan_to_pb, result_from_pb, result_to_pb
from scheduler_svc.core.prompt_logprobs import PromptDue, PromptLogprobsLog, due_rows
from scheduler_svc.core.request import Request, RequestStatus
from scheduler_svc.core.result_check import check_result
from scheduler_svc.core.scheduler import Scheduler
from tests.support.scheduler import FakeWorker, make, req, toks

VOCAB = 100_000


def fake_position(prefix: list[int], num_top: int) -> PositionLogprobs:
    """A position's logprobs as a model would give them: a function of the tokens up to it (its last one is the
    prompt token), so that a recomputation gives the same values. NOTE: multiples of 1/64, which float32 holds
    exactly: the answers go through the wire."""
    h = hash(tuple(prefix))
    return PositionLogprobs(TokenLogprob(prefix[-1], -(h % 997) / 64), tuple(TokenLogprob(t, -t / 64)
                                                                            for t in range(num_top)), 1 + h % 50)


def expected(prompt: list[int], num_top: int) -> list[PositionLogprobs]:
    return [fake_position(prompt[:p + 1], num_top) for p in range(1, len(prompt))]


class PromptWorker(FakeWorker):
    """A FakeWorker that also answers prompt logprobs, as the real one does: for every sequence it holds with
    prompt_logprobs in its sampling, the positions its scheduled prompt rows give (worker_svc.prompt_logprobs)."""

    def __init__(self) -> None:
        super().__init__()
        self.prompt: dict[int, tuple[int, int | None]] = {}  # seq_id -> (num_prompt_tokens, prompt_logprobs)

    def answer(self, plan) -> StepResult:
        for seq_id in [*plan.finished_seq_ids, *plan.preempted_seq_ids]:
            self.prompt.pop(seq_id, None)
        rows = {}
        for p in plan.new_seqs:
            self.prompt[p.seq_id] = (p.num_prompt_tokens, p.sampling.prompt_logprobs)
            rows[p.seq_id] = (p.num_computed_tokens, p.num_scheduled_tokens, list(p.token_ids))
        for r in plan.running:
            s = self.seqs[r.seq_id]
            rows[r.seq_id] = (s["computed"], r.num_scheduled_tokens, list(s["tokens"]))
        out = {}
        for seq_id, (computed, num, tokens) in rows.items():
            num_prompt, num_top = self.prompt[seq_id]
            first, count = due_rows(num_prompt, computed, num)
            if num_top is not None and count:
                out[seq_id] = PromptLogprobs(first + 1, tuple(fake_position(tokens[:p + 1], num_top)
                                                              for p in range(first + 1, first + 1 + count)))
        sampled = self.step(plan)
        # NOTE: through the wire, as a real answer comes
        return result_from_pb(result_to_pb(StepResult(plan.step_id, sampled, prompt_logprobs=out)))


def run_step(s: Scheduler, w: PromptWorker):
    step = s.schedule()
    plan = step.plan
    plan_to_pb(plan)
    result = w.answer(plan)
    wrong = check_result(plan.step_id, result, step.due_samples(), VOCAB, prompt_due=step.prompt_logprobs_due())
    assert wrong is None, wrong.message
    return plan, s.update(step, result.sampled, result.num_accepted_drafts, result.prompt_logprobs)


def run(s: Scheduler, w: PromptWorker, max_steps: int = 1000) -> list:
    plans = []
    while s.has_unfinished_requests() and len(plans) < max_steps:
        plans.append(run_step(s, w)[0])
    assert not s.has_unfinished_requests()
    return plans


def test_the_log_holds_each_position_once_in_order_and_refuses_a_gap():
    log = PromptLogprobsLog(6)
    assert (log.next_position, log.complete, log.max_hit_tokens(), log.for_client()) == (1, False, 0, [None] * 6)
    a, b, c, d, e = (fake_position([i], 0) for i in range(5))
    assert log.merge(PromptLogprobs(1, (a, b))) == 2
    assert log.merge(PromptLogprobs(1, (a, b, c))) == 1  # a recomputation: only position 3 is new
    with pytest.raises(ValueError, match="from position 5, but position 4 is the next one missing"):
        log.merge(PromptLogprobs(5, (e,)))
    with pytest.raises(ValueError, match="up to position 6 of a prompt of 6 tokens"):
        log.merge(PromptLogprobs(4, (d, e, e)))
    assert log.merge(PromptLogprobs(4, (d, e))) == 2 and log.complete and log.max_hit_tokens() == 5
    assert log.for_client() == [None, a, b, c, d, e]
    assert PromptLogprobsLog(1).complete and PromptLogprobsLog(1).for_client() == [None]  # one token: nothing to do
    assert due_rows(10, 0, 4) == (0, 4) and due_rows(10, 8, 4) == (8, 1) and due_rows(10, 9, 1) == (9, 0)


def test_no_prefix_hit_for_a_request_that_asks_but_it_fills_the_cache():
    s, w = make(), PromptWorker()
    prompt = toks(0, 20)
    s.add_request(req("plain", prompt))
    run(s, w)
    b = req("b", prompt, prompt_logprobs=2)
    s.add_request(b)
    plan, _ = run_step(s, w)
    assert (plan.new_seqs[0].num_computed_tokens, plan.new_seqs[0].sampling.prompt_logprobs) == (0, 2)
    assert b.num_cached_prompt_tokens == 0
    run(s, w)
    assert b.prompt_log.positions == expected(prompt, 2)
    c = req("c", prompt + [7])  # a plain request still hits what b computed
    s.add_request(c)
    assert s.schedule().plan.new_seqs[0].num_computed_tokens == 16 and c.num_cached_prompt_tokens == 16


def test_chunks_of_a_chunked_prefill_are_collected_in_order_before_the_first_token():
    s, w = make(max_num_batched_tokens=8), PromptWorker()
    prompt = toks(100, 30)
    a = req("a", prompt, max_tokens=3, prompt_logprobs=0)
    s.add_request(a)
    firsts, outputs = [], []
    while s.has_unfinished_requests():
        step = s.schedule()
        plan = step.plan
        firsts.append({k: (v.first_position, len(v.token_ids)) for k, v in step.prompt_logprobs_due().items()})
        result = w.answer(plan)
        assert check_result(plan.step_id, result, step.due_samples(), VOCAB,
                            prompt_due=step.prompt_logprobs_due()) is None
        out = s.update(step, result.sampled, None, result.prompt_logprobs)
        if out:
            assert a.prompt_log.complete  # the first token comes after the last prompt position
            outputs += out
    assert firsts[:5] == [{0: (1, 8)}, {0: (9, 8)}, {0: (17, 8)}, {0: (25, 5)}, {}]  # row 29 samples, gives none
    assert a.prompt_log.positions == expected(prompt, 0) and len(outputs) == 3


@pytest.mark.parametrize("num_cpu_blocks", [0, 8], ids=["recompute", "swap"])
def test_preemption_neither_loses_nor_repeats_a_position(num_cpu_blocks):
    """b is admitted after a and preempted when a's decode needs its blocks, mid-prefill and again after it; each
    time it comes back its hit stops at the positions it has (recompute), and its log ends exact."""
    s = make(num_blocks=6, max_num_batched_tokens=5, num_cpu_blocks=num_cpu_blocks, max_model_len=64)
    w = PromptWorker()
    a, b = req("a", toks(0, 16), max_tokens=24), req("b", toks(0, 8) + toks(500, 20), max_tokens=4, prompt_logprobs=3)
    s.add_request(a)
    s.add_request(b)
    readmissions = []  # (tokens computed at (re)admission, positions it had then, prompt_logprobs sent)
    while s.has_unfinished_requests():
        had = len(b.prompt_log.positions)
        plan, _ = run_step(s, w)
        readmissions += [(n.num_computed_tokens, had, n.sampling.prompt_logprobs) for n in plan.new_seqs
                         if n.seq_id == b.seq_id]
    assert b.num_preemptions >= 1 and readmissions[0] == (0, 0, 3)
    if not num_cpu_blocks:
        # mid-prefill: the cache holds 24 of its tokens and more, it has 24 positions: a hit of 24, not more
        assert readmissions[1] == (24, 24, 3)
        assert readmissions[2][1:] == (27, None) and readmissions[2][0] > 0  # complete: a hit, nothing asked again
    for num_computed, had, sent in readmissions:
        if sent is None:
            assert had == len(b.prompt_token_ids) - 1  # complete: none asked again
        elif not num_cpu_blocks:  # NOTE: a swap-in restores its own computed KV: those rows ran
            assert num_computed <= had
    assert b.prompt_log.positions == expected(list(b.prompt_token_ids), 3)
    assert b.status is RequestStatus.FINISHED and len(b.output_token_ids) == 4


def test_a_migrated_request_keeps_its_positions_and_gets_only_the_missing_ones():
    old, w = make(max_num_batched_tokens=8), PromptWorker()
    prompt = toks(0, 30)
    b = req("b", prompt, prompt_logprobs=1)
    old.add_request(b)
    run_step(old, w)  # rows 0 .. 7: positions 1 .. 8
    run_step(old, w)  # rows 8 .. 15: positions 9 .. 16
    in_flight = old.schedule()  # rows 16 .. 23 in flight when the worker is lost: their answer never comes
    assert len(b.prompt_log.positions) == 16
    new, w2 = make(max_num_batched_tokens=64), PromptWorker()
    new.add_request(req("warm", prompt))  # the new worker's cache holds the whole prompt
    run(new, w2)
    (moved,) = old.release_all(in_flight)
    new.adopt(moved)
    plan, _ = run_step(new, w2)
    # a hit up to what it has (16 positions: rows 0 .. 15, two whole blocks), the rest computed again
    assert [(n.num_computed_tokens, n.num_scheduled_tokens) for n in plan.new_seqs] == [(16, 14)]
    run(new, w2)
    assert b.prompt_log.positions == expected(prompt, 1)


def test_a_forks_samples_share_the_parents_positions_and_compute_none():
    s, w = make(max_num_batched_tokens=8), PromptWorker()
    prompt = toks(0, 19)
    a = req("a", prompt, n=3, temperature=1.0, prompt_logprobs=2)
    s.add_request(a)
    plans = run(s, w)
    children = [n for p in plans for n in p.new_seqs if n.seq_id != a.seq_id]
    assert len(children) == 3 and all(n.sampling.prompt_logprobs is None for n in children)
    assert all(c.prompt_log is a.prompt_log for c in a.children)
    assert a.prompt_log.positions == expected(prompt, 2)


def test_random_workloads_deliver_every_position_exactly_once():
    """Arrivals, aborts, a pool small enough to preempt (recompute) and shared prefixes: every request that got a
    token has its exact log."""
    rng = random.Random(5)
    for num_cpu_blocks in (0, 6):
        s, w = make(num_blocks=14, max_num_batched_tokens=10, num_cpu_blocks=num_cpu_blocks), PromptWorker()
        reqs: list[Request] = []
        for step in range(600):
            if len(reqs) < 24 and rng.random() < 0.3:
                prompt = toks(0, rng.randint(1, 20)) + toks(1000 * len(reqs), rng.randint(1, 25))
                r = Request(f"r{len(reqs)}", prompt, req("x", [1], max_tokens=rng.randint(1, 12),
                                                         n=rng.choice((1, 1, 2)), temperature=1.0,
                                                         prompt_logprobs=rng.choice((None, 0, 2))).sampling)
                try:
                    s.add_request(r)
                    reqs.append(r)
                except ValueError:
                    pass
            if reqs and rng.random() < 0.02:
                s.abort(rng.choice(reqs).request_id)
            if s.has_unfinished_requests():
                run_step(s, w)
        run(s, w)
        assert s.num_preemptions > 0
        for r in reqs:
            if r.prompt_log is None:
                continue
            if r.output_token_ids or any(c.output_token_ids for c in r.children):
                assert r.prompt_log.positions == expected(list(r.prompt_token_ids), r.sampling.prompt_logprobs)
            else:  # aborted early: what it has is a prefix of the exact log, never a gap
                assert r.prompt_log.positions == expected(list(r.prompt_token_ids),
                                                          r.sampling.prompt_logprobs)[:len(r.prompt_log.positions)]


def test_update_refuses_a_step_without_the_due_positions():
    s, w = make(), PromptWorker()
    s.add_request(req("a", toks(0, 10), prompt_logprobs=0))
    step = s.schedule()
    result = w.answer(step.plan)
    with pytest.raises(ValueError, match="no prompt logprobs for seq 0, whose prompt rows ran"):
        s.update(step, result.sampled, None, {})


DUE = {3: PromptDue(5, (50, 51), 2)}


def chunk(first: int = 5, tokens=(50, 51), rank: int = 1, top=((7, -0.1), (8, -0.2))) -> StepResult:
    positions = tuple(PositionLogprobs(TokenLogprob(t, -1.0), tuple(TokenLogprob(i, v) for i, v in top), rank)
                      for t in tokens)
    return StepResult(7, prompt_logprobs={3: PromptLogprobs(first, positions)})


def wrong(result: StepResult, due=DUE) -> str | None:
    found = check_result(7, result, {}, VOCAB, prompt_due=due)
    return None if found is None else found.message


def test_result_check_holds_prompt_logprobs_to_the_plan():
    assert wrong(chunk()) is None
    assert wrong(StepResult(7), DUE) == "prompt_logprobs: none for seq 3, whose prompt rows ran (1 missing)"
    assert wrong(chunk(), {}) == "prompt_logprobs for seq 3, which has no prompt rows due (1 extra)"
    assert wrong(chunk(first=6)) == "prompt_logprobs of seq 3: positions 6 .. 7, but 5 .. 6 ran"
    assert wrong(chunk(tokens=(50,))) == "prompt_logprobs of seq 3: positions 5 .. 5, but 5 .. 6 ran"
    assert wrong(chunk(tokens=(50, 52))) == \
        "prompt_logprobs of seq 3 at position 6: sampled.token_id 52 is not the prompt token 51"
    assert wrong(chunk(rank=0)) == "prompt_logprobs of seq 3 at position 5: rank 0 is outside 1 .. 100000"
    assert wrong(chunk(top=((7, -0.1), (8, -0.2), (9, -0.3)))) == \
        "prompt_logprobs of seq 3 at position 5: top has 3 entries; 2 were asked for"
    assert wrong(chunk(top=((7, 0.5),))) == \
        "prompt_logprobs of seq 3 at position 5: top.logprob 0.5 of token 7 is not a finite value <= 0"
    assert check_result(7, chunk(tokens=(50, 52)), {}, VOCAB, prompt_due=DUE).seq_id == 3  # its own entry: blamed
