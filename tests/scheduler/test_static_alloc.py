"""Spec tests for the static kv_allocation modes: one contiguous run of block ids per sequence, reserved at admission
(first fit), waiting on external fragmentation; and Scheduler.num_prefill_tokens in every mode."""

from __future__ import annotations

import random

import pytest

from pagedserve_common.sampling import InvalidField
from pagedserve_common.step import SequenceDelta
from scheduler_svc.core.request import FinishReason, Request, RequestStatus
from pagedserve_common.sampling import SamplingParams
from scheduler_svc.kv.manager import NO_CHANGE
from scheduler_svc.kv.run_pool import RunPool
from scheduler_svc.kv.static import KV_ALLOCATIONS, StaticKVCacheManager
from tests.support.scheduler import BS, FakeWorker, drive, make, position_token, random_steps, req, step, toks


def static(num_blocks: int, mode: str = "static-request", max_model_len: int = 256, **kw):
    return make(num_blocks=num_blocks, max_model_len=max_model_len, kv_allocation=mode, **kw)


def kv_figures(s) -> dict:
    """What kv-map shows of the scheduler's pool: the figures of its GetKVState snapshot."""
    from pagedserve_cli.kv_state import KVSnapshot, figures
    from scheduler_svc.core.kv_snapshot import snapshot

    return figures(KVSnapshot.from_pb(snapshot("worker-0", s)))


def new_tables(plan) -> list[tuple[int, list[int]]]:
    return [(p.seq_id, p.block_ids) for p in plan.new_seqs]


# -- the run pool and the manager ---------------------------------------------------------------------------------
def test_run_pool_hands_out_first_fit_runs_and_merges_freed_ones():
    pool = RunPool(10)
    assert (pool.allocate(3), pool.allocate(2), pool.allocate(4)) == ([0, 1, 2], [3, 4], [5, 6, 7, 8])
    pool.free([3, 4])
    assert pool.holes() == [(3, 2), (9, 1)] and pool.num_free_blocks == 3 and pool.num_used_blocks == 7
    assert not pool.can_allocate(3)  # 3 blocks are free, but no 3 in a row
    assert pool.allocate(1) == [3]  # the lowest hole that fits, not the tightest
    pool.free([0, 1, 2])
    assert pool.holes() == [(0, 3), (4, 1), (9, 1)]
    assert pool.ref_cnt == [0, 0, 0, 1, 0, 1, 1, 1, 1, 0]
    pool.free([3])  # joins the holes on both sides
    assert pool.holes() == [(0, 5), (9, 1)] and pool.largest_free_run == 5
    assert pool.free_run_at(2) == 3 and pool.free_run_at(5) == 0 and pool.free_run_at(9) == 1
    assert pool.allocate_at(9, 1) == [9] and pool.holes() == [(0, 5)]
    with pytest.raises(RuntimeError, match="freed more times"):
        pool.free([0])


def test_manager_reserves_one_run_hands_it_out_once_and_grows_only_in_place():
    kv = StaticKVCacheManager(num_blocks=6, block_size=BS)
    assert kv.reserve("a", 20) and kv.reserve("b", 9)  # 3 blocks, then 2
    assert (kv.block_table("a"), kv.block_table("b")) == ([0, 1, 2], [3, 4])
    assert kv.allocate("a", 5).new_block_ids == [0, 1, 2]  # the whole run, the first time
    assert kv.allocate("a", 24) is NO_CHANGE and kv.num_tokens("a") == 24
    assert kv.find_prefix(toks(0, 40)).num_tokens == 0 and kv.cached_prefix_len(toks(0, 40)) == 0
    assert kv.allocate("b", 16).new_block_ids == [3, 4]
    assert kv.allocate("b", 17).new_block_ids == [5]  # outgrew its run: block 5 is free and right after it
    assert kv.allocate("a", 25) is None  # block 3 is b's: no growing
    assert kv.num_tokens("a") == 24 and kv.block_table("a") == [0, 1, 2]  # unchanged
    with pytest.raises(ValueError, match="fork"):
        kv.fork("a", "c")
    kv.free("a")
    assert kv.pool.holes() == [(0, 3)] and "a" not in kv and "b" in kv


# -- the scheduler ------------------------------------------------------------------------------------------------
def test_static_max_model_len_reserves_max_model_len_as_consecutive_block_ids():
    s, w = static(13, "static-max-model-len", max_model_len=32), FakeWorker()  # 4 blocks per sequence
    a, b, c, d = (req(r, toks(100 * i, 5 + i)) for i, r in enumerate("abcd"))
    for r in (a, b, c, d):
        s.add_request(r)
    plan, _ = step(s, w)
    assert new_tables(plan) == [(0, [0, 1, 2, 3]), (1, [4, 5, 6, 7]), (2, [8, 9, 10, 11])]
    assert [r.request_id for r in s.waiting] == ["d"]  # one block left: d waits for a whole run
    assert s.kv.pool.holes() == [(12, 1)]
    stats = kv_figures(s)
    assert (stats["num_used_blocks"], stats["num_slots_allocated"], stats["num_slots_filled"]) == (12, 96, 5 + 6 + 7)
    plan, _ = step(s, w)
    # decodes: the run already covers the whole sequence, so no delta ever carries a block
    assert plan.running == [SequenceDelta(0, [], 1), SequenceDelta(1, [], 1), SequenceDelta(2, [], 1)]
    assert kv_figures(s)["num_slots_filled"] == 6 + 7 + 8
    plans = drive(s, w)
    assert all(r.new_block_ids == [] for p in plans for r in p.running)
    assert [(p.seq_id, p.block_ids) for plan in plans for p in plan.new_seqs] == [(3, [0, 1, 2, 3])]  # a's old run
    assert s.kv.pool.holes() == [(0, 13)] and s.num_preemptions == 0
    for r in (a, b, c, d):
        assert list(r.output_token_ids) == [position_token(r.seq_id, p) for p in range(len(r.prompt_token_ids),
                                                                                       len(r.prompt_token_ids) + 4)]


def test_static_request_reserves_prompt_plus_max_tokens_and_first_fit_fills_a_hole():
    s, w = static(10), FakeWorker()
    s.add_request(req("a", toks(0, 8), max_tokens=8))  # 16 tokens: 2 blocks
    s.add_request(req("b", toks(100, 20), max_tokens=4))  # 24: 3 blocks
    s.add_request(req("c", toks(200, 8), max_tokens=8))  # 16: 2 blocks
    plan, _ = step(s, w)
    assert new_tables(plan) == [(0, [0, 1]), (1, [2, 3, 4]), (2, [5, 6])]
    assert kv_figures(s)["num_slots_allocated"] == 7 * BS
    s.abort("b")
    assert s.kv.pool.holes() == [(2, 3), (7, 3)]
    s.add_request(req("d", toks(300, 10), max_tokens=6))  # 16: 2 blocks, the first hole that holds them
    s.add_request(req("e", toks(400, 17), max_tokens=7))  # 24: 3 blocks, not in what is left of the first hole
    plan, _ = step(s, w)
    assert plan.finished_seq_ids == [1] and new_tables(plan) == [(3, [2, 3]), (4, [7, 8, 9])]
    assert s.kv.pool.holes() == [(4, 1)]


def test_a_request_waits_on_external_fragmentation_until_a_neighbour_frees():
    s, w = static(8), FakeWorker()
    for i, r in enumerate("abcd"):
        s.add_request(req(r, toks(100 * i, 8), max_tokens=8))  # 2 blocks each
    plan, _ = step(s, w)
    assert new_tables(plan) == [(0, [0, 1]), (1, [2, 3]), (2, [4, 5]), (3, [6, 7])]
    s.abort("a")
    s.abort("c")
    e = req("e", toks(500, 16), max_tokens=8)  # 24 tokens: 3 blocks in a row
    s.add_request(e)  # NOTE: not an error: it fits the pool, just not the holes of the moment
    plan, _ = step(s, w)
    assert s.kv.pool.num_free_blocks == 4 and s.kv.pool.holes() == [(0, 2), (4, 2)]
    assert plan.new_seqs == [] and e.status is RequestStatus.WAITING and list(s.waiting) == [e]
    s.abort("b")  # frees 2..3: the holes around it merge into 0..5
    plan, _ = step(s, w)
    assert new_tables(plan) == [(4, [0, 1, 2])] and s.kv.pool.holes() == [(3, 3)]
    drive(s, w)
    assert e.finish_reason is FinishReason.LENGTH and s.kv.pool.holes() == [(0, 8)]


def test_static_modes_refuse_forks_swap_space_and_reservations_larger_than_the_pool():
    s = static(4, max_model_len=64)  # 32 token slots
    with pytest.raises(InvalidField, match="n=2") as e:
        s.add_request(req("a", toks(0, 4), n=2))
    assert e.value.field == "n" and s.max_output_tokens(4, n=2) == 0
    with pytest.raises(InvalidField) as e:
        s.add_request(req("a", toks(0, 10), max_tokens=23))  # 33 tokens: 5 blocks
    assert e.value.field == "max_tokens" and s.max_output_tokens(10) == 22
    s.add_request(req("a", toks(0, 10), max_tokens=22))  # the largest max_tokens it names fits
    with pytest.raises(InvalidField) as e:
        s.add_request(req("b", toks(0, 32), max_tokens=1))  # the prompt alone needs 33 slots
    assert e.value.field == "prompt_token_ids" and s.max_output_tokens(32) == 0
    big = static(6, "static-max-model-len", max_model_len=64)  # max_model_len needs 8 blocks
    with pytest.raises(InvalidField, match="reserves 64 tokens") as e:
        big.add_request(req("a", toks(0, 4), max_tokens=1))
    assert e.value.field == "prompt_token_ids" and big.max_output_tokens(4) == 0
    assert static(8, "static-max-model-len", max_model_len=64).max_output_tokens(4) == 60
    with pytest.raises(ValueError, match="swap space"):
        static(8, num_cpu_blocks=4)
    with pytest.raises(ValueError, match="kv_allocation must be one of"):
        static(8, "contiguous")


def test_a_sequence_that_outgrows_its_run_grows_in_place_or_is_preempted_and_recomputed():
    s, w = static(4), FakeWorker()
    s.num_reserved_tokens = lambda num_prompt_tokens, max_tokens: num_prompt_tokens  # too short, on purpose
    a, b = req("a", toks(0, 8), max_tokens=10), req("b", toks(100, 8), max_tokens=3)
    s.add_request(a)
    s.add_request(b)
    plan, _ = step(s, w)
    assert new_tables(plan) == [(0, [0]), (1, [1])]
    plan, _ = step(s, w)  # a needs a second block; block 1 is b's: b is preempted, a grows into its block
    assert plan.preempted_seq_ids == [1] and plan.running == [SequenceDelta(0, [1], 1)]
    assert b.status is RequestStatus.PREEMPTED and s.num_preemptions == 1
    plan, _ = step(s, w)
    assert new_tables(plan) == [(1, [2, 3])]  # its 9 known tokens, recomputed in a fresh run
    drive(s, w)
    for r in (a, b):
        assert list(r.output_token_ids) == [position_token(r.seq_id, p) for p in range(8, 8 + r.sampling.max_tokens)]
    assert s.kv.pool.holes() == [(0, 4)]


@pytest.mark.parametrize("mode", KV_ALLOCATIONS[1:])
@pytest.mark.parametrize("seed", range(4))
def test_random_static_workloads_keep_runs_contiguous_and_free_every_block(mode, seed):
    rng = random.Random(seed)
    s = static(rng.randint(8, 30), mode, max_model_len=rng.choice([24, 40, 60]), max_num_seqs=rng.randint(2, 8),
               max_num_batched_tokens=rng.randint(4, 40), eos_token_ids=(3,))

    def new_request(i: int) -> Request:
        return Request(str(i), [rng.randrange(100, 200) for _ in range(rng.randint(1, 20))],
                       SamplingParams(max_tokens=rng.randint(1, 20)))

    def check(w: FakeWorker) -> None:
        for q in s.running:
            table = s.kv.block_table(q.seq_id)
            assert table == list(range(table[0], table[0] + len(table)))  # one run of consecutive ids
            assert w.seqs[q.seq_id]["blocks"] == table

    w, reqs = random_steps(s, rng, new_request, 2000, check)
    assert not s.has_unfinished_requests() and s.kv.pool.holes() == [(0, s.config.num_blocks)]
    assert w.seqs == {} and s.num_preemptions == 0 and s.kv.prefix_hit_tokens == 0


# -- num_prefill_tokens -------------------------------------------------------------------------------------------
def test_num_prefill_tokens_counts_chunks_and_excludes_prefix_hits():
    s, w = make(max_num_batched_tokens=16), FakeWorker()
    s.add_request(req("a", toks(0, 20), max_tokens=3))
    plans = drive(s, w)
    assert [p.new_seqs[0].num_scheduled_tokens for p in plans[:1]] == [16] and s.num_prefill_tokens == 20
    s.add_request(req("b", toks(0, 16) + toks(500, 5)))  # its first 16 tokens hit a's blocks
    drive(s, w)
    assert s.num_prefill_tokens == 20 + 5 and s.kv.prefix_hit_tokens == 16


def test_num_prefill_tokens_counts_a_preempted_prompt_again():
    s, w = make(num_blocks=4, max_num_seqs=2, enable_prefix_caching=False), FakeWorker()
    a, b, c = (req(r, toks(100 * i, 8), max_tokens=10) for i, r in enumerate("abc"))
    for r in (a, b, c):
        s.add_request(r)
    for _ in range(9):
        step(s, w)
    assert s.num_prefill_tokens == 16 and s.num_preemptions == 0
    plan, _ = step(s, w)
    assert plan.preempted_seq_ids == [1]
    plan, _ = step(s, w)  # b comes back: its 8 prompt tokens (and its 9 outputs) are computed again
    assert [(p.seq_id, p.num_computed_tokens, p.num_scheduled_tokens) for p in plan.new_seqs] == [(1, 0, 17), (2, 0, 8)]
    assert s.num_prefill_tokens == 16 + 8 + 8
    drive(s, w)
    assert s.num_prefill_tokens == 32 and s.num_preemptions == 1


def test_num_prefill_tokens_in_a_static_mode_counts_every_prompt_whole():
    s, w = static(16), FakeWorker()
    s.add_request(req("a", toks(0, 20), max_tokens=2))
    drive(s, w)
    s.add_request(req("b", toks(0, 20), max_tokens=2))  # the same prompt: paging would hit 16 of its tokens
    drive(s, w)
    assert s.num_prefill_tokens == 40 and s.kv.prefix_query_tokens == 40 and s.kv.prefix_hit_tokens == 0


def test_export_adds_the_prefill_tokens_since_the_last_export_to_the_prometheus_counter():
    from pagedserve_common.kv_geometry import KVGeometry
    from pagedserve_common.registration import WorkerRegistration
    from scheduler_svc.metrics import Metrics
    from scheduler_svc.fleet import WorkerHandle, export

    s, w, m = static(16), FakeWorker(), Metrics()
    handle = WorkerHandle("worker-0", WorkerRegistration("m", 256, "cpu", KVGeometry(1, 1, 8, "float32", BS), 16), s)
    s.add_request(req("a", toks(0, 20), max_tokens=1))
    drive(s, w)
    export(handle, m)
    s.add_request(req("b", toks(0, 7), max_tokens=1))
    drive(s, w)
    export(handle, m)
    export(handle, m)  # nothing new
    assert m.registry.get_sample_value("pagedserve_prefill_tokens_total", {"worker": "worker-0"}) == 27
    assert m.registry.get_sample_value("pagedserve_kv_blocks_used", {"worker": "worker-0"}) == 0


def test_waiting_for_blocks_tells_a_queue_short_of_blocks_from_one_short_of_step_budget():
    # 8-token blocks: each reservation (prompt 8 + max_tokens 8) is 2 blocks, so a 4-block pool runs 2 at once.
    s, w = static(num_blocks=4, max_num_batched_tokens=64), FakeWorker()
    for rid in "abc":
        s.add_request(req(rid, toks(0, 8), max_tokens=8))
    step(s, w)
    assert [r.request_id for r in s.running] == ["a", "b"] and s.num_waiting == 1
    assert s.waiting_for_blocks  # c's run does not fit
    # Paged, the same three fit, but an 8-token budget admits one prompt a step: the others wait for the budget.
    p, wp = make(num_blocks=8, max_num_batched_tokens=8), FakeWorker()
    for rid in "abc":
        p.add_request(req(rid, toks(0, 8), max_tokens=8))
    step(p, wp)
    assert [r.request_id for r in p.running] == ["a"] and p.num_waiting == 2 and not p.waiting_for_blocks
    # A 2-block paged pool: a takes both (a 9-token prompt), b waits for them.
    q, wq = make(num_blocks=2, max_num_batched_tokens=64), FakeWorker()
    q.add_request(req("a", toks(0, 9), max_tokens=4))
    q.add_request(req("b", toks(100, 9), max_tokens=4))
    step(q, wq)
    assert [r.request_id for r in q.running] == ["a"] and q.waiting_for_blocks
