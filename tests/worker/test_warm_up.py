"""The worker's warm-up at start: it runs real steps (prefill, a prefix hit, decode, both sampler paths) on both
forward paths, and leaves nothing behind: a request afterwards gets exactly what it gets from a fresh runner."""

from __future__ import annotations

import random

import pytest

from pagedserve_common.sampling import SamplingParams
from pagedserve_cli.bench.local_driver import LocalDriver
from tests.support.worker import PATHS, make_runner
from worker_svc.warm_up import warm_up, warm_up_plans


@pytest.mark.parametrize("path", PATHS)
def test_the_warm_up_runs_real_steps_and_leaves_no_trace(tiny_llama_dir, path):
    warmed = make_runner(tiny_llama_dir, path=path)
    ticks = []  # NOTE: the thread governor's tick, so that the thread count settles before the first request
    steps, seconds = warm_up(warmed, lambda: ticks.append(len(warmed.batch.seqs)))
    assert steps == len(warm_up_plans(16, 64, 512)) == len(ticks) >= 4 and seconds > 0
    assert ticks[:3] == [1, 2, 2]  # after A's prefill, then beside B
    assert not warmed.batch.seqs  # its sequences are forgotten
    prompt = [random.Random(3).randrange(512) for _ in range(40)]
    outputs = []
    for runner in (warmed, make_runner(tiny_llama_dir, path=path)):
        driver = LocalDriver(runner)
        ids = [driver.add(prompt, 12, SamplingParams(temperature=0.0)),
               driver.add(prompt, 12, SamplingParams(temperature=1.0, seed=5))]
        done = driver.run()
        outputs.append([done[i][0] for i in ids])
    assert outputs[0] == outputs[1]


def test_the_plans_exercise_prefill_a_prefix_hit_and_decode():
    plans = warm_up_plans(block_size=16, num_blocks=64, vocab_size=512)
    first, mixed, *decodes, last = plans
    (a,) = first.new_seqs
    assert a.num_computed_tokens == 0 and len(a.token_ids) > 16  # a prompt over more than one block
    (b,) = mixed.new_seqs
    assert b.num_computed_tokens == 16 and b.block_ids[0] == a.block_ids[0]  # A's first block, cached
    assert b.token_ids[:16] == a.token_ids[:16] and not b.sampling.greedy and a.sampling.greedy
    assert all(d.num_seqs == 2 and d.num_scheduled_tokens == 2 for d in decodes) and decodes
    assert sorted(last.finished_seq_ids) == [0, 1]
    assert warm_up_plans(block_size=16, num_blocks=2, vocab_size=512) == []  # a pool too small: none


def test_with_kv_groups_each_logical_block_takes_one_block_per_group():
    from pagedserve_common.kv_geometry import KVGroups

    groups = KVGroups.of((512, 512, 0))  # one full layer, two sliding ones: 1 layer a group, 3 groups
    first, mixed, *_ = warm_up_plans(block_size=16, num_blocks=64, vocab_size=512, groups=groups)
    assert first.new_seqs[0].block_ids == [0, 1, 2, 3, 4, 5]  # logical 0: 0, 1, 2; logical 1: 3, 4, 5
    assert mixed.new_seqs[0].block_ids == [0, 1, 2, 6, 7, 8]  # A's first logical block shared, then its own
    assert warm_up_plans(block_size=16, num_blocks=8, vocab_size=512, groups=groups) == []  # 9 blocks needed
