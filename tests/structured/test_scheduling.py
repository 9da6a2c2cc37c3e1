"""Grammar state on the scheduler: one matcher per sample (n > 1), tokens consumed only as steps are committed (a
step lost with its worker never reaches the matcher), a whole match ends the sample, and a token outside its
bitmask is a wrong result naming the sequence."""

from __future__ import annotations

import re

from pagedserve_common.sampling import SamplingParams, StructuredOutput
from pagedserve_common.step import StepResult
from scheduler_svc.core.request import FinishReason, Request
from scheduler_svc.core.result_check import check_result
from scheduler_svc.structured import fill_bitmasks, token_allowed
from tests.support.grammar import VOCAB
from tests.support.scheduler import FakeWorker, make

PATTERN = "[a-c]{6}x"


class MaskedWorker(FakeWorker):
    """Samples, for each constrained sequence, the lowest token its bitmask allows (a one-character token); for
    the others, the fake's tokens."""

    def __init__(self) -> None:
        self.plan = None
        super().__init__(self._token)

    def _token(self, seq_id: int, position: int) -> int:
        mask = self.plan.token_bitmasks.get(seq_id)
        if mask is None:
            return 10_000 + position
        return min(t for t in range(VOCAB) if token_allowed(mask, t))

    def step(self, plan):
        self.plan = plan
        return super().step(plan)


def step(s, worker: MaskedWorker):
    """The engine's order: schedule -> bitmasks -> the worker's step -> update: (the step, what it sampled)."""
    scheduled = s.schedule()
    plan = scheduled.plan
    if due := scheduled.constrained_due():
        plan.token_bitmasks = dict(zip([r.seq_id for r in due], fill_bitmasks([r.constraint for r in due], VOCAB)))
    return scheduled, worker.step(plan)


def constrained(grammar, n: int = 1, prompt=range(3, 20)) -> Request:
    so = StructuredOutput("regex", PATTERN)
    r = Request("r", list(prompt), SamplingParams(max_tokens=20, n=n, temperature=0, structured_output=so))
    r.constraint = grammar.constraint()
    return r


def text(tokenizer, seq: Request) -> str:
    return tokenizer.decode(list(seq.output_token_ids))


def test_each_of_n_samples_has_its_own_matcher_and_ends_at_a_whole_match(compile_, tokenizer):
    g = compile_(StructuredOutput("regex", PATTERN))
    s, w = make(), MaskedWorker()
    r = constrained(g, n=3)
    s.add_request(r)
    while s.has_unfinished_requests():
        s.update(*step(s, w))
    assert len({id(c.constraint) for c in r.children} | {id(r.constraint)}) == 4
    for child in r.children:
        assert re.fullmatch(PATTERN, text(tokenizer, child)) and child.finish_reason is FinishReason.STOP
    assert s.num_constrained == 0


def test_a_step_lost_with_its_worker_is_never_consumed(compile_, tokenizer):
    g = compile_(StructuredOutput("regex", PATTERN))
    a, w = make(), MaskedWorker()
    r = constrained(g)
    a.add_request(r)
    while len(r.output_token_ids) < 2:
        a.update(*step(a, w))
    in_flight, _ = step(a, w)  # one more step, whose answer never comes
    mask_before = fill_bitmasks([r.constraint], VOCAB)[0]
    (moved,) = a.release_all(in_flight)  # the worker is lost mid-step: the step in flight is forgotten
    assert fill_bitmasks([moved.constraint], VOCAB)[0] == mask_before
    b, w2 = make(), MaskedWorker()
    b.adopt(moved)
    while b.has_unfinished_requests():
        b.update(*step(b, w2))
    assert re.fullmatch(PATTERN, text(tokenizer, r)) and r.finish_reason is FinishReason.STOP
    assert a.num_constrained == 0 and b.num_constrained == 0


def test_a_token_outside_its_bitmask_is_a_wrong_result_naming_the_sequence():
    mask = bytearray(VOCAB // 8)
    mask[0] = 0b100  # only token 2
    due = {5: None, 6: None}
    ok = check_result(1, StepResult(1, {5: 2, 6: 900}), due, VOCAB, bitmasks={5: bytes(mask)})
    assert ok is None
    wrong = check_result(1, StepResult(1, {5: 3, 6: 900}), due, VOCAB, bitmasks={5: bytes(mask)})
    assert wrong.seq_id == 5 and "token_bitmask" in wrong.message


def test_a_matcher_that_gives_up_marks_its_output_constraint_failed_not_a_plain_stop(compile_):
    """The engine then ends the request with an error (Engine.deliver): its text does not match its grammar, and a
    finish reason `stop` would say it does (a{1000000} answered "aaaa", stop)."""
    g = compile_(StructuredOutput("regex", PATTERN))
    s, w = make(), MaskedWorker()
    r = constrained(g)
    s.add_request(r)
    scheduled, sampled = step(s, w)
    (first,) = s.update(scheduled, sampled)
    assert (first.finish_reason, first.constraint_failed) == (None, False)
    r.constraint.failed = True  # as fill_bitmasks marks a matcher whose step ran out of work
    scheduled, sampled = step(s, w)
    (out,) = s.update(scheduled, sampled)
    assert (out.finish_reason, out.constraint_failed) == (FinishReason.STOP, True)
