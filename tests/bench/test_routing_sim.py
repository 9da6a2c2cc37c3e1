"""bench/routing.py's simulation: every request completes exactly, every block comes back, kv beats round-robin."""

from __future__ import annotations

import pytest

from pagedserve_cli.bench.workloads import build_workload
from scheduler_svc.frontend.tokenizer import Tokenizer
from pagedserve_common.defaults import DEFAULT_MODEL
from worker_svc.model_store import resolve_model

BENCH_SCRIPT = "routing"


@pytest.fixture(scope="module")
def sim(bench_script):
    return bench_script


@pytest.fixture(scope="module")
def workload():
    tok = Tokenizer.from_model_dir(resolve_model(DEFAULT_MODEL))
    return build_workload("multi-tenant", tok, 40, seed=0, num_tenants=6)


NUM_BLOCKS = 96  # each worker holds ~3 of the 6 ~31-block system prompts besides its running sequences


@pytest.fixture(scope="module")
def results(sim, workload):
    arrivals = sim.poisson_arrivals(len(workload), 2.0, seed=0)
    return {p: sim.simulate(p, workload, arrivals, num_workers=3, num_blocks=NUM_BLOCKS)
            for p in ("kv", "round-robin", "least-loaded")}


@pytest.mark.parametrize("policy", ["kv", "round-robin", "least-loaded"])
def test_every_request_gets_exactly_max_tokens_and_every_block_comes_back(results, workload, policy):
    r = results[policy]
    assert len(r.num_outputs) == len(workload)
    for i, req in enumerate(workload):
        assert r.num_outputs[f"r{i}"] == req.max_tokens
    assert sum(w.num_routed for w in r.workers) == len(workload)
    for w in r.workers:
        assert not w.scheduler.has_unfinished_requests()
        assert w.scheduler.kv.pool.num_free_blocks == NUM_BLOCKS


def test_kv_routing_hits_the_prefix_cache_more_than_round_robin(results):
    kv, rr = results["kv"], results["round-robin"]
    assert kv.hit_rate >= rr.hit_rate
    assert kv.request_hit_rate >= rr.request_hit_rate
