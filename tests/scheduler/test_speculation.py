"""Speculative decoding in the scheduler (--speculative ngram), through the fake worker that verifies drafts as a
greedy worker does: what a sequence drafts, the blocks for its drafts, the rollback of num_computed_tokens to the
last accepted draft, stops inside accepted drafts, the limits of a draft, backoff, exclusions, preemption."""

import random

import pytest

from pagedserve_common.sampling import SamplingParams
from pagedserve_common.step import SequenceDelta, StepResult
from scheduler_svc.core.request import FinishReason, Request
from scheduler_svc.core.result_check import check_result
from scheduler_svc.core.speculation import MAX_BACKOFF_STEPS, Speculator
from tests.support.scheduler import FakeWorker, drive, make, req, step, toks

PROMPT = toks(100, 10)  # 100 .. 109


def copying(divert: dict[int, int] | None = None):
    """A model that repeats the prompt over and over (position p -> PROMPT[p % 10]), but at the positions of
    `divert`, where it gives those tokens."""
    return lambda seq_id, pos: (divert or {}).get(pos, PROMPT[pos % len(PROMPT)])


def spec(**kw):
    return make(speculative="ngram", num_speculative_tokens=4, **kw)


def test_a_decoding_sequence_drafts_what_followed_its_last_tokens_and_keeps_every_accepted_draft():
    s, w = spec(), FakeWorker(copying())
    a = req("a", PROMPT, max_tokens=12)
    s.add_request(a)
    step(s, w)  # the prompt: samples 100
    plan, out = step(s, w)  # [109, 100] occurred nowhere before: no draft
    assert plan.running == [SequenceDelta(0, [], 1, [])] and out[0].new_token_ids == [101]
    plan, out = step(s, w)  # [100, 101] did, followed by 102 ..
    assert plan.running == [SequenceDelta(0, [], 5, [102, 103, 104, 105])]
    assert out[0].new_token_ids == [102, 103, 104, 105, 106] and w.num_accepted == {0: 4}
    assert a.num_computed_tokens == 16  # every accepted draft's KV is valid; 106's is computed next
    plan, out = step(s, w)  # 16 + 5 tokens need a third block
    assert plan.running == [SequenceDelta(0, [2], 5, [107, 108, 109, 100])]
    assert (out[0].new_token_ids, out[0].finish_reason) == ([107, 108, 109, 100, 101], FinishReason.LENGTH)
    assert list(a.output_token_ids) == [100, 101, 102, 103, 104, 105, 106, 107, 108, 109, 100, 101]


def test_a_refused_draft_rolls_num_computed_back_to_the_last_accepted_one_and_the_table_keeps_its_blocks():
    s, w = spec(), FakeWorker(copying({14: 999}))  # the model leaves the copy at position 14
    a = req("a", PROMPT, max_tokens=12)
    s.add_request(a)
    step(s, w), step(s, w)
    plan, out = step(s, w)
    assert plan.running == [SequenceDelta(0, [], 5, [102, 103, 104, 105])]  # at positions 12 .. 15
    assert out[0].new_token_ids == [102, 103, 999] and w.num_accepted == {0: 2}
    assert a.num_computed_tokens == 14 and s.kv.num_tokens(0) == 16  # 104's and 105's slots are written again
    plan, out = step(s, w)  # [103, 999] occurred nowhere before: a plain decode of 999, in the blocks it has
    assert plan.running == [SequenceDelta(0, [], 1, [])] and a.num_computed_tokens == 15
    drive(s, w)  # FakeWorker reads every sequence's KV back each step: a wrong rollback fails there
    assert list(a.output_token_ids)[:6] == [100, 101, 102, 103, 999, 105]


def test_a_stop_token_inside_the_accepted_drafts_ends_the_sample_there():
    s, w = spec(eos_token_ids=(103,)), FakeWorker(copying())
    a = req("a", PROMPT, max_tokens=12)
    s.add_request(a)
    step(s, w), step(s, w)
    plan, out = step(s, w)
    assert plan.running[0].draft_token_ids == [102, 103, 104, 105] and w.num_accepted == {0: 4}
    assert (out[0].new_token_ids, out[0].finish_reason) == ([102, 103], FinishReason.STOP)
    assert list(a.output_token_ids) == [100, 101, 102, 103]
    plan = s.schedule().plan
    assert plan.finished_seq_ids == [0] and s.kv.pool.num_free_blocks == s.config.num_blocks


def test_drafts_never_reach_past_max_tokens_or_max_model_len():
    s, w = spec(), FakeWorker(copying())
    a = req("a", PROMPT, max_tokens=5)
    s.add_request(a)
    step(s, w), step(s, w)
    plan, out = step(s, w)  # 2 outputs so far: 2 drafts and the token after them make 5
    assert plan.running[0].draft_token_ids == [102, 103]
    assert (out[0].new_token_ids, out[0].finish_reason) == ([102, 103, 104], FinishReason.LENGTH)
    s, w = spec(max_model_len=15), FakeWorker(copying())
    s.add_request(req("b", PROMPT, max_tokens=100))
    step(s, w), step(s, w)
    plan, out = step(s, w)  # 12 tokens known: 2 drafts and one more token make 15
    assert plan.running[0].draft_token_ids == [102, 103]
    assert (out[0].new_token_ids, out[0].finish_reason) == ([102, 103, 104], FinishReason.LENGTH)


def test_drafts_count_in_the_token_budget_and_take_only_the_room_left():
    s, w = spec(max_num_batched_tokens=3), FakeWorker(copying())
    s.add_request(req("a", PROMPT, max_tokens=12))
    step(s, w)
    step(s, w)  # the prompt took 3 steps of 3 tokens and a fourth ... then 101
    while s.running[0].num_computed_tokens + 1 < len(s.running[0].all_token_ids):
        step(s, w)
    plan, _ = step(s, w)
    assert plan.num_scheduled_tokens <= 3 and len(plan.running[0].draft_token_ids) <= 2


@pytest.mark.parametrize("kw", [dict(logprobs=1), dict(repetition_penalty=1.2), dict(presence_penalty=0.5),
                                dict(logit_bias=((5, 1.0),)), dict(min_tokens=3), dict(bad_words_token_ids=((7,),)),
                                dict(allowed_token_ids=(5, 7))],
                         ids=["logprobs", "repetition", "presence", "logit_bias", "min_tokens", "bad_words",
                              "allowed_token_ids"])
def test_no_drafts_for_a_sequence_whose_samples_need_more_than_the_raw_distribution(kw):
    s = spec()
    s.add_request(req("a", PROMPT, max_tokens=12, **kw))
    plans = drive(s, FakeWorker(copying()))
    assert all(not r.draft_token_ids for p in plans for r in p.running) and len(plans) == 12


def test_speculation_off_sends_no_drafts_and_the_same_tokens():
    plain, fast = make(), spec()
    for s in (plain, fast):
        s.add_request(req("a", PROMPT, max_tokens=30))
    slow_plans, fast_plans = drive(plain, FakeWorker(copying())), drive(fast, FakeWorker(copying()))
    assert all(not r.draft_token_ids for p in slow_plans for r in p.running)
    assert len(fast_plans) < len(slow_plans) / 2


def test_a_sequence_whose_drafts_are_all_refused_backs_off_exponentially():
    sp = Speculator(4)
    a = Request("a", [1, 2, 3, 1, 2], SamplingParams(max_tokens=100))
    assert sp.drafts(a, 4, 1000) == [3, 1, 2]
    skipped = []
    for misses in range(1, 8):
        sp.verified(a, 3, 0)
        n = 0
        while not sp.drafts(a, 4, 1000):
            n += 1
        skipped.append(n)
    assert skipped == [1, 2, 4, 8, 16, 32, MAX_BACKOFF_STEPS]
    sp.verified(a, 3, 1)  # one accepted draft: drafts again at once, and a later miss starts from 1 again
    assert sp.drafts(a, 4, 1000) == [3, 1, 2]
    sp.verified(a, 3, 0)
    assert sp.drafts(a, 4, 1000) == [] and sp.drafts(a, 4, 1000) == [3, 1, 2]
    c = sp.take_counters()
    assert (c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens, c.accepted_per_pos) == (9, 27, 1, [1, 0, 0, 0])
    assert sp.take_counters().num_drafts == 0


def test_a_big_step_leaves_no_room_for_drafts():
    # 8 decoding sequences and max_step_tokens 10: 2 drafts in all this step, to the first sequences in order
    s = spec(max_num_seqs=8)
    s.spec.max_step_tokens = 10
    w = FakeWorker(copying())
    for i in range(8):
        s.add_request(req(str(i), PROMPT, max_tokens=30))
    step(s, w), step(s, w)
    plan, _ = step(s, w)
    assert sum(len(r.draft_token_ids) for r in plan.running) == 2 and plan.running[0].draft_token_ids == [102, 103]


def test_the_result_check_refuses_accepted_drafts_beyond_those_sent():
    due = {0: None, 1: None}
    ok = StepResult(7, {0: 5, 1: 6}, num_accepted_drafts={0: 3})
    assert check_result(7, ok, due, 100, drafted={0: 3}) is None
    wrong = check_result(7, StepResult(7, {0: 5, 1: 6}, num_accepted_drafts={0: 4}), due, 100, drafted={0: 3})
    assert wrong.seq_id == 0 and "num_accepted_drafts 4 of seq 0, which drafted 3" in wrong.message
    wrong = check_result(7, StepResult(7, {0: 5, 1: 6}, num_accepted_drafts={1: 1}), due, 100, drafted={0: 3})
    assert wrong.seq_id == 1 and "which drafted 0" in wrong.message
    wrong = check_result(7, StepResult(7, {0: 5, 1: 6}, num_accepted_drafts={9: 1}), due, 100, drafted={0: 3})
    assert wrong.seq_id is None  # not a sequence of the plan: the answer as a whole is wrong


def deterministic_model(w: FakeWorker, rng_seed: int):
    """A model of the tokens before a position (the last 3, over a 4-token alphabet): repetitive enough that
    drafts often hold, and the same whatever the batch, so runs with and without drafts must agree."""
    salt = rng_seed * 7919

    def next_token(seq_id: int, pos: int) -> int:
        ctx = tuple(w.seqs[seq_id]["tokens"][max(0, pos - 3):pos])
        return 3 + (hash((salt, ctx)) % 4)
    return next_token


# each random workload's (accepted drafts, preemptions, swaps), by scheduling policy (tests/scheduler/conftest.py)
accepted: dict[str, list[tuple[int, int, int]]] = {}


@pytest.mark.parametrize("seed", range(12))
def test_random_workloads_with_drafts_keep_the_protocol_free_every_block_and_give_the_tokens_of_plain_decoding(
        seed, scheduling_policy):
    outputs = {}
    for method in ("none", "ngram"):
        rng = random.Random(seed)
        s = make(num_blocks=rng.randint(8, 16), max_model_len=60, max_num_seqs=rng.randint(3, 8),
                 max_num_batched_tokens=rng.randint(6, 40), eos_token_ids=(3,),
                 num_cpu_blocks=rng.choice([0, 0, 4, 40]), speculative=method, num_speculative_tokens=rng.randint(1, 5))

        def new_request(i: int) -> Request:
            return Request(str(i), [rng.randrange(3, 7) for _ in range(rng.randint(1, 20))],
                           SamplingParams(max_tokens=rng.randint(1, 30), n=rng.choice([1, 1, 2])),
                           priority=i % 3 - 1, tenant="ab"[i % 2])  # NOTE: not drawn: the same rng draws as ever

        def check(w: FakeWorker) -> None:
            for q in s.running:
                if q.on_worker:
                    assert w.seqs[q.seq_id]["blocks"] == s.kv.block_table(q.seq_id)

        w = FakeWorker()
        w.next_token = deterministic_model(w, seed)
        reqs = []
        for i in range(16):  # NOTE: all at once and no aborts: the same requests either way
            r = new_request(i)
            try:
                s.add_request(r)
                reqs.append(r)
            except ValueError:
                pass
        while s.has_unfinished_requests():
            scheduled = s.schedule()
            s.update(scheduled, w.step(scheduled.plan), w.num_accepted)
            check(w)
        scheduled = s.schedule()
        if scheduled is not None:
            w.step(scheduled.plan)
        assert s.kv.pool.num_free_blocks == s.config.num_blocks and w.seqs == {}
        outputs[method] = [[list(q.output_token_ids) for q in r.children or [r]] for r in reqs]
        if method == "ngram":
            accepted.setdefault(scheduling_policy, []).append((s.spec.counters.num_accepted_tokens,
                                                               s.num_preemptions, s.num_swaps))
            assert s.spec.counters.num_draft_tokens > 0  # it did draft: the comparison below means something
    assert outputs["ngram"] == outputs["none"]


def test_the_random_workloads_accepted_drafts_and_preempted_drafting_sequences(scheduling_policy):
    runs = accepted[scheduling_policy]
    assert len(runs) == 12 and sum(n > 0 for n, _, _ in runs) >= 6
    assert sum(p > 0 for _, p, _ in runs) >= 3 and sum(w > 0 for _, _, w in runs) >= 1  # recompute, swap


def test_export_adds_the_drafts_since_the_last_export_to_both_metric_families():
    from pagedserve_common.kv_geometry import KVGeometry
    from pagedserve_common.registration import WorkerRegistration
    from scheduler_svc.fleet import WorkerHandle, export
    from scheduler_svc.metrics import Metrics

    s, w, m = spec(eos_token_ids=()), FakeWorker(copying({14: 999})), Metrics("m")
    handle = WorkerHandle("worker-0", WorkerRegistration("m", 256, "cpu", KVGeometry(1, 1, 8, "float32", 8), 64), s)
    s.add_request(req("a", PROMPT, max_tokens=12))
    for _ in range(3):  # the third step drafts 4 and keeps 2
        step(s, w)
        export(handle, m)
    export(handle, m)  # nothing new
    get = m.registry.get_sample_value
    assert [get(f"pagedserve_spec_decode_{n}_total", {"worker": "worker-0"})
            for n in ("drafts", "draft_tokens", "accepted_tokens")] == [1, 4, 2]
    assert [get(f"vllm:spec_decode_num_{n}_total", {"model_name": "m"})
            for n in ("drafts", "draft_tokens", "accepted_tokens")] == [1, 4, 2]
    assert [get("vllm:spec_decode_num_accepted_tokens_per_pos_total", {"model_name": "m", "position": str(j)})
            for j in range(4)] == [1, 1, 0, 0]
