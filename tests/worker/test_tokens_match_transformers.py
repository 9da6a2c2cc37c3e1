"""Greedy output of the paged worker is token-identical to transformers' generate."""

from __future__ import annotations

import random

import pytest

from tests.support.worker import PATHS, assert_same_greedy, make_runner, reference_greedy, reference_model
from pagedserve_cli.bench.local_driver import LocalDriver

PROMPTS = [[random.Random(i).randrange(512) for _ in range(n)] for i, n in enumerate([5, 17, 33, 48, 64, 3])]
NEW = 24


@pytest.fixture(scope="module", params=["tiny_llama_dir", "tiny_qwen2_dir", "tiny_qwen3_dir", "tiny_mistral_dir"])
def tiny_model_dir(request):
    return request.getfixturevalue(request.param)


@pytest.fixture(params=list(PATHS))
def path(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def references(tiny_model_dir):
    ref = reference_model(tiny_model_dir)
    return [reference_greedy(ref, p, NEW) for p in PROMPTS]


def check(driver: LocalDriver, ids: dict[str, int], references) -> None:
    out = driver.run()
    for request_id, prompt_index in ids.items():
        assert_same_greedy(out[request_id][0], *references[prompt_index])


def test_mixed_prefill_and_decode_batches(tiny_model_dir, references, path):
    driver = LocalDriver(make_runner(tiny_model_dir, path=path), max_num_batched_tokens=512)
    ids = {driver.add(p, NEW, arrival_step=2 * i): i for i, p in enumerate(PROMPTS)}
    check(driver, ids, references)


def test_chunked_prefill(tiny_model_dir, references, path):
    driver = LocalDriver(make_runner(tiny_model_dir, path=path), max_num_batched_tokens=10)
    ids = {driver.add(p, NEW): i for i, p in enumerate(PROMPTS[:4])}
    check(driver, ids, references)


def test_prefix_cache_hits(tiny_model_dir, references, path):
    driver = LocalDriver(make_runner(tiny_model_dir, block_size=8, path=path))
    first = driver.add(PROMPTS[4], NEW)
    driver.run()
    again = driver.add(PROMPTS[4], NEW)
    longer = PROMPTS[4][:40]
    ref_model = reference_model(tiny_model_dir)
    part = driver.add(longer, NEW)
    out = driver.run()
    # The whole first prompt but its last block (56 of 64 tokens), then the first 32 of the shorter one.
    assert driver.scheduler.kv.prefix_hit_tokens == 56 + 32
    assert_same_greedy(out[first][0], *references[4])
    assert_same_greedy(out[again][0], *references[4])
    assert_same_greedy(out[part][0], *reference_greedy(ref_model, longer, NEW))


def test_preemption_recomputes_to_the_same_tokens(tiny_model_dir, references, path):
    # 12 blocks of 8 tokens cannot hold four sequences of up to 88 tokens: some are preempted and resumed.
    driver = LocalDriver(make_runner(tiny_model_dir, num_blocks=12, block_size=8, path=path), max_num_batched_tokens=64)
    ids = {driver.add(p, NEW): i for i, p in enumerate(PROMPTS[1:5], start=1)}
    check(driver, ids, references)
    assert driver.scheduler.num_preemptions > 0


def test_forked_sequences_copy_on_write(tiny_model_dir, references, path):
    driver = LocalDriver(make_runner(tiny_model_dir, block_size=8, path=path))
    # 48 prompt tokens: the first 47 are computed once, then the partial last block (7 tokens) is shared by
    # the two samples; the first to write copies it, the last holder writes in place.
    request_id = driver.add(PROMPTS[3], NEW, n=2)
    out = driver.run()
    assert driver.num_copies == 1
    for sample in out[request_id]:
        assert_same_greedy(sample, *references[3])
