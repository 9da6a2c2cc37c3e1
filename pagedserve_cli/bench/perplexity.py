"""Teacher-forced perplexity through the worker's real runner, paged KV pool and attention backend, per cache dtype."""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

from pagedserve_common.step import NewSequence, SequenceDelta, StepPlan


@dataclass(slots=True)
class Scored:
    """Next-token negative log-likelihoods summed over the scored tokens."""

    num_tokens: int = 0
    nll_sum: float = 0.0

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_sum / self.num_tokens) if self.num_tokens else float("nan")


def scoring_runner(model_dir: str, kv_cache_dtype: str = "auto", attention_backend: str = "auto",
                   kv_memory: int = 256 << 20, threads: int | None = None):
    """A worker's ModelRunner as `pagedserve worker` builds it (create_runner), for one cache dtype."""
    from worker_svc.worker import WorkerConfig, create_runner

    cfg = WorkerConfig(model=model_dir, kv_cache_dtype=kv_cache_dtype, attention_backend=attention_backend,
                       kv_memory=kv_memory, threads=threads)
    runner, _ = create_runner(cfg)
    return runner


def window_logits(runner, token_ids: Sequence[int], window: int = 1024,
                  chunk: int = 256) -> Iterator[tuple[list[int], torch.Tensor]]:
    """Yields (window's tokens, float32 [len - 1, vocab] logits predicting tokens 1..len-1) for each window.

    The text is cut into windows of `window` tokens; each window is one sequence, prefilled `chunk` tokens per
    step, so every chunk after the first attends to the KV the earlier chunks left in the pool: through the
    8-bit cache, for an 8-bit runner. NOTE: a window reuses the block ids of the one before (dropped first).
    """
    bs = runner.pool.geometry.block_size
    step_id, prev = 0, None
    for seq_id, start in enumerate(range(0, len(token_ids) - 1, window)):
        tokens = list(token_ids[start:start + window])
        if len(tokens) < 2:
            break
        blocks = list(range(-(-len(tokens) // bs)))
        if len(blocks) > runner.pool.num_blocks:
            raise ValueError(f"a {len(tokens)}-token window needs {len(blocks)} blocks; the pool has "
                             f"{runner.pool.num_blocks}")
        parts, done = [], 0
        while done < len(tokens):
            n = min(chunk, len(tokens) - done)
            if done == 0:
                plan = StepPlan(step_id, new_seqs=[NewSequence(seq_id, tokens, blocks, 0, n)],
                                finished_seq_ids=[] if prev is None else [prev])
            else:
                plan = StepPlan(step_id, running=[SequenceDelta(seq_id, [], n)])
            parts.append(runner.score(plan))
            step_id, done = step_id + 1, done + n
        prev = seq_id
        yield tokens, torch.cat(parts)[:-1]
    if prev is not None:
        runner.score(StepPlan(step_id, finished_seq_ids=[prev]))


def nll(logits: torch.Tensor, targets: Sequence[int]) -> float:
    """Summed next-token negative log-likelihood of `targets` under float32 `logits` [len(targets), vocab]."""
    logp = torch.log_softmax(logits.double(), dim=-1)
    return float(-logp[torch.arange(len(targets)), torch.tensor(targets)].sum())


def perplexity(runner, token_ids: Sequence[int], window: int = 1024, chunk: int = 256) -> Scored:
    scored = Scored()
    for tokens, logits in window_logits(runner, token_ids, window, chunk):
        scored.num_tokens += len(tokens) - 1
        scored.nll_sum += nll(logits, tokens[1:])
    return scored
