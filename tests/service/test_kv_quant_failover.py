"""Migration on an int8 KV cache, real processes on loopback: two workers with --kv-cache-dtype int8, the one serving
killed -9 mid-generation; every stream is recomputed on the other and equals the undisturbed run's (the same
tokens with the same distribution at each position; tests.support.quantised says why a recompute is not
bit-exact)."""

from __future__ import annotations

import pytest

from tests.support.fleet import NEW, PROMPTS, Streams, fleet_of, streams_migrated_mid_way
from tests.support.quantised import assert_same_up_to_noise

LOGPROBS = {"logprobs": 5}  # what the comparison reads


@pytest.fixture(scope="module")
def int8_fleet(tiny_served_model):
    with fleet_of(tiny_served_model, 2, "--kv-cache-dtype", "int8") as f:
        yield f


def test_the_workers_register_int8_caches(int8_fleet):
    int8_fleet.wait_workers(2)
    assert [w.dtype for w in int8_fleet.info().workers] == ["int8", "int8"]


def test_an_int8_stream_migrated_mid_way_equals_one_that_stays(int8_fleet):
    prompts = PROMPTS[:4]
    ids = int8_fleet.wait_workers(2)
    migrations = int8_fleet.metric("pagedserve_migrations_total")
    stay = Streams(int8_fleet, prompts, **LOGPROBS)
    stay.join()
    assert stay.errors == [] and all(len(t) == NEW for t in stay.tokens)
    assert int8_fleet.metric("pagedserve_migrations_total") == migrations
    assert int8_fleet.metric("pagedserve_preemptions_total") == 0
    moved = streams_migrated_mid_way(int8_fleet, prompts, ids, **LOGPROBS)
    for i in range(len(prompts)):
        assert_same_up_to_noise(moved.tokens[i], moved.logprobs[i], stay.tokens[i], stay.logprobs[i], greedy=True)
