"""Prompt logprobs from the real worker (worker_svc.prompt_logprobs) driven by the real scheduler (LocalDriver):
transformers' float32 log_softmax over the same prompt within 1e-4, and bit-identical whatever the chunking, the batch,
a preemption or a migration (the lean forward is batch invariant)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from pagedserve_cli.bench.local_driver import GREEDY, LocalDriver
from tests.support.worker import PATHS, make_runner, reference_model

TOL = 1e-4
PROMPT = [random.Random(1).randrange(512) for _ in range(45)]


def reference(model_dir: str, prompt: list[int]) -> torch.Tensor:
    """transformers' float32 log_softmax at every prompt row: row j scores the token at position j + 1."""
    with torch.inference_mode():
        logits = reference_model(model_dir)(torch.tensor([prompt])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


def prompt_logprobs(driver: LocalDriver, prompt: list[int], num_top: int, **kw) -> list:
    rid = driver.add(prompt, 2, dataclasses.replace(GREEDY, prompt_logprobs=num_top), **kw)
    driver.run()
    return driver.requests[rid].prompt_log.for_client()


def max_error(got: list, ref: torch.Tensor, prompt: list[int], num_top: int) -> float:
    """The largest |logprob - transformers'| over every prompt token and every top entry; checks the tokens,
    the top entries' order and the ranks (within the tolerance: a near tie may order either way)."""
    assert len(got) == len(prompt) and got[0] is None
    worst = 0.0
    for p in range(1, len(prompt)):
        lp, row = got[p], ref[p - 1]
        assert lp.sampled.token_id == prompt[p]
        worst = max(worst, abs(lp.sampled.logprob - row[prompt[p]].item()))
        assert (row > lp.sampled.logprob + TOL).sum() + 1 <= lp.rank <= (row >= lp.sampled.logprob - TOL).sum()
        assert len(lp.top) == num_top
        ref_top = row.topk(num_top).values
        for t, want in zip(lp.top, ref_top):
            worst = max(worst, abs(t.logprob - row[t.token_id].item()), abs(t.logprob - want.item()))
    return worst


@pytest.mark.parametrize("path", PATHS)
def test_prompt_logprobs_are_transformers_float32_ones_whatever_the_chunking(tiny_llama_dir, path):
    ref = reference(tiny_llama_dir, PROMPT)
    runs = [prompt_logprobs(LocalDriver(make_runner(tiny_llama_dir, path=path), max_num_batched_tokens=budget),
                            PROMPT, 4) for budget in (256, 16, 7)]
    assert max_error(runs[0], ref, PROMPT, 4) <= TOL
    if path == "lean+cpu":  # NOTE: batch invariant: a chunk's rows give the same bits as the whole prompt's
        assert runs[1] == runs[0] and runs[2] == runs[0]
    else:
        assert max(max_error(r, ref, PROMPT, 4) for r in runs[1:]) <= TOL


def test_a_crowded_batch_a_preemption_and_a_migration_change_no_bit(tiny_llama_dir):
    alone = prompt_logprobs(LocalDriver(make_runner(tiny_llama_dir)), PROMPT, 2)
    rng = random.Random(3)
    # 6 blocks of 16 tokens: the other requests' decodes preempt the one asking (recompute)
    crowded = LocalDriver(make_runner(tiny_llama_dir, num_blocks=6), max_num_batched_tokens=12)
    for i in range(3):
        crowded.add([rng.randrange(512) for _ in range(rng.randint(3, 20))], 30, arrival_step=i)
    rid = crowded.add(PROMPT, 2, dataclasses.replace(GREEDY, prompt_logprobs=2), arrival_step=1)
    crowded.run()
    assert crowded.requests[rid].num_preemptions >= 1
    assert crowded.requests[rid].prompt_log.for_client() == alone
    # lost mid-prefill: its positions so far stay, the rest come from the new worker, none twice
    first = LocalDriver(make_runner(tiny_llama_dir), max_num_batched_tokens=10)
    rid = first.add(PROMPT, 2, dataclasses.replace(GREEDY, prompt_logprobs=2))
    first.run(max_steps=2)
    assert len(first.requests[rid].prompt_log.positions) == 20
    second = LocalDriver(make_runner(tiny_llama_dir), max_num_batched_tokens=10)
    first.move_to(second)
    second.run()
    assert second.requests[rid].prompt_log.for_client() == alone


def test_n_samples_share_one_computation_and_a_prefix_hit_is_not_taken(tiny_llama_dir):
    alone = prompt_logprobs(LocalDriver(make_runner(tiny_llama_dir)), PROMPT, 1)
    d = LocalDriver(make_runner(tiny_llama_dir))
    d.add(PROMPT, 3)  # fills the prefix cache with the prompt's blocks
    d.run()
    rid = d.add(PROMPT, 3, dataclasses.replace(GREEDY, temperature=1.0, seed=5, prompt_logprobs=1), n=3)
    d.run()
    req = d.requests[rid]
    assert req.num_cached_prompt_tokens == 0 and req.prompt_log.for_client() == alone
    assert all(c.prompt_log is req.prompt_log for c in req.children) and len(req.children) == 3
