"""Greedy agreement of a cache dtype with the float32 cache: held-out prompts decoded through the real runner."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from pagedserve_common.sampling import SamplingParams
from pagedserve_common.step import NewSequence, SequenceDelta, StepPlan

GREEDY = SamplingParams(temperature=0.0)


@dataclass(slots=True)
class Agreement:
    """Positions where a run's greedy tokens equal the reference's, and where each prompt first diverged."""

    num_prompts: int = 0
    num_positions: int = 0
    num_equal: int = 0
    first_divergence_sum: int = 0  # per prompt: tokens before the first differing one (all of them if none)

    @property
    def share(self) -> float:
        return self.num_equal / self.num_positions if self.num_positions else float("nan")

    @property
    def mean_first_divergence(self) -> float:
        return self.first_divergence_sum / self.num_prompts if self.num_prompts else float("nan")


def held_out_prompts(token_ids: Sequence[int], start: int, num_prompts: int = 64,
                     prompt_len: int = 64) -> list[list[int]]:
    """num_prompts prompts of prompt_len tokens, spread evenly over token_ids[start:] (the text past the slice
    perplexity scores, so no prompt was scored)."""
    stride = (len(token_ids) - start) // num_prompts
    if stride < prompt_len:
        raise ValueError(f"{len(token_ids) - start} held-out tokens cannot give {num_prompts} disjoint "
                         f"{prompt_len}-token prompts")
    return [list(token_ids[start + i * stride:start + i * stride + prompt_len]) for i in range(num_prompts)]


def greedy_tokens(runner, prompts: Sequence[Sequence[int]], num_new: int = 128,
                  batch: int = 16) -> list[list[int]]:
    """Each prompt's num_new greedy tokens, decoded `batch` prompts at a time through ModelRunner.step: one
    prefill step, then one decode step per token, as the scheduler drives a worker (EOS does not stop them)."""
    bs, table = runner.pool.geometry.block_size, runner.pool.groups.table
    out: list[list[int]] = []
    step_id = 0
    for first in range(0, len(prompts), batch):
        group = prompts[first:first + batch]
        need = [-(-(len(p) + num_new) // bs) for p in group]  # logical blocks: one block per KV group each
        num_needed = len(table(range(sum(need))))
        if num_needed > runner.pool.num_blocks:
            raise ValueError(f"{len(group)} prompts of {num_new} new tokens need {num_needed} blocks; the pool "
                             f"has {runner.pool.num_blocks}")
        new_seqs, next_block = [], 0
        for i, (p, n) in enumerate(zip(group, need)):
            new_seqs.append(NewSequence(first + i, list(p), table(range(next_block, next_block + n)), 0, len(p),
                                        GREEDY, num_prompt_tokens=len(p)))
            next_block += n
        ids = [s.seq_id for s in new_seqs]
        tokens = {sid: [] for sid in ids}
        plan = StepPlan(step_id, new_seqs=new_seqs)
        for _ in range(num_new):
            for sid, tok in runner.step(plan).sampled.items():
                tokens[sid].append(tok)
            step_id += 1
            plan = StepPlan(step_id, running=[SequenceDelta(sid, [], 1) for sid in ids])
        runner.step(StepPlan(step_id, finished_seq_ids=ids))
        step_id += 1
        out.extend(tokens[sid] for sid in ids)
    return out


def agreement(reference: Sequence[Sequence[int]], runs: Sequence[Sequence[int]]) -> Agreement:
    """How far each run follows its reference run, position by position."""
    a = Agreement()
    for ref, run in zip(reference, runs, strict=True):
        if len(ref) != len(run):
            raise ValueError(f"runs of {len(ref)} and {len(run)} tokens")
        same = [x == y for x, y in zip(ref, run)]
        a.num_prompts += 1
        a.num_positions += len(same)
        a.num_equal += sum(same)
        a.first_divergence_sum += same.index(False) if False in same else len(same)
    return a
