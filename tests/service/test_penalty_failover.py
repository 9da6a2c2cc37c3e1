"""The issue's test: a penalised greedy stream that migrates mid-way to another worker (its worker killed -9), or that
is preempted (a small KV pool), equals one that does neither; real processes on loopback."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from pagedserve_common.sampling import SamplingParams
from tests.support.service import started_service
from tests.support.fleet import NEW, PROMPTS, Streams, fleet_of, streams_migrated_mid_way
from tests.support.worker import assert_same_within_ties, reference_greedy, reference_model, reference_rules

PENALTIES = {"repetition_penalty": 1.3, "presence_penalty": 0.4, "frequency_penalty": 0.3}


@pytest.fixture(scope="module")
def refs(tiny_served_model) -> list[tuple[list[int], list[float]]]:
    """The float64 reference of each stream, and its gaps: where a float32 near tie (1e-4) may go either way."""
    model = reference_model(tiny_served_model)
    return [reference_rules(model, p, SamplingParams(**PENALTIES), NEW) for p in PROMPTS[:4]]


def assert_as_stay(got: list[list[int]], stay: list[list[int]], refs) -> None:
    for tokens, ref in zip(got, refs):
        assert_same_within_ties(tokens, *ref)
    assert got == stay or any(min(gaps) < 1e-4 for _, gaps in refs)


@pytest.fixture(scope="module")
def stay(fleet_of_2, refs) -> list[list[int]]:
    """The penalised greedy streams of PROMPTS[:4] on the fleet, untouched: no migration, no preemption (each
    worker's pool holds them all), checked against the float64 reference."""
    migrations = fleet_of_2.metric("pagedserve_migrations_total")
    streams = Streams(fleet_of_2, PROMPTS[:4], **PENALTIES)
    streams.join()
    assert streams.errors == [] and all(len(t) == NEW for t in streams.tokens)
    assert fleet_of_2.metric("pagedserve_migrations_total") == migrations
    assert fleet_of_2.metric("pagedserve_preemptions_total") == 0
    for got, ref in zip(streams.tokens, refs):
        assert_same_within_ties(got, *ref)
    return streams.tokens


@pytest.fixture(scope="module")
def fleet_of_2(tiny_served_model):
    with fleet_of(tiny_served_model, 2) as f:
        yield f


def test_a_penalised_greedy_stream_migrated_mid_way_equals_one_that_stays(fleet_of_2, tiny_served_model, stay, refs):
    prompts = PROMPTS[:4]
    model = reference_model(tiny_served_model)
    assert stay != [reference_greedy(model, p, NEW)[0] for p in prompts]  # the penalties change the output
    moved = streams_migrated_mid_way(fleet_of_2, prompts, fleet_of_2.wait_workers(2), **PENALTIES)
    assert_as_stay(moved.tokens, stay, refs)


def test_a_penalised_greedy_stream_preempted_equals_one_that_is_not(tiny_served_model, stay, refs):
    # the tests' small pool (40 blocks of 16 tokens) for 4 streams of up to 200 tokens each: they preempt each other
    with started_service(tiny_served_model, "--max-num-seqs", "4") as service:
        streams = Streams(SimpleNamespace(listen=service.address, scheduling_policy="fcfs"), PROMPTS[:4], **PENALTIES)
        streams.join()
        assert streams.errors == []
        assert service.metric("pagedserve_preemptions_total") > 0
    assert_as_stay(streams.tokens, stay, refs)
