"""The router over real per-worker Schedulers: exact prefix holdings, pending prefills, the load bound, and when
a prefix is worth a busier worker."""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import pytest

from scheduler_svc.core.request import Request
from pagedserve_common.sampling import SamplingParams
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.scheduler import Scheduler
from scheduler_svc.routing import Load, RouteDecision, Router, chain_hashes

GREEDY = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
SYSTEM = list(range(100, 132))  # two full blocks of 16
CHAT = list(range(200, 224))  # a chat template's system prefix: 24 tokens, one full block (SmolLM2's is 24)
DOC = list(range(1000, 1160))  # a long shared document: ten full blocks


@dataclass
class W:
    worker_id: str
    scheduler: Scheduler


def make_fleet(n: int = 2, num_blocks: int = 32) -> list[W]:
    ids = itertools.count()
    return [W(f"worker-{i}", Scheduler(SchedulerConfig(num_blocks=num_blocks, max_model_len=256), seq_ids=ids))
            for i in range(n)]


def prefill(w: W, request_id: str, prompt: list[int]) -> None:
    """Runs one request's prefill on the worker's scheduler: its full blocks enter the prefix cache."""
    w.scheduler.add_request(Request(request_id, prompt, GREEDY))
    step = w.scheduler.schedule()
    w.scheduler.update(step, {s.seq_id: 1 for s in step.plan.new_seqs})


def cache(w: W, prompt: list[int]) -> None:
    """`prompt`'s full blocks in the worker's prefix cache, and nothing left running there (load 0)."""
    prefill(w, "warm", prompt)
    w.scheduler.abort("warm")
    assert w.scheduler.num_pending_tokens == 0


def load(w: W, tokens: int) -> None:
    """Adds `tokens` pending tokens to the worker: queued requests of filler prompt tokens (sharing nothing with
    the tests' prefixes) + 4 to generate each."""
    before = w.scheduler.num_pending_tokens
    for i, start in enumerate(range(0, tokens, 200)):
        w.scheduler.add_request(Request(f"load{before}-{i}", [9] * (min(200, tokens - start) - 4), GREEDY))
    assert w.scheduler.num_pending_tokens == before + tokens


def burst(router: Router, workers: list[W], prompts: list[list[int]]) -> list[str]:
    """Routes and queues each prompt in turn, none of them run: the engine's path for a burst of requests."""
    out = []
    for i, prompt in enumerate(prompts):
        w = next(w for w in workers if w.worker_id == router.choose(workers, prompt, None).worker_id)
        w.scheduler.add_request(Request(f"b{i}", prompt, SamplingParams(max_tokens=16, ignore_eos=True)))
        router.routed(f"b{i}", w.worker_id, prompt, 16)
        out.append(w.worker_id)
    return out


def test_kv_routes_to_the_worker_that_holds_the_prefix_and_says_how_much():
    a, b = make_fleet()
    prefill(b, "warm", SYSTEM + [1, 2, 3])
    decision = Router("kv").choose([a, b], SYSTEM + [7, 8], None)
    assert (decision.worker_id, decision.cached_tokens) == ("worker-1", 32)
    # A different cache salt is a different prefix: nothing held, so the least loaded worker.
    assert Router("kv").choose([a, b], SYSTEM + [7, 8], "tenant-2") == type(decision)("worker-0", 0)


def test_asking_every_worker_has_no_side_effects_on_their_caches():
    a, b = make_fleet()
    prefill(b, "warm", SYSTEM + [1, 2, 3])
    b.scheduler.abort("warm")
    kv = b.scheduler.kv
    before = (kv.prefix_query_tokens, kv.prefix_hit_tokens, kv.pool.eviction_order())
    for _ in range(3):
        Router("kv").choose([a, b], SYSTEM + [7, 8], None)
    assert (kv.prefix_query_tokens, kv.prefix_hit_tokens, kv.pool.eviction_order()) == before


def test_a_burst_sharing_a_prefix_follows_the_first_prompt_before_it_has_run():
    a, b = make_fleet()
    router = Router("kv")
    first = router.choose([a, b], SYSTEM + [1], None)
    assert first.worker_id == "worker-0"  # nothing held anywhere, equal loads: the first worker
    a.scheduler.add_request(Request("r0", SYSTEM + [1], GREEDY))
    router.routed("r0", "worker-0", SYSTEM + [1], 16)
    # worker-0 is now the loaded one (37 tokens), but it holds the prefix (queued there), worth 4 x 32: it takes
    # the next one too.
    assert router.choose([a, b], SYSTEM + [2], None) == RouteDecision("worker-0", 32)
    router.prefilled("r0")  # no longer pending (and it never ran, so nothing is cached): by load again
    assert router.choose([a, b], SYSTEM + [2], None).worker_id == "worker-1"


def test_a_shared_chat_system_prompt_spreads_over_two_workers():
    # Issue 48: every chat request shares the template's system prefix. One block is worth 4 x 16 tokens of lead:
    # the holder takes the second request (60 tokens ahead), not the third (121 ahead): that one goes to the idle
    # worker, and once both hold the prefix, load alone decides.
    a, b = make_fleet(num_blocks=64)
    prompts = [CHAT + [300 + i] * (20 + i) for i in range(8)]  # 44 to 51 tokens, 16 to generate each
    assert burst(Router("kv"), [a, b], prompts) == ["worker-0", "worker-0", "worker-1", "worker-1"] + \
        ["worker-0", "worker-1"] * 2
    # Both cache it now: the lighter one takes the next, even though the other one served it first.
    a2, b2 = make_fleet()
    cache(a2, CHAT + [1])
    cache(b2, CHAT + [2])
    load(a2, 10)
    assert Router("kv").choose([a2, b2], CHAT + [3], None) == RouteDecision("worker-1", 16)


def test_a_short_prefix_stays_with_its_holder_only_while_its_lead_is_under_4x_what_it_holds():
    for lead, expected in [(127, "worker-1"), (128, "worker-0"), (129, "worker-0")]:  # 128: a tie, the lighter
        a, b = make_fleet()
        cache(b, SYSTEM + [1])
        load(a, 100)
        load(b, 100 + lead)
        # Within the bound: b's 100 + lead <= 1.5 x the average (200 + lead + 74) / 2.
        assert Router("kv").choose([a, b], SYSTEM + [5] * 42, None).worker_id == expected, lead


def test_a_long_shared_document_goes_to_its_holder_while_within_the_bound():
    # DOC is 160 tokens, worth 640 of lead: the bound decides here. With one idle worker, the holder is within
    # 1.5 x the average while its load <= 0.75 x (its load + the 162-token prompt), i.e. <= 486 tokens.
    for holder_load, expected in [(0, "worker-1"), (300, "worker-1"), (486, "worker-1"), (487, "worker-0")]:
        a, b = make_fleet()
        cache(b, DOC + [1])
        if holder_load:
            load(b, holder_load)
        decision = Router("kv").choose([a, b], DOC + [7, 8], None)
        assert (decision.worker_id, decision.cached_tokens) == \
            (expected, 160 if expected == "worker-1" else 0), holder_load


def test_a_hot_prefix_spreads_once_its_holder_exceeds_the_bound_and_its_overflow_follows_one_second_holder():
    a, b, c = make_fleet(3, num_blocks=128)
    cache(a, DOC + [1])
    prompts = [DOC + [7, 8 + i] for i in range(10)]  # 162 tokens + 16 to generate each: 178 pending
    # The second request finds worker-0 178 tokens ahead, beyond 1.5 x the average (178 + 162) / 3: the idle ones
    # tie, the first of them takes it. From then on worker-1 holds the document too (queued there), so the
    # overflow of either holder goes to the other, as bounded-load consistent hashing sends a key's overflow to
    # its next worker, not everywhere; worker-2 gets the document once the holders are 712 tokens ahead of it,
    # more than the 4 x 160 it saves.
    assert burst(Router("kv"), [a, b, c], prompts) == ["worker-0", "worker-1"] * 4 + ["worker-2"] * 2


def test_the_bound_is_relative_so_small_requests_balance_too():
    router = Router("kv")
    assert router.within_bound([Load(0, 0), Load(0, 0)], 50) == [0, 1]
    assert router.within_bound([Load(60, 1), Load(0, 0)], 50) == [0, 1]  # 60 <= 1.5 x 110 / 2
    assert router.within_bound([Load(151, 2), Load(0, 0)], 50) == [1]  # 151 > 1.5 x 201 / 2: no slack at all
    assert router.within_bound([Load(10**6, 9), Load(10**6, 9), Load(0, 0)], 1) == [0, 1, 2]


def test_least_loaded_and_round_robin():
    a, b, c = make_fleet(3)
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


def test_unknown_policy_and_negative_knobs_are_refused():
    with pytest.raises(ValueError, match="routing must be one of kv, least-loaded, round-robin"):
        Router("random")
    with pytest.raises(ValueError, match="balance_eps and hit_weight must be >= 0"):
        Router("kv", balance_eps=-0.1)
