"""Moving requests between workers' schedulers: release_all (a lost worker), take_queued (a leaving one), adopt."""

from __future__ import annotations

import itertools

from scheduler_svc.core.request import FinishReason, RequestStatus
from scheduler_svc.core.scheduler import Scheduler
from tests.support.scheduler import FakeWorker, config, drive, req, step, toks


def by_position(seq_id: int, position: int) -> int:
    """A token that depends on the position only: a recomputed sequence samples what it would have."""
    return 500 + position


def pair(num_blocks: int = 16) -> tuple[Scheduler, Scheduler]:
    ids = itertools.count()
    return tuple(Scheduler(config(num_blocks=num_blocks, max_model_len=256), seq_ids=ids)
                 for _ in range(2))


def test_release_all_mid_step_frees_every_block_and_adopt_continues_from_the_streamed_tokens():
    lost, survivor = pair()
    a, b, c = req("a", toks(0, 10), max_tokens=5), req("b", toks(50, 3), max_tokens=5), req("c", toks(90, 4))
    for r in (a, b, c):
        lost.add_request(r)
    worker = FakeWorker(by_position)
    step(lost, worker)
    step(lost, worker)
    assert (list(a.output_token_ids), list(b.output_token_ids)) == ([510, 511], [503, 504])
    in_flight = lost.schedule()  # the worker dies with this step in flight
    assert in_flight.request_ids() == {"a", "b", "c"}
    released = lost.release_all(in_flight)
    assert [r.request_id for r in released] == ["a", "b", "c"]  # oldest first
    assert lost.kv.pool.num_free_blocks == 16 and not lost.has_unfinished_requests()
    assert lost.schedule() is None  # nothing in flight, nothing to run
    old_ids = {s.seq_id for s in in_flight.plan.new_seqs} | {s.seq_id for s in in_flight.plan.running}
    for r in released:
        survivor.adopt(r)
    scheduled = survivor.schedule()
    plan = scheduled.plan
    assert [(s.token_ids, s.num_computed_tokens, s.num_scheduled_tokens) for s in plan.new_seqs] == [
        (toks(0, 10) + [510, 511], 0, 12), (toks(50, 3) + [503, 504], 0, 5), (toks(90, 4) + [504, 505], 0, 6)]
    assert not {s.seq_id for s in plan.new_seqs} & old_ids  # fresh sequence ids
    other = FakeWorker(by_position)
    survivor.update(scheduled, other.step(plan))
    drive(survivor, other)
    assert list(a.output_token_ids) == [510, 511, 512, 513, 514]  # nothing lost, nothing repeated
    assert list(b.output_token_ids) == [503, 504, 505, 506, 507]
    assert survivor.kv.pool.num_free_blocks == 16


def test_a_forked_request_moves_only_its_unfinished_samples():
    lost, survivor = pair()
    r = req("n2", toks(0, 9), max_tokens=3, n=2)
    lost.add_request(r)
    worker = FakeWorker()
    step(lost, worker)  # prefix, then fork
    step(lost, worker)  # each child samples its first token
    lost.finish("n2", FinishReason.STOP_STRING, index=0)  # sample 0 is done
    child1 = r.children[1]
    streamed = list(child1.output_token_ids)
    released = lost.release_all()
    assert released == [r] and lost.kv.pool.num_free_blocks == 16
    survivor.adopt(r)
    scheduled = survivor.schedule()
    plan = scheduled.plan
    assert [s.token_ids for s in plan.new_seqs] == [toks(0, 9) + streamed]  # only the unfinished sample
    assert plan.new_seqs[0].seed == child1.seed
    other = FakeWorker()
    survivor.update(scheduled, other.step(plan))
    drive(survivor, other)
    assert len(child1.output_token_ids) == 3 and r.children[0].finish_reason is FinishReason.STOP_STRING
    assert r.status is RequestStatus.FINISHED and not survivor.requests


def test_take_queued_leaves_running_requests_where_they_are():
    leaving, other = pair()
    leaving.config.max_num_seqs = 1
    running, queued = req("run", toks(0, 5)), req("wait", toks(20, 5))
    leaving.add_request(running)
    leaving.add_request(queued)
    worker = FakeWorker()
    step(leaving, worker)
    assert leaving.take_queued() == [queued]
    assert list(leaving.requests) == ["run"] and leaving.num_waiting == 0
    other.adopt(queued)
    drive(other)
    drive(leaving, worker)
    assert len(queued.output_token_ids) == len(running.output_token_ids) == 4


def test_a_request_that_never_ran_keeps_waiting_status_and_its_first_hit():
    lost, survivor = pair()
    r = req("x", toks(0, 20))
    lost.add_request(r)
    (moved,) = lost.release_all()
    assert moved.status is RequestStatus.WAITING
    survivor.adopt(moved)
    drive(survivor)
    assert moved.num_cached_prompt_tokens == 0 and len(moved.output_token_ids) == 4
