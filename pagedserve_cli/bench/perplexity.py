"""Teacher-forced perplexity through the worker's real runner, paged KV pool and attention backend, per cache dtype."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass

import torch

from pagedserve_common.step import NewSequence, SequenceDelta, StepPlan


@dataclass(slots=True)
class Scored:
    """Next-token negative log-likelihoods summed over the scored tokens."""

    num_tokens: int = 0
    nll_sum: float = 0.0

    kl_sum: float = 0.0  # summed KL(p_reference || p_this) over the same tokens (compare() fills it)

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll_sum / self.num_tokens) if self.num_tokens else float("nan")

    @property
    def mean_kl(self) -> float:
        return self.kl_sum / self.num_tokens if self.num_tokens else float("nan")


def scoring_runner(model_dir: str, kv_cache_dtype: str = "auto", attention_backend: str = "auto",
                   kv_memory: int = 256 << 20, threads: int | None = None, dtype: str = "float32"):
    """A worker's ModelRunner as `pagedserve worker` builds it (create_runner), for one cache dtype and the weights'
    `dtype`. NOTE: float32 unless asked, not the worker's `auto`, which depends on the CPU: a figure measured
    against float32 stays one on every machine."""
    from worker_svc.worker import WorkerConfig, create_runner

    cfg = WorkerConfig(model=model_dir, dtype=dtype, kv_cache_dtype=kv_cache_dtype,
                       attention_backend=attention_backend, kv_memory=kv_memory, threads=threads)
    runner, _ = create_runner(cfg)
    return runner


def sibling_runner(runner, kv_cache_dtype: str, attention_backend: str = "auto", num_blocks: int | None = None,
                   backend=None):
    """A runner on `runner`'s model with its own pool (of `kv_cache_dtype`, num_blocks blocks, as many as
    runner's by default) and backend (`backend`, else make_backend(attention_backend)), built as create_runner
    builds them.

    NOTE: the weights (and the lean forward's fused copies) are shared, not loaded again: six cache dtypes side by
    side would otherwise hold six copies of the model. A runner's cache dtype lives only in its pool and backend.
    """
    from worker_svc.kv_pool import KVPool
    from worker_svc.runner import ModelRunner
    from worker_svc.worker import make_backend

    geometry = runner.loaded.kv_geometry(runner.pool.geometry.block_size, kv_cache_dtype)
    pool = KVPool(geometry, num_blocks or runner.pool.num_blocks, str(runner.device))
    backend = backend or make_backend(attention_backend, str(runner.device), geometry)
    sibling = ModelRunner(runner.loaded, pool, backend, lean=False)
    sibling.lean, sibling.lean_skip_reason = runner.lean, runner.lean_skip_reason
    return sibling


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
        blocks = runner.pool.groups.table(range(-(-len(tokens) // bs)))
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


def kl_sum(p_logits: torch.Tensor, q_logits: torch.Tensor, rows: int = 128) -> float:
    """Summed KL(p || q) of the next-token distributions of each row of two [n, vocab] logits, in float64.
    NOTE: `rows` rows at a time: a window's [n, vocab] float64 log-probabilities would be n x 400 KB each."""
    total = 0.0
    for i in range(0, len(p_logits), rows):
        logp = torch.log_softmax(p_logits[i:i + rows].double(), dim=-1)
        logq = torch.log_softmax(q_logits[i:i + rows].double(), dim=-1)
        total += float((logp.exp() * (logp - logq)).sum())
    return total


def compare(runners: Mapping[str, object], reference: str, token_ids: Sequence[int], window: int = 1024,
            chunk: int = 256, progress: Callable[[dict[str, Scored]], None] | None = None) -> dict[str, Scored]:
    """Each runner's perplexity of `token_ids` and its KL against runners[reference], window by window.

    The runners score the same window in turn (each on its own pool), so only the reference's and one other's
    logits of one window are ever held: never the text's distributions. The reference's kl_sum stays 0.
    progress(scored so far) is called after each window.
    """
    if reference not in runners:
        raise ValueError(f"the reference {reference!r} is not among the runners {sorted(runners)}")
    others = {name: window_logits(r, token_ids, window, chunk) for name, r in runners.items() if name != reference}
    scored = {name: Scored() for name in runners}
    for tokens, ref_logits in window_logits(runners[reference], token_ids, window, chunk):
        for name in [reference, *others]:
            logits = ref_logits if name == reference else next(others[name])[1]
            s = scored[name]
            s.num_tokens += len(tokens) - 1
            s.nll_sum += nll(logits, tokens[1:])
            if name != reference:
                s.kl_sum += kl_sum(ref_logits, logits)
            del logits
        if progress is not None:
            progress(scored)
    for gen in others.values():  # NOTE: runs each generator's last plan (its final window's sequence dropped)
        for _ in gen:
            raise AssertionError("a runner scored more windows than the reference")
    return scored


def perplexity(runner, token_ids: Sequence[int], window: int = 1024, chunk: int = 256) -> Scored:
    scored = Scored()
    for tokens, logits in window_logits(runner, token_ids, window, chunk):
        scored.num_tokens += len(tokens) - 1
        scored.nll_sum += nll(logits, tokens[1:])
    return scored
