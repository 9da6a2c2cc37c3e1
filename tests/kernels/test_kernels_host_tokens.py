"""The whole worker over cuda/paged_attention.cu built for the host: token-identical to transformers on the CPU."""

from __future__ import annotations

import dataclasses
import random

import pytest

from tests.kernels.tokens import NEW, check_greedy_tokens, save_kernel_tiny
from pagedserve_cli.bench.local_driver import GREEDY, LocalDriver
from worker_svc.attention.cupy_backend import CupyAttentionBackend
from worker_svc.batch import PersistentBatch
from worker_svc.kv_pool import KVPool
from worker_svc.models import load_model
from worker_svc.runner import ModelRunner

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def kernel_model_dir(tmp_path_factory) -> str:
    return save_kernel_tiny(tmp_path_factory.mktemp("kernel-tiny"))


@pytest.mark.parametrize("chunk", [512, 7])
def test_kernel_host_backend_greedy_matches_transformers(kernel_model_dir, launcher, chunk):
    # partition_size 64: contexts past 64 tokens split their decode over two CTAs, so the reduce pass runs too.
    backend = CupyAttentionBackend(launcher, num_threads=64, partition_size=64, poison_workspace=True)
    check_greedy_tokens(kernel_model_dir, backend, "cpu", chunk)
    names = {name for name, _, _ in launcher.launches}
    assert {"write_kv_f32", "paged_decode_f32_d64", "paged_decode_reduce_f32_d64", "paged_prefill_f32_d64",
            "copy_blocks_u128"} <= names, names
    assert backend._fallback is None  # every attention call ran the kernels


def test_kernel_host_backend_is_batch_invariant_in_the_worker(kernel_model_dir, launcher):
    """The worker over the kernels with batch_invariant: four prompts' greedy tokens and their logprobs are the same
    bits alone (one prompt at a time, in one chunk) as crowded (beside each other and random requests, in 16-token
    chunks) and preempted (7-token chunks, a pool small enough to preempt and recompute). (Without batch_invariant,
    min_partition 16, the crowded decodes split by the batch: 22 of the 96 logprobs differed when this was written;
    test_kernels_host_invariant.py checks the fast mode's difference at the kernel.)"""
    loaded = load_model(kernel_model_dir, dtype="float32")
    backend = CupyAttentionBackend(launcher, num_threads=64, batch_invariant=True)
    greedy = dataclasses.replace(GREEDY, logprobs=0)
    rng = random.Random(48)
    prompts = [[rng.randrange(512) for _ in range(n)] for n in (9, 40, 75, 23)]

    def run(num_blocks: int, budget: int, crowded: bool):
        runner = ModelRunner(loaded, KVPool(loaded.kv_geometry(16, "auto"), num_blocks), backend)
        runner.batch = PersistentBatch()
        driver = LocalDriver(runner, max_num_batched_tokens=budget)
        ids = []
        for i, p in enumerate(prompts):
            if crowded:
                driver.add([rng.randrange(512) for _ in range(rng.randint(5, 60))], rng.randint(4, 12),
                           arrival_step=i)
            ids.append(driver.add(p, NEW, greedy, arrival_step=i if crowded else 1000 * i))
        out = driver.run()
        logprobs = [[pos.sampled.logprob for pos in driver.logprobs[r][0]] for r in ids]
        return [out[r][0] for r in ids], logprobs, driver.scheduler.num_preemptions, runner.batch_invariant_reason

    alone = run(64, 512, crowded=False)
    crowded = run(64, 16, crowded=True)  # decodes beside each other, 16-token chunks between them
    preempted = run(8, 7, crowded=True)
    assert alone[3] == ""  # the runner is batch invariant ('' : no reason it is not)
    assert preempted[2] > 0  # the small pool really preempted and recomputed
    for case in (crowded, preempted):
        assert case[0] == alone[0]
        assert case[1] == alone[1]  # float equality: the same bits

