"""Penalised streams through the real scheduler and runner (plans and results through protobuf): exact against a
float64 reference, and unchanged by recompute and swap preemption and by a migration to another worker mid-way; the
runner's bitmasks: sampled inside, winning over the other masks, raw logprobs, and a bad one refused."""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from pagedserve.v1 import worker_pb2
from pagedserve_common.sampling import SamplingParams
from pagedserve_common.step import NewSequence, SequenceDelta, StepPlan
from pagedserve_common.wire import plan_from_pb, plan_to_pb, result_from_pb, result_to_pb
from scheduler_svc.core.request import Request
from scheduler_svc.core.config import SchedulerConfig
from scheduler_svc.core.scheduler import Scheduler
from pagedserve_cli.bench.local_driver import LocalDriver
from tests.support.worker import (assert_same_within_ties, make_runner, pack_bitmask, reference_model, reference_rules,
                                  swap_runner)
from worker_svc.batch import BadPlan

NEW = 48
PROMPTS = [[random.Random(i).randrange(3, 512) for _ in range(random.Random(100 + i).randint(4, 30))]
           for i in range(6)]
PENALISED = SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.5, frequency_penalty=0.4,
                           logit_bias=((7, 3.0), (11, -2.0)), bad_words_token_ids=((8, 9), (13,)), min_tokens=2)
SEEDED = dataclasses.replace(PENALISED, temperature=0.8, top_p=0.95, seed=1234)


def drive(runner, sp: SamplingParams, num_blocks_used: int | None = None, num_cpu_blocks: int = 0,
          max_num_batched_tokens: int = 64) -> tuple[dict[str, list[list[int]]], int]:
    """(outputs by request, preemptions): all PROMPTS at once through LocalDriver."""
    runner.reset()  # NOTE: the last finished sequences of an earlier run were never dropped (no plan after them)
    driver = LocalDriver(runner, max_num_batched_tokens=max_num_batched_tokens, num_cpu_blocks=num_cpu_blocks)
    if num_blocks_used is not None:
        driver.scheduler = Scheduler(dataclasses.replace(driver.scheduler.config, num_blocks=num_blocks_used))
    for p in PROMPTS:
        driver.add(p, NEW, sp)
    return driver.run(), driver.scheduler.num_preemptions


@pytest.fixture(scope="module")
def tiny_llama_runner(tiny_llama_dir):
    return swap_runner(tiny_llama_dir)


@pytest.fixture(scope="module")
def unpreempted(tiny_llama_runner) -> dict[SamplingParams, dict[str, list[list[int]]]]:
    """Each setting's outputs with room for every sequence: nothing preempted, nothing migrated."""
    out = {}
    for sp in (PENALISED, SEEDED):
        outputs, num_preemptions = drive(tiny_llama_runner, sp)
        assert num_preemptions == 0
        out[sp] = outputs
    return out


def test_a_penalised_greedy_run_matches_the_float64_reference(tiny_llama_dir, unpreempted):
    model = reference_model(tiny_llama_dir)
    plain, _ = drive(make_runner(tiny_llama_dir, num_blocks=64), SamplingParams(temperature=0.0))
    assert plain != unpreempted[PENALISED]  # the penalties change the output
    for i, prompt in enumerate(PROMPTS):
        assert_same_within_ties(unpreempted[PENALISED][f"r{i}"][0], *reference_rules(model, prompt, PENALISED, NEW))


@pytest.mark.parametrize("sp", [PENALISED, SEEDED], ids=["greedy", "seeded"])
@pytest.mark.parametrize("num_cpu_blocks", [0, 32], ids=["recompute", "swap"])
def test_preemption_changes_no_penalised_stream(tiny_llama_runner, unpreempted, sp, num_cpu_blocks):
    # 12 blocks of 16 tokens for 6 sequences of up to 78: they preempt each other many times
    outputs, num_preemptions = drive(tiny_llama_runner, sp, num_blocks_used=12, num_cpu_blocks=num_cpu_blocks)
    assert num_preemptions > 0
    assert outputs == unpreempted[sp]


def roundtrip(plan):
    return plan_from_pb(worker_pb2.StepPlan.FromString(plan_to_pb(plan).SerializeToString()))


@pytest.mark.parametrize("sp", [PENALISED, SEEDED], ids=["greedy", "seeded"])
def test_a_migration_mid_way_changes_no_penalised_stream(tiny_llama_dir, tiny_llama_runner, unpreempted, sp):
    """Every request is released by its worker mid-generation (as when the worker dies) and recomputed on
    another tiny_llama_runner of its own, which rebuilds each sequence's counts from its tokens."""
    seq_ids = itertools.count()
    config = SchedulerConfig(num_blocks=64, max_model_len=512, block_size=16, max_num_batched_tokens=64)
    first, second = Scheduler(config, seq_ids), Scheduler(config, seq_ids)
    other = make_runner(tiny_llama_dir, num_blocks=64, block_size=16)
    reqs = [Request(f"r{i}", p, dataclasses.replace(sp, max_tokens=NEW)) for i, p in enumerate(PROMPTS)]
    for r in reqs:
        first.add_request(r)
    tiny_llama_runner.reset()

    def step(sched, worker) -> None:
        scheduled = sched.schedule()
        if scheduled is not None:
            sched.update(scheduled, result_from_pb(result_to_pb(worker.step(roundtrip(scheduled.plan)))).sampled)

    while min(len(r.output_token_ids) for r in reqs) < NEW // 3:
        step(first, tiny_llama_runner)
    in_flight = first.schedule()  # a step in flight when the worker goes: lost with it
    for r in first.release_all(in_flight):
        second.adopt(r)
    tiny_llama_runner.reset()
    while second.has_unfinished_requests():
        step(second, other)
    assert {r.request_id: [list(r.output_token_ids)] for r in reqs} == unpreempted[sp]


def pack(allowed: list[int]) -> bytes:
    return pack_bitmask(allowed, 512)


def test_the_runner_samples_inside_each_bitmask_and_refuses_a_bad_one(tiny_llama_runner):
    tiny_llama_runner.reset()
    greedy, seeded = SamplingParams(temperature=0.0, logprobs=1), SamplingParams(temperature=1.0, seed=3)
    bad_first = dataclasses.replace(greedy, bad_words_token_ids=((300,),))
    prompt = [5, 6, 7]
    plan = StepPlan(0, new_seqs=[NewSequence(0, prompt, [0], 0, 3, greedy, 0, 3),
                                 NewSequence(1, prompt, [1], 0, 3, seeded, 3, 3),
                                 NewSequence(2, prompt, [2], 0, 3, bad_first, 0, 3),
                                 NewSequence(3, prompt, [3], 0, 3, greedy, 0, 3)],
                    token_bitmasks={0: pack([100, 200]), 1: pack([100, 200]), 2: pack([300])})
    result = tiny_llama_runner.step(plan)
    assert result.sampled[0] in (100, 200) and result.sampled[1] in (100, 200)
    assert result.sampled[2] == 300  # the bad word leaves the bitmask nothing: the bitmask wins
    # logprobs are the raw distribution's: its most likely token is the unconstrained greedy one
    assert result.logprobs[0].top[0].token_id == result.sampled[3] == result.logprobs[3].top[0].token_id
    assert result.logprobs[0].sampled.token_id == result.sampled[0]
    running = [SequenceDelta(i, [], 1) for i in range(4)]
    with pytest.raises(BadPlan, match="token_bitmasks: seq 0: the bitmask has 4 bytes; a vocabulary of 512 takes 64"):
        tiny_llama_runner.step(StepPlan(1, running=running, token_bitmasks={0: b"\xff" * 4}))
    with pytest.raises(BadPlan, match="token_bitmasks: seq 1: the bitmask allows no token"):
        tiny_llama_runner.step(StepPlan(1, running=running, token_bitmasks={1: pack([])}))
    with pytest.raises(BadPlan, match="token_bitmasks: seq 7 is not in this plan"):
        tiny_llama_runner.step(StepPlan(1, running=running, token_bitmasks={7: pack([1])}))
    assert sorted(tiny_llama_runner.batch.seqs) == [0, 1, 2, 3]  # refused plans changed nothing
    assert all(len(s.token_ids) == 4 for s in tiny_llama_runner.batch.seqs.values())
    assert set(tiny_llama_runner.step(StepPlan(1, running=running, token_bitmasks={3: pack([42])})).sampled.items()) >= {(3, 42)}
