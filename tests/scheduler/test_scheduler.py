"""Spec tests for the scheduler core: batching order, chunked prefill, prefix hits, preemption, forks, stops."""

import subprocess
import sys

import pytest

from pagedserve_common.wire import plan_to_pb, result_from_pb
from pagedserve_common.step import NewSequence, SequenceDelta
from scheduler_svc.core.request import FinishReason, Request, RequestStatus
from pagedserve_common.sampling import SamplingParams
from scheduler_svc.core.scheduler import Scheduler
from pagedserve.v1 import worker_pb2
from tests.support.scheduler import FakeWorker, config, drive, make, position_token, random_steps, req, step, toks


def test_running_decodes_go_first_then_admission_within_the_token_budget():
    s, w = make(max_num_batched_tokens=10), FakeWorker()
    a = req("a", toks(0, 6))
    s.add_request(a)
    plan, out = step(s, w)
    assert [(p.seq_id, p.block_ids, p.num_computed_tokens, p.num_scheduled_tokens) for p in plan.new_seqs] == \
        [(0, [0], 0, 6)]
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in out] == [("a", [10_006], None)]
    s.add_request(req("b", toks(100, 20)))
    plan, out = step(s, w)
    assert plan.running == [SequenceDelta(0, [], 1)]  # a's decode first
    assert [(p.seq_id, p.block_ids, p.num_scheduled_tokens) for p in plan.new_seqs] == [(1, [1, 2], 9)]  # 10 - 1
    assert [o.request_id for o in out] == ["a"]
    plan, _ = step(s, w)
    assert plan.running == [SequenceDelta(0, [], 1), SequenceDelta(1, [3], 9)]
    plan, out = step(s, w)
    assert plan.running == [SequenceDelta(0, [4], 1), SequenceDelta(1, [], 2)]
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in out] == \
        [("a", [10_009], FinishReason.LENGTH), ("b", [11_020], None)]
    assert plan.new_seqs == [] and plan.step_id == 3


def test_max_num_seqs_caps_admission():
    s = make(max_num_seqs=2)
    for i in range(3):
        s.add_request(req(str(i), toks(100 * i, 5)))
    plan = s.schedule().plan
    assert [p.seq_id for p in plan.new_seqs] == [0, 1] and [r.request_id for r in s.waiting] == ["2"]


def test_long_prompt_is_chunked_by_the_token_budget():
    s, w = make(max_num_batched_tokens=16), FakeWorker()
    a = req("a", toks(0, 40), max_tokens=2)
    s.add_request(a)
    plans = drive(s, w)
    assert plans[0].new_seqs == [NewSequence(0, toks(0, 40), [0, 1], 0, 16, a.sampling, a.seed, 40)]
    assert [p.running for p in plans[1:]] == [[SequenceDelta(0, [2, 3], 16)], [SequenceDelta(0, [4], 8)],
                                              [SequenceDelta(0, [5], 1)]]
    assert list(a.output_token_ids) == [10_040, 10_041] and a.num_computed_tokens == 41


def test_long_prefill_token_threshold_caps_one_sequences_chunk():
    s = make(max_num_batched_tokens=64, long_prefill_token_threshold=12)
    s.add_request(req("a", toks(0, 30)))
    s.add_request(req("b", toks(100, 30)))
    assert [p.num_scheduled_tokens for p in s.schedule().plan.new_seqs] == [12, 12]


def test_prefix_hit_skips_cached_tokens_and_cache_salt_isolates():
    s, w = make(), FakeWorker()
    s.add_request(req("a", toks(0, 20)))
    drive(s, w)
    b = req("b", toks(0, 16) + toks(500, 5))
    s.add_request(b)
    scheduled = s.schedule()
    plan = scheduled.plan
    assert [(p.block_ids, p.num_computed_tokens, p.num_scheduled_tokens) for p in plan.new_seqs] == \
        [([0, 1, 3], 16, 5)]  # blocks 0 and 1 are a's; block 2 (a's partial tail) went back to the free queue
    assert b.num_cached_prompt_tokens == 16
    s.update(scheduled, w.step(plan))
    drive(s, w)
    s.add_request(Request("c", toks(0, 20), SamplingParams(max_tokens=1), cache_salt="tenant-1"))
    assert s.schedule().plan.new_seqs[0].num_computed_tokens == 0


def test_preemption_recomputes_the_most_recently_admitted_and_everyone_completes():
    s, w = make(num_blocks=4, max_num_seqs=2), FakeWorker()
    a, b, c = (req(r, toks(100 * i, 8), max_tokens=10) for i, r in enumerate("abc"))
    for r in (a, b, c):
        s.add_request(r)
    plans = [step(s, w)[0] for _ in range(9)]
    assert [p.seq_id for p in plans[0].new_seqs] == [0, 1] and s.num_preemptions == 0
    assert s.kv.block_table(0) == [0, 2] and s.kv.block_table(1) == [1, 3]  # pool full, both at 16 tokens
    plan, out = step(s, w)  # both need a third block: b, admitted last, loses its blocks
    assert plan.preempted_seq_ids == [1] and plan.running == [SequenceDelta(0, [3], 1)] and plan.new_seqs == []
    assert [(o.request_id, o.finish_reason) for o in out] == [("a", FinishReason.LENGTH)]
    assert [r.request_id for r in s.waiting] == ["b", "c"]  # back at the front
    assert (b.status, b.num_preemptions, s.num_preemptions, len(b.all_token_ids)) == \
        (RequestStatus.PREEMPTED, 1, 1, 17)
    plan, _ = step(s, w)
    # b comes back whole: all 17 tokens; its prompt block survived in the cache, its second block was evicted.
    assert [(p.seq_id, p.token_ids, p.block_ids, p.num_computed_tokens, p.num_scheduled_tokens)
            for p in plan.new_seqs] == [(1, list(b.all_token_ids[:17]), [1, 3, 2], 8, 9), (2, toks(200, 8), [0], 0, 8)]
    assert plan.finished_seq_ids == [0]
    drive(s, w)
    for r in (a, b, c):
        assert list(r.output_token_ids) == [position_token(r.seq_id, p) for p in range(8, 18)]
        assert r.finish_reason is FinishReason.LENGTH
    assert s.kv.pool.num_free_blocks == 4


def test_preemption_lists_only_sequences_the_worker_had_and_runs_many_to_completion():
    s = make(num_blocks=12, max_num_seqs=8, max_num_batched_tokens=32)
    reqs = [req(str(i), toks(1000 * i, 9 + i), max_tokens=20) for i in range(8)]
    for r in reqs:
        s.add_request(r)
    plans = drive(s)
    assert s.num_preemptions > 0 and sum(len(p.preempted_seq_ids) for p in plans) == s.num_preemptions
    assert [len(r.output_token_ids) for r in reqs] == [20] * 8
    assert all(list(r.output_token_ids) == [position_token(r.seq_id, p) for p in range(9 + i, 29 + i)]
               for i, r in enumerate(reqs))
    assert s.kv.pool.num_free_blocks == 12


def test_abort_frees_blocks_and_tells_the_worker_only_about_sequences_it_had():
    s, w = make(max_num_seqs=1), FakeWorker()
    a, b = req("a", toks(0, 20), max_tokens=50), req("b", toks(100, 20))
    s.add_request(a)
    s.add_request(b)
    scheduled = s.schedule()
    s.abort("a")  # while its step is in flight: the result for it is dropped
    assert s.update(scheduled, w.step(scheduled.plan)) == []
    s.abort("b")  # still waiting: the worker never had it
    assert (a.finish_reason, b.finish_reason) == (FinishReason.ABORT, FinishReason.ABORT)
    scheduled = s.schedule()
    plan = scheduled.plan
    assert (plan.finished_seq_ids, plan.new_seqs, plan.running) == ([0], [], [])
    s.update(scheduled, w.step(plan))
    assert s.schedule() is None and not s.has_unfinished_requests()
    assert s.kv.pool.num_free_blocks == 64 and s.kv.pool.num_used_blocks == 0
    s.abort("nope")  # unknown ids are ignored


def test_parallel_sampling_forks_after_the_prefix_with_copy_on_write():
    s, w = make(), FakeWorker()
    r = req("r", toks(0, 12), max_tokens=2, n=2, seed=5)
    s.add_request(r)
    plan, out = step(s, w)
    assert [(p.seq_id, p.block_ids, p.num_computed_tokens, p.num_scheduled_tokens) for p in plan.new_seqs] == \
        [(0, [0, 1], 0, 11)]  # the prompt but its last token
    assert out == [] and [c.seq_id for c in r.children] == [1, 2]
    plan, out = step(s, w)
    assert plan.finished_seq_ids == [0]  # the parent's worker state is no longer needed
    # Each child computes the last prompt token itself: the first copies the shared partial block 1 to a
    # fresh block 2; the second, by then its last holder, writes block 1 in place.
    assert plan.copies == [(1, 2)]
    assert [(p.seq_id, p.token_ids, p.block_ids, p.num_computed_tokens, p.num_scheduled_tokens, p.seed)
            for p in plan.new_seqs] == [(1, toks(0, 12), [0, 2], 11, 1, 5), (2, toks(0, 12), [0, 1], 11, 1, 6)]
    assert [(o.index, o.new_token_ids) for o in out] == [(0, [11_012]), (1, [12_012])]
    plan, out = step(s, w)
    assert plan.running == [SequenceDelta(1, [], 1), SequenceDelta(2, [], 1)] and plan.new_seqs == []
    assert [(o.index, o.new_token_ids, o.finish_reason) for o in out] == \
        [(0, [11_013], FinishReason.LENGTH), (1, [12_013], FinishReason.LENGTH)]
    assert r.is_finished and not s.has_unfinished_requests() and s.kv.pool.num_used_blocks == 0
    pb = plan_to_pb(step(s, w)[0])
    assert list(pb.finished_seq_ids) == [1, 2]


def test_fork_parent_whose_whole_prefix_hits_the_cache_forks_at_admission():
    s, w = make(), FakeWorker()
    s.add_request(req("a", toks(0, 17)))
    drive(s, w)
    r = req("r", toks(0, 17), max_tokens=1, n=2)
    s.add_request(r)
    plan, out = step(s, w)
    assert [(p.seq_id, p.num_computed_tokens, p.num_scheduled_tokens) for p in plan.new_seqs] == [(2, 16, 1), (3, 16, 1)]
    assert plan.copies == [] and [o.finish_reason for o in out] == [FinishReason.LENGTH] * 2


@pytest.mark.parametrize("kw, config, outputs, reason", [
    (dict(), dict(eos_token_ids=(7,)), [5, 6, 7], FinishReason.STOP),
    (dict(ignore_eos=True), dict(eos_token_ids=(7,)), [5, 6, 7, 8, 9], FinishReason.LENGTH),
    (dict(stop_token_ids=(6,)), dict(), [5, 6], FinishReason.STOP),
    (dict(), dict(), [5, 6, 7, 8, 9], FinishReason.LENGTH),  # max_tokens
    (dict(max_tokens=100), dict(max_model_len=11), [5, 6, 7], FinishReason.LENGTH),  # max_model_len
])
def test_stop_conditions(kw, config, outputs, reason):
    s = make(**config)
    a = Request("a", toks(0, 8), SamplingParams(**{"max_tokens": 5, **kw}))
    s.add_request(a)
    drive(s, FakeWorker(lambda seq_id, position: position - 3))
    assert (list(a.output_token_ids), a.finish_reason, list(a.all_token_ids)) == (outputs, reason, toks(0, 8) + outputs)


def test_finish_hook_for_stop_strings():
    s, w = make(), FakeWorker()
    a = req("a", toks(0, 8), max_tokens=50)
    s.add_request(a)
    step(s, w)
    s.finish("a", FinishReason.STOP_STRING)
    assert a.finish_reason is FinishReason.STOP_STRING and s.schedule().plan.finished_seq_ids == [0]


@pytest.mark.parametrize("prompt, sampling, field", [
    (toks(0, 100), {}, "max_model_len"),
    (toks(0, 10), {"max_tokens": 90}, "KV blocks"),  # 100 tokens need 13 blocks of 8; the pool has 12
    (toks(0, 10), {"n": 3, "max_tokens": 30}, "KV blocks"),
])
def test_a_request_that_can_never_fit_raises_value_error_naming_the_field(prompt, sampling, field):
    """Capacity only: the request's shape and ranges were checked before it reached a scheduler (the front end,
    with SamplingParams.validate)."""
    s = make(num_blocks=12, max_model_len=100)
    with pytest.raises(ValueError, match=field):
        s.add_request(Request("a", prompt, SamplingParams(**sampling)))
    assert not s.has_unfinished_requests() and not s.waiting


def test_duplicate_request_id_is_rejected():
    s = make()
    s.add_request(req("a", toks(0, 4)))
    with pytest.raises(ValueError, match="request_id"):
        s.add_request(req("a", toks(0, 4)))


def test_convert_round_trip():
    s = make()
    s.add_request(req("a", toks(0, 9), seed=3, logprobs=2))
    plan = s.schedule().plan
    pb = worker_pb2.StepPlan.FromString(plan_to_pb(plan).SerializeToString())
    (n,) = pb.new_seqs
    assert (n.seq_id, list(n.token_ids), list(n.block_ids), n.num_scheduled_tokens, n.seed) == (0, toks(0, 9),
                                                                                               [0, 1], 9, 3)
    assert (n.sampling.max_tokens, n.sampling.seed, n.sampling.logprobs) == (4, 3, 2)
    result = worker_pb2.StepResult(step_id=0, tokens=[worker_pb2.SampledToken(seq_id=0, token_id=77)])
    assert result_from_pb(result).sampled == {0: 77}


def decode_plan_bytes_per_seq(context: int, num_seqs: int = 8, num_steps: int = 32) -> list[float]:
    s = Scheduler(config(num_blocks=2048, max_model_len=4096, block_size=16))
    for i in range(num_seqs):
        s.add_request(req(str(i), toks(context * i, context), max_tokens=1000))
    w = FakeWorker(block_size=16)
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in s.requests.values()):
        step(s, w)
    sizes = []
    for _ in range(num_steps):
        plan, _ = step(s, w)
        assert len(plan.running) == num_seqs and not plan.new_seqs
        sizes.append(len(plan_to_pb(plan).SerializeToString()) / num_seqs)
    return sizes


def test_steady_state_decode_plan_bytes_do_not_grow_with_context():
    short, long = decode_plan_bytes_per_seq(100), decode_plan_bytes_per_seq(2000)
    assert min(long) == min(short) < 8  # a decode without a new block: seq id and token count only
    assert sum(long) / len(long) <= sum(short) / len(short) + 1  # block ids past 127 take a byte more


def test_scheduler_core_imports_neither_torch_nor_grpc():
    code = ("import sys, scheduler_svc.core.scheduler; "
            "print(sorted(m for m in ('torch', 'cupy', 'grpc', 'google.protobuf', 'worker_svc') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout
    assert out.strip() == "[]"


@pytest.mark.parametrize("seed", range(40))
def test_random_workloads_keep_the_worker_protocol_and_free_every_block(seed):
    import random
    rng = random.Random(seed)
    s = make(num_blocks=rng.randint(6, 30), max_model_len=60, max_num_seqs=rng.randint(3, 8),
             max_num_batched_tokens=rng.randint(4, 40), eos_token_ids=(3,),
             num_cpu_blocks=rng.choice([0, 0, 4, 40]))

    def new_request(i: int) -> Request:
        shared = rng.choice([[], toks(0, 9), toks(0, 17)])
        # NOTE: tenants and priorities too: the priority and fair policies then preempt for them (the policy matrix)
        return Request(str(i), shared + [rng.randrange(100, 200) for _ in range(rng.randint(1, 12))],
                       SamplingParams(max_tokens=rng.randint(1, 20), n=rng.choice([1, 1, 2, 3])),
                       cache_salt=rng.choice([None, None, "x"]), priority=rng.choice([0, 0, 1, -1]),
                       tenant=rng.choice(["", "a", "b"]))

    def check(w: FakeWorker) -> None:
        for q in s.running:  # NOTE: what the worker built from deltas is the scheduler's table, exactly
            if q.on_worker:
                assert w.seqs[q.seq_id]["blocks"] == s.kv.block_table(q.seq_id)

    w, reqs = random_steps(s, rng, new_request, 3000, check)
    assert not s.has_unfinished_requests() and s.kv.pool.num_free_blocks == s.config.num_blocks
    assert s.cpu_pool is None or s.cpu_pool.num_free_blocks == s.config.num_cpu_blocks
    assert w.seqs == {}  # every sequence the worker held was dropped
    for r in reqs:
        for q in r.children or [r]:
            assert q.finish_reason is not None
            if q.finish_reason is FinishReason.LENGTH:
                assert len(q.output_token_ids) == r.sampling.max_tokens or len(q.all_token_ids) == 60
