"""The default model on an int8 KV cache, through the real scheduler and runner (plans and results through
protobuf), is token-identical to itself across recompute and swap preemption, prefix-cache hits and parallel
sampling's copy-on-write (with the same distribution at every position; a divergence only at a tie within the
cache's noise: tests.support.quantised says why recomputing is not bit-exact): every path that moves or shares a
block's codes reads its scales with them."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import AutoTokenizer

from pagedserve_common.sampling import SamplingParams
from scheduler_svc.core.scheduler import Scheduler
from pagedserve_cli.bench.local_driver import LocalDriver
from tests.support.quantised import assert_same_up_to_noise
from worker_svc.kv_pool import KVPool
from worker_svc.models import load_model
from worker_svc.runner import ModelRunner
from worker_svc.worker import make_backend

pytestmark = pytest.mark.slow
BLOCK_SIZE = 8
NEW = 20
TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
         "The three primary colors are"]
SHARED = ("You are a helpful assistant who answers questions about the world. Keep every answer to one short "
          "sentence. Question: ")  # 23 tokens: 2 whole blocks of 8 and some
# logprobs: what the comparison of two runs reads (tests.support.quantised)
GREEDY = SamplingParams(temperature=0.0, ignore_eos=True, logprobs=5)
SEEDED = SamplingParams(temperature=0.8, top_p=0.95, seed=1234, ignore_eos=True, logprobs=5)


@pytest.fixture(scope="module")
def prompts(model_dir) -> list[list[int]]:
    tok = AutoTokenizer.from_pretrained(model_dir)
    return [tok(t)["input_ids"] for t in TEXTS]


@pytest.fixture(scope="module")
def int8_runner(model_dir) -> ModelRunner:
    """The worker's own choice of forward and backend for an int8 cache, with room for everything and swap space
    (each test's scheduler decides how much of the pool it plans with)."""
    torch.set_num_threads(1)
    loaded = load_model(model_dir, dtype="float32")
    pool = KVPool(loaded.kv_geometry(BLOCK_SIZE, "int8"), 64, num_cpu_blocks=32)
    assert pool.scales is not None
    return ModelRunner(loaded, pool, make_backend("auto", "cpu", pool.geometry))


def drive(runner: ModelRunner, requests, num_blocks: int | None = None, num_cpu_blocks: int = 0,
          enable_prefix_caching: bool = True) -> LocalDriver:
    """Each (prompt, sampling, n, arrival step) of `requests` through LocalDriver, planning with `num_blocks` of
    the pool (all of it by default); the driver, run (its outputs and logprobs by request)."""
    runner.reset()  # NOTE: an earlier run's last finished sequences were never dropped (no plan after them)
    driver = LocalDriver(runner, max_num_batched_tokens=32, num_cpu_blocks=num_cpu_blocks,
                         enable_prefix_caching=enable_prefix_caching)
    if num_blocks is not None:
        driver.scheduler = Scheduler(dataclasses.replace(driver.scheduler.config, num_blocks=num_blocks))
    for prompt, sp, n, arrival in requests:
        driver.add(prompt, NEW, sp, arrival_step=arrival, n=n)
    driver.run()
    assert all(len(o) == NEW for outputs in driver.outputs.values() for o in outputs)
    return driver


def same_stream(got: LocalDriver, got_id: str, want: LocalDriver, want_id: str, sp: SamplingParams,
                got_index: int = 0, want_index: int = 0) -> None:
    assert_same_up_to_noise(got.outputs[got_id][got_index], got.logprobs[got_id][got_index],
                            want.outputs[want_id][want_index], want.logprobs[want_id][want_index],
                            greedy=sp.temperature == 0)


def same_streams(got: LocalDriver, want: LocalDriver, sp: SamplingParams) -> None:
    assert got.outputs.keys() == want.outputs.keys()
    for request_id in want.outputs:
        same_stream(got, request_id, want, request_id, sp)


def all_at_once(prompts, sp: SamplingParams) -> list:
    return [(p, sp, 1, 0) for p in prompts]


@pytest.fixture(scope="module")
def undisturbed(int8_runner, prompts) -> dict[SamplingParams, LocalDriver]:
    """Each setting's run with room for every sequence: nothing preempted."""
    out = {}
    for sp in (GREEDY, SEEDED):
        out[sp] = drive(int8_runner, all_at_once(prompts, sp))
        assert out[sp].scheduler.num_preemptions == 0
    return out


def preempted(runner, prompts, sp: SamplingParams, num_cpu_blocks: int) -> LocalDriver:
    # 8 blocks of 8 tokens for 4 sequences of up to 30 tokens (4 blocks each): they preempt each other
    driver = drive(runner, all_at_once(prompts, sp), num_blocks=8, num_cpu_blocks=num_cpu_blocks)
    assert driver.scheduler.num_preemptions > 0
    assert (driver.scheduler.num_swaps > 0) == (num_cpu_blocks > 0)
    return driver


@pytest.mark.parametrize("sp", [GREEDY, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("num_cpu_blocks", [0, 32], ids=["recompute", "swap"])
def test_preemption_changes_no_int8_stream(int8_runner, prompts, undisturbed, sp, num_cpu_blocks):
    same_streams(preempted(int8_runner, prompts, sp, num_cpu_blocks), undisturbed[sp], sp)


def stale_scales(runner: ModelRunner) -> None:
    """Every scale in the pool set to what no write of this model's K/V makes (real ones are about absmax / 127):
    so a block whose scales stay behind reads wrong whatever ran before. NOTE: else a block that an earlier run
    filled with the same tokens would still hold the right ones."""
    runner.pool.scales.fill_(1.0)
    runner.pool.cpu_scales.fill_(1.0)


def test_a_swap_in_that_drops_the_scales_changes_the_streams(int8_runner, prompts, undisturbed, monkeypatch):
    """The check above has teeth: swapped-in blocks read with the stale scales their device blocks held."""
    swap_in = KVPool.swap_in

    def codes_only(self, pairs):
        scales = self.scales.clone()
        swap_in(self, pairs)
        self.scales.copy_(scales)

    monkeypatch.setattr(KVPool, "swap_in", codes_only)
    stale_scales(int8_runner)
    with pytest.raises(AssertionError, match="differ"):
        same_streams(preempted(int8_runner, prompts, GREEDY, 32), undisturbed[GREEDY], GREEDY)


@pytest.mark.parametrize("sp", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_prefix_cache_hits_change_no_int8_stream(int8_runner, model_dir, sp):
    """Four prompts behind one shared instruction: the first computes it, the other three (arriving later) read
    its blocks; their streams equal those of a run without the prefix cache, where each computes its own."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok(SHARED + t)["input_ids"] for t in TEXTS]
    requests = [(p, sp, 1, 0 if i == 0 else 4 + i) for i, p in enumerate(prompts)]
    hits = drive(int8_runner, requests)
    assert hits.scheduler.kv.prefix_hit_tokens == 3 * 2 * BLOCK_SIZE  # each later prompt reads 2 blocks
    misses = drive(int8_runner, requests, enable_prefix_caching=False)
    assert misses.scheduler.kv.prefix_hit_tokens == 0
    same_streams(hits, misses, sp)


def test_parallel_samples_share_and_copy_their_partial_block(int8_runner, prompts, undisturbed):
    """n = 2: the prompt is computed once and its partial last block shared, then copied on the first write.
    Greedy, both samples are the one greedy stream; seeded, sample i draws as a lone request seeded seed + i."""
    prompt = next(p for p in prompts if len(p) % BLOCK_SIZE)  # a partial last block to share
    index = f"r{prompts.index(prompt)}"
    forked = drive(int8_runner, [(prompt, GREEDY, 2, 0), (prompt, SEEDED, 2, 0)])
    assert forked.num_copies >= 2
    for sample in (0, 1):
        same_stream(forked, "r0", undisturbed[GREEDY], index, GREEDY, got_index=sample)
    alone = drive(int8_runner, [(prompt, SEEDED, 1, 0), (prompt, dataclasses.replace(SEEDED, seed=SEEDED.seed + 1), 1, 0)])
    for sample in (0, 1):
        same_stream(forked, "r1", alone, f"r{sample}", SEEDED, got_index=sample)
    assert forked.outputs["r1"][0] != forked.outputs["r1"][1]


def test_a_copy_on_write_that_drops_the_scales_changes_a_forked_sample(int8_runner, prompts, undisturbed, monkeypatch):
    """The check above has teeth: the copied partial block keeps the scales its device block held before."""
    monkeypatch.setattr(KVPool, "copy_blocks", lambda self, copies, backend: backend.copy_blocks(self.kv, copies))
    prompt = next(p for p in prompts if len(p) % BLOCK_SIZE)
    stale_scales(int8_runner)
    forked = drive(int8_runner, [(prompt, GREEDY, 2, 0)])
    assert forked.num_copies == 1
    with pytest.raises(AssertionError, match="differ"):
        for sample in (0, 1):
            same_stream(forked, "r0", undisturbed[GREEDY], f"r{prompts.index(prompt)}", GREEDY, got_index=sample)
