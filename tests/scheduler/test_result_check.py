"""Spec tests for the check of a worker's answer (scheduler_svc.core.result_check): one test per rule, and which
sequences the scheduler expects a token from (ScheduledStep.due_samples)."""

import itertools
import math
import random

import pytest

from pagedserve_common.step import PositionLogprobs, StepResult, TokenLogprob
from scheduler_svc.core.result_check import check_result
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.scheduler import Scheduler
from tests.support.scheduler import FakeWorker, drive, make, req, toks

VOCAB = 100
DUE = {1: None, 2: 3}  # seq 1 asked for no logprobs, seq 2 for the top 3


def lp(token: int, logprob: float = -0.5, top=((4, -0.1), (5, -1.0))) -> PositionLogprobs:
    return PositionLogprobs(TokenLogprob(token, logprob), tuple(TokenLogprob(t, v) for t, v in top))


def answer(sampled=None, logprobs=None, step_id: int = 7) -> StepResult:
    sampled = {1: 10, 2: 20} if sampled is None else sampled
    return StepResult(step_id, sampled, {2: lp(20)} if logprobs is None else logprobs)


def check(result: StepResult, due=DUE) -> str | None:
    wrong = check_result(7, result, due, VOCAB)
    return None if wrong is None else wrong.message


def blamed(result: StepResult, due=DUE) -> int | None:
    """The sequence the check blames: the one whose own entry is wrong (None when the answer as a whole is)."""
    return check_result(7, result, due, VOCAB).seq_id


def test_a_well_formed_answer_passes():
    assert check(answer()) is None
    assert check(StepResult(7), {}) is None  # a step of prefill chunks only samples nothing
    assert check(answer({1: 0, 2: VOCAB - 1}, {2: lp(VOCAB - 1, 0.0, ())})) is None  # both ends of the vocabulary


def test_the_step_id_must_be_the_plans():
    assert check(answer(step_id=8)) == "step_id 8 answers plan 7"
    assert blamed(answer(step_id=8)) is None  # the answer as a whole: no request is charged for it


@pytest.mark.parametrize("idle", [-1e308, -0.001, math.nan, math.inf, 3600.5])
def test_idle_seconds_must_be_a_wait_an_honest_worker_could_have_had(idle):
    """It is a metric's observation: -1e308 from a worker turned the histogram's sum into -Inf (issue 50)."""
    wrong = StepResult(7, {1: 10, 2: 20}, {2: lp(20)}, idle_seconds=idle)
    assert check(wrong) == f"idle_seconds {idle!r} is not in [0, 3600]"
    for fine in (0.0, 0.25, 3600.0):
        assert check(StepResult(7, {1: 10, 2: 20}, {2: lp(20)}, idle_seconds=fine)) is None


def test_a_token_outside_a_sequences_allowed_token_ids_is_its_wrong_token():
    allowed = {1: (3, 10, 42), 2: (20,)}
    assert check_result(7, answer(), DUE, VOCAB, allowed=allowed) is None
    wrong = check_result(7, answer({1: 11, 2: 20}), DUE, VOCAB, allowed=allowed)
    assert (wrong.message, wrong.seq_id) == ("token_id 11 of seq 1 is not in its allowed_token_ids", 1)
    wrong = check_result(7, answer({1: 43, 2: 20}), DUE, VOCAB, allowed=allowed)  # past the last id
    assert wrong.seq_id == 1


def test_every_due_sequence_must_have_a_token():
    assert check(answer({2: 20})) == "tokens: no token for seq 1, which samples this step (1 missing)"
    assert blamed(answer({2: 20})) is None


def test_no_other_sequence_may_have_one():
    assert check(answer({1: 10, 2: 20, 3: 30})) == \
        "tokens: a token for seq 3, which does not sample this step (1 extra)"
    # the same number of tokens, for the wrong sequence
    assert check(answer({1: 10, 3: 30})).startswith("tokens: no token for seq 2")


@pytest.mark.parametrize("bad", [VOCAB, 2**32 - 1, -1])
def test_token_ids_must_be_in_the_vocabulary(bad):
    assert check(answer({1: bad, 2: 20})) == f"token_id {bad} of seq 1 is outside the vocabulary (0 .. {VOCAB - 1})"
    assert blamed(answer({1: bad, 2: 20})) == 1  # its own entry: seq 1's request is charged a migration


def test_logprobs_only_for_sequences_that_asked():
    assert check(answer(logprobs={1: lp(10), 2: lp(20)})) == "logprobs for seq 1, which asked for none"


def test_a_sequence_that_asked_gets_them():
    assert check(answer(logprobs={})) == "logprobs: none for seq 2, which asked for them"


def test_the_sampled_entry_is_the_sampled_token():
    assert check(answer(logprobs={2: lp(21)})) == \
        "logprobs of seq 2: sampled.token_id 21 is not the sampled token 20"
    assert blamed(answer(logprobs={2: lp(21)})) == 2


def test_at_most_the_asked_number_of_top_entries():
    four = ((1, -1.0), (2, -2.0), (3, -3.0), (4, -4.0))
    assert check(answer(logprobs={2: lp(20, top=four)})) == "logprobs of seq 2: top has 4 entries; 3 were asked for"
    assert check(answer(logprobs={2: lp(20, top=four[:3])})) is None


def test_top_token_ids_must_be_in_the_vocabulary():
    assert check(answer(logprobs={2: lp(20, top=((4, -0.1), (2**32 - 1, -1.0)))})) == \
        f"logprobs of seq 2: top.token_id 4294967295 is outside the vocabulary (0 .. {VOCAB - 1})"


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, 0.5])
def test_logprobs_must_be_finite_and_at_most_zero(bad):
    assert check(answer(logprobs={2: lp(20, bad)})) == \
        f"logprobs of seq 2: sampled.logprob {bad!r} of token 20 is not a finite value <= 0"
    assert check(answer(logprobs={2: lp(20, top=((4, bad),))})).startswith("logprobs of seq 2: top.logprob")


def test_rounding_just_above_zero_is_allowed():
    assert check(answer(logprobs={2: lp(20, 1e-6, ((4, 1e-6),))})) is None


# -- which sequences sample: the scheduler's side ------------------------------------------------------------------
def test_due_samples_are_the_sequences_reaching_the_end_of_their_known_tokens():
    s, w = make(max_num_batched_tokens=12), FakeWorker()
    s.add_request(req("short", toks(0, 4), logprobs=2))
    s.add_request(req("long", toks(100, 19)))  # 8 of its 19 prompt tokens fit the first step: mid prefill
    step = s.schedule()
    plan = step.plan
    assert step.due_samples() == {plan.new_seqs[0].seq_id: 2}
    s.update(step, w.step(plan))
    step = s.schedule()  # short decodes; long computes the 11 left of its prompt: it samples too
    plan = step.plan
    assert step.due_samples() == {plan.running[0].seq_id: 2, plan.running[1].seq_id: None}
    s.update(step, w.step(plan))


def test_a_fork_parent_samples_nothing_its_children_do():
    s, w = make(), FakeWorker()
    s.add_request(req("n2", toks(0, 10), n=2))
    step = s.schedule()  # the parent computes all but the last prompt token, then forks
    assert step.due_samples() == {}
    s.update(step, w.step(step.plan))
    step = s.schedule()
    plan = step.plan
    assert step.due_samples() == {c.seq_id: None for c in plan.new_seqs} and len(plan.new_seqs) == 2


def test_due_samples_are_what_a_worker_samples_through_chunks_forks_and_preemptions():
    rng = random.Random(0)
    s, w = make(num_blocks=12, max_num_batched_tokens=16, max_num_seqs=4), FakeWorker()
    for i in range(12):
        s.add_request(req(f"r{i}", toks(50 * i, rng.randint(1, 40)), max_tokens=rng.randint(1, 24),
                          n=rng.choice((1, 1, 2))))
    while s.has_unfinished_requests():
        step = s.schedule()
        due, sampled = step.due_samples(), w.step(step.plan)
        assert sampled.keys() == due.keys()
        s.update(step, sampled)
    assert s.num_preemptions > 0  # the pool was tight enough to preempt


def test_a_stop_id_before_min_tokens_is_a_wrong_token_of_its_sequence():
    banned = {1: frozenset({10, 11})}
    wrong = check_result(7, answer(), DUE, VOCAB, banned=banned)
    assert (wrong.message, wrong.seq_id) == ("token_id 10 of seq 1 is a stop id before its min_tokens", 1)
    assert check_result(7, answer({1: 12, 2: 20}), DUE, VOCAB, banned=banned) is None


def test_banned_samples_are_the_sampling_sequences_short_of_min_tokens():
    s = make(eos_token_ids=(0,))
    a = req("a", toks(1, 3), max_tokens=6, min_tokens=2, stop_token_ids=(9,))
    b = req("b", toks(1, 3), max_tokens=6)
    c = req("c", toks(1, 3), max_tokens=6, min_tokens=2, ignore_eos=True)
    for r in (a, b, c):
        s.add_request(r)
    w = FakeWorker(lambda seq_id, position: 50)
    step = s.schedule()
    plan = step.plan
    assert step.banned_samples() == {a.seq_id: frozenset({0, 9})}  # c: no stop id at all
    # the worker is told the scheduler's EOS among the ids it masks until min_tokens
    assert [p.sampling.stop_token_ids for p in plan.new_seqs] == [(0, 9), (), ()]
    s.update(step, w.step(plan))
    step = s.schedule()
    assert step.banned_samples() == {a.seq_id: frozenset({0, 9})}  # one output: still short of 2


def test_allowed_samples_are_the_sampling_sequences_with_an_allow_list():
    s = make(max_num_batched_tokens=6)
    a = req("a", toks(1, 3), max_tokens=6, allowed_token_ids=(5, 50))
    b = req("b", toks(1, 1), max_tokens=6)  # no list
    c = req("c", toks(1, 4), max_tokens=6, allowed_token_ids=(7,))  # a chunk of its prompt only: samples nothing
    for r in (a, b, c):
        s.add_request(r)
    w = FakeWorker(lambda seq_id, position: 50)
    step = s.schedule()
    assert step.allowed_samples() == {a.seq_id: (5, 50)}
    s.update(step, w.step(step.plan))
    step = s.schedule()
    assert step.allowed_samples() == {a.seq_id: (5, 50), c.seq_id: (7,)}


def test_the_scheduler_ends_no_sample_on_a_stop_id_before_min_tokens():
    s = make(eos_token_ids=(0,))
    a = req("a", toks(1, 3), max_tokens=6, min_tokens=3)
    s.add_request(a)
    drive(s, FakeWorker(lambda seq_id, position: 0))  # a worker that samples EOS every time
    assert list(a.output_token_ids) == [0, 0, 0, 0]  # the fourth EOS (after 3 outputs) ends it


def test_banned_samples_follow_a_request_that_migrates_with_min_tokens():
    ids = itertools.count()
    lost, survivor = (Scheduler(SchedulerConfig(num_blocks=64, max_model_len=256, block_size=8,
                                                eos_token_ids=(0,)), seq_ids=ids) for _ in range(2))
    a = req("a", toks(1, 3), max_tokens=6, min_tokens=4)
    lost.add_request(a)
    w = FakeWorker(lambda seq_id, position: 50)
    step = lost.schedule()
    lost.update(step, w.step(step.plan))
    for r in lost.release_all():
        survivor.adopt(r)
    assert not lost.min_tokens_request_ids  # released with its requests
    assert survivor.schedule().banned_samples() == {a.seq_id: frozenset({0})}
