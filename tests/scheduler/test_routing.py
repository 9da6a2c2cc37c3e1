"""The router over real per-worker Schedulers: exact prefix holdings, pending prefills, the load bound."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest

from scheduler_svc.core.request import Request
from pagedserve_common.sampling import SamplingParams
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig
from scheduler_svc.routing import Router, chain_hashes

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
SYSTEM = list(range(100, 132))  # two full blocks of 16


@dataclass
class W:
    worker_id: str
    scheduler: Scheduler


def fleet(n: int = 2, num_blocks: int = 32) -> list[W]:
    ids = itertools.count()
    return [W(f"worker-{i}", Scheduler(SchedulerConfig(num_blocks=num_blocks, max_model_len=256), seq_ids=ids))
            for i in range(n)]


def prefill(w: W, request_id: str, prompt: list[int]) -> None:
    """Runs one request's prefill on the worker's scheduler: its full blocks enter the prefix cache."""
    w.scheduler.add_request(Request(request_id, prompt, GREEDY))
    plan = w.scheduler.schedule()
    w.scheduler.update(plan, {s.seq_id: 1 for s in plan.new_seqs})


def test_kv_routes_to_the_worker_that_holds_the_prefix_and_says_how_much():
    a, b = fleet()
    prefill(b, "warm", SYSTEM + [1, 2, 3])
    decision = Router("kv").choose([a, b], SYSTEM + [7, 8], None)
    assert (decision.worker_id, decision.cached_tokens) == ("worker-1", 32)
    # A different cache salt is a different prefix: nothing held, so the least loaded worker.
    assert Router("kv").choose([a, b], SYSTEM + [7, 8], "tenant-2") == type(decision)("worker-0", 0)


def test_asking_every_worker_has_no_side_effects_on_their_caches():
    a, b = fleet()
    prefill(b, "warm", SYSTEM + [1, 2, 3])
    b.scheduler.abort("warm")
    kv = b.scheduler.kv
    before = (kv.prefix_query_tokens, kv.prefix_hit_tokens, kv.pool.eviction_order())
    for _ in range(3):
        Router("kv").choose([a, b], SYSTEM + [7, 8], None)
    assert (kv.prefix_query_tokens, kv.prefix_hit_tokens, kv.pool.eviction_order()) == before


def test_a_burst_sharing_a_prefix_follows_the_first_prompt_before_it_has_run():
    a, b = fleet()
    router = Router("kv")
    first = router.choose([a, b], SYSTEM + [1], None)
    assert first.worker_id == "worker-0"  # nothing held anywhere, equal loads: the first worker
    a.scheduler.add_request(Request("r0", SYSTEM + [1], GREEDY))
    router.routed("r0", "worker-0", SYSTEM + [1], 16)
    # worker-0 is now the loaded one, but it holds the prefix (queued there): it takes the next one too.
    assert router.choose([a, b], SYSTEM + [2], None).worker_id == "worker-0"
    assert router.choose([a, b], SYSTEM + [2], None).cached_tokens == 32
    router.prefilled("r0")  # no longer pending (and it never ran, so nothing is cached): by load again
    assert router.choose([a, b], SYSTEM + [2], None).worker_id == "worker-1"


def test_a_worker_loaded_beyond_the_bound_gets_no_more_of_its_hot_prefix():
    a, b = fleet(num_blocks=64)
    prefill(a, "warm", SYSTEM + [1])
    for i in range(4):  # each adds its prompt and its output budget to a's pending tokens
        a.scheduler.add_request(Request(f"q{i}", [9] * 20, GREEDY))
    # warm: 1 token to compute (the one it sampled) + 3 more to generate; each q: 20 + 4.
    assert (a.scheduler.num_pending_tokens, b.scheduler.num_pending_tokens) == (4 + 4 * 24, 0)
    # The bound is 1.5 x the least loaded worker's pending tokens (0) + the slack.
    assert Router("kv", balance_slack_tokens=99).choose([a, b], SYSTEM + [2], None).worker_id == "worker-1"
    assert Router("kv", balance_slack_tokens=100).choose([a, b], SYSTEM + [2], None).worker_id == "worker-0"


def test_least_loaded_and_round_robin():
    a, b, c = fleet(3)
    a.scheduler.add_request(Request("q", [9] * 20, GREEDY))
    c.scheduler.add_request(Request("r", [9] * 2, GREEDY))
    assert Router("least-loaded").choose([a, b, c], [1, 2], None).worker_id == "worker-1"
    rr = Router("round-robin")
    assert [rr.choose([a, b, c], [1, 2], None).worker_id for _ in range(4)] == \
        ["worker-0", "worker-1", "worker-2", "worker-0"]


def test_chain_hashes_cover_full_blocks_short_of_the_last_token():
    assert len(chain_hashes(list(range(32)), 16)) == 1  # the last token's block is never a hit
    assert len(chain_hashes(list(range(33)), 16)) == 2
    assert chain_hashes(list(range(33)), 16)[0] == chain_hashes(list(range(20)), 16)[0]
    assert chain_hashes(list(range(33)), 16, "s") != chain_hashes(list(range(33)), 16)


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="routing must be one of kv, least-loaded, round-robin"):
        Router("random")
