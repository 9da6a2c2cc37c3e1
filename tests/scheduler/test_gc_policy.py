"""The scheduler's memory at scale: compact token ids, no cycles left by finished requests, the GC policy."""

from __future__ import annotations

import gc
from array import array

import pytest

from scheduler_svc import gc_policy
from pagedserve_common.sampling import SamplingParams
from scheduler_svc.core.request import Request, token_ids
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.scheduler import Scheduler


def test_token_ids_are_int32_arrays_a_full_collection_does_not_walk():
    prompt = [5, 70_000, 2**31 - 1]
    r = Request("a", prompt, SamplingParams())
    assert (r.prompt_token_ids.typecode, list(r.prompt_token_ids), list(r.all_token_ids)) == ("i", prompt, prompt)
    assert r.all_token_ids is not r.prompt_token_ids and not r.output_token_ids
    assert gc.get_referents(r.prompt_token_ids) == [array]  # the type only: never the tokens
    kept = token_ids(prompt)
    assert Request("b", kept).prompt_token_ids is kept  # an int32 array is kept, not copied


def test_ids_outside_int32_stay_as_given_for_the_engine_to_refuse():
    r = Request("a", [1, 2**32 - 1])
    assert r.prompt_token_ids == [1, 2**32 - 1] and r.all_token_ids == [1, 2**32 - 1]


def test_a_finished_forked_request_holds_no_reference_cycle():
    s = Scheduler(SchedulerConfig(num_blocks=64, max_model_len=64, max_num_seqs=4, block_size=8))
    r = Request("a", list(range(1, 11)), SamplingParams(max_tokens=3, n=3, ignore_eos=True))
    s.add_request(r)
    while s.has_unfinished_requests():
        step = s.schedule()
        plan = step.plan
        s.update(step, {p.seq_id: 7 for p in plan.new_seqs} | {p.seq_id: 7 for p in plan.running})
        if r.children and not r.is_finished:
            assert all(c.parent is r for c in r.children)  # still linked while it runs
    assert r.is_finished and len(r.children) == 3
    assert all(c.parent is None and list(c.output_token_ids) == [7, 7, 7] for c in r.children)


@pytest.fixture
def settled():
    policy = gc_policy.settle()
    yield policy
    gc.callbacks.remove(policy)
    gc.unfreeze()


def test_settle_freezes_start_up_and_each_full_collections_survivors(settled):
    assert gc.get_freeze_count() > 0 and gc.isenabled()
    assert gc_policy.settle() is not settled  # a second call replaces the first
    policy = next(cb for cb in gc.callbacks if isinstance(cb, gc_policy.FreezeSurvivors))
    assert sum(isinstance(cb, gc_policy.FreezeSurvivors) for cb in gc.callbacks) == 1
    gc.callbacks.remove(policy)
    gc.callbacks.append(settled)  # the fixture's teardown removes it
    survivor = [[1], [2]]
    cycle = [None]
    cycle[0] = cycle
    del cycle
    assert gc.collect() >= 1  # the collector still frees cyclic garbage
    assert not any(o is survivor for o in gc.get_objects(generation=2))  # frozen: no later collection walks it


def test_a_grown_heap_is_walked_whole_once(settled):
    num_rewalks = settled.num_rewalks
    grown = [[i] for i in range(int(gc_policy.REWALK_GROWTH * settled.num_blocks_walked))]
    gc.collect()
    assert settled.num_rewalks > num_rewalks and settled.num_blocks_walked >= len(grown)
    num_rewalks = settled.num_rewalks
    gc.collect()  # not grown since: frozen objects stay frozen
    assert settled.num_rewalks == num_rewalks
