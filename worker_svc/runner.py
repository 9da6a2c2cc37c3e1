"""Runs one step: applies the plan, packs all scheduled tokens into one forward, samples."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pagedserve_common.step import StepPlan, StepResult
from worker_svc.attention import AttentionBackend, AttentionMetadata
from worker_svc.batch import BadPlan, PersistentBatch, check_plan
from worker_svc.kv_pool import KVPool
from worker_svc.lean_build import build_lean
from worker_svc.logits import LogitsProcessor
from worker_svc.models import LoadedModel
from worker_svc.prompt_logprobs import PromptRows
from worker_svc.sampling import Sampler
from worker_svc.speculative import Verification


@dataclass(slots=True)
class StepContext:
    """What the attention hook needs, passed through the model's forward kwargs."""

    kv: torch.Tensor  # the whole pool: [layers_per_group, 2, num_blocks, block_size, kv_heads, head_dim]
    meta: AttentionMetadata  # group 0's (the only one of a model with one KV group)
    backend: AttentionBackend
    kv_scales: torch.Tensor | None = None  # an 8-bit cache's [layers_per_group, 2, num_blocks, block_size, kv_heads]
    # KV groups (KVPool): each group's metadata (its column of the block tables) and each layer's (group, slot);
    # () for one group, where layer i is slot i and every layer reads `meta`.
    group_metas: tuple[AttentionMetadata, ...] = ()
    layer_slots: tuple[tuple[int, int], ...] = ()

    def layer(self, i: int) -> tuple[torch.Tensor, torch.Tensor | None, AttentionMetadata]:
        """Layer i's pool view [2, nb, bs, kvh, hd], its scales (None for a float cache) and its group's metadata."""
        meta = self.meta
        if self.layer_slots:
            group, i = self.layer_slots[i]
            meta = self.group_metas[group]
        return self.kv[i], None if self.kv_scales is None else self.kv_scales[i], meta

    @classmethod
    def build(cls, pool: KVPool, backend: AttentionBackend, query_lens: np.ndarray, seq_lens: np.ndarray,
              block_tables: list[list[int]]) -> StepContext:
        """The step's context over `pool`: one AttentionMetadata per KV group, from its column of each table
        (entries i * num_groups + g are group g's: scheduler_svc.kv.manager.KVCacheManager)."""
        groups, bs, device = pool.groups, pool.geometry.block_size, pool.kv.device
        ng = groups.num_groups
        if ng == 1:
            return cls(pool.kv, AttentionMetadata.build(query_lens, seq_lens, block_tables, bs, device), backend,
                       pool.scales)
        metas = tuple(AttentionMetadata.build(query_lens, seq_lens, [t[g::ng] for t in block_tables], bs, device)
                      for g in range(ng))
        return cls(pool.kv, metas[0], backend, pool.scales, metas, groups.layer_slots)


class ModelRunner:
    """lean=True runs supported models through LeanModel (fused weights, no HF modules); False, or a model it
    does not support, runs the transformers modules with the pagedserve attention hook."""

    def __init__(self, loaded: LoadedModel, pool: KVPool, backend: AttentionBackend, lean: bool = True,
                 batch_invariant: bool = True) -> None:
        self.loaded = loaded
        self.pool = pool
        self.backend = backend
        self.sampler = Sampler()
        self.logits_processor = LogitsProcessor(loaded.vocab_size, loaded.eos_token_ids)
        self.batch = PersistentBatch()
        self.device = pool.kv.device
        self.lean, self.lean_skip_reason = build_lean(loaded, batch_invariant) if lean else (None, "disabled")
        self._invariant_asked = batch_invariant

    @property
    def batch_invariant(self) -> bool:
        """Whether a sequence's logits are independent of the batch: the lean forward on M-invariant kernels and an
        attention backend that keeps every row on one path (the CPU kernel's batch_invariant)."""
        return not self.batch_invariant_reason

    @property
    def batch_invariant_reason(self) -> str:
        """Why the runner is not batch invariant ('' where it is)."""
        if not self._invariant_asked:
            return "--batch-invariant off"
        if self.lean is None:
            return f"the transformers forward ({self.lean_skip_reason})"
        if not self.lean.batch_invariant:
            return ("a matmul or norm without an M-invariant kernel here (a CPU: or the float32 copies did not fit; a "
                    "GPU: no CuPy, or Gemma 3's norms)")
        if not getattr(self.backend, "batch_invariant", False):
            return f"the {getattr(self.backend, 'name', 'attention')} backend"
        return ""

    @property
    def forward_path(self) -> str:
        return "lean" if self.lean is not None else "transformers"

    def _logits(self, input_ids: torch.Tensor, positions: torch.Tensor, step: StepContext,
                keep: torch.Tensor) -> torch.Tensor:
        """[len(keep), vocab] logits of the rows `keep` of the packed forward."""
        if self.lean is not None:
            return self.lean.forward(input_ids, positions, step, keep)
        if self.loaded.runs_quantized:  # NOTE: its modules hold no weights (models.load_model)
            raise RuntimeError("this model's weights were kept quantised, which only the lean forward runs "
                               "(load_model(..., lean=False) dequantises them for the transformers forward)")
        out = self.loaded.model(input_ids=input_ids.unsqueeze(0), position_ids=positions.unsqueeze(0),
                                paged_step=step, logits_to_keep=keep, use_cache=False)
        return out.logits[0]

    def reset(self) -> None:
        """Forgets every sequence: the worker registers again with an empty pool (its KV data is never read
        again: the scheduler's new block tables start from nothing)."""
        self.batch = PersistentBatch()

    def _apply(self, plan: StepPlan) -> list:
        """Checks and applies a plan (block moves included); returns its scheduled sequences."""
        pool = self.pool
        check_plan(plan, self.batch.seqs, pool.num_blocks, pool.num_cpu_blocks, pool.geometry.block_size,
                   self.loaded.vocab_size, pool.groups)
        scheduled = self.batch.apply(plan)
        # NOTE: order matters: blocks swapped out this step may be reused as swap-in or copy targets.
        pool.swap_out(plan.swap_out)
        pool.swap_in(plan.swap_in)
        pool.copy_blocks(plan.copies, self.backend)
        return scheduled

    def _forward(self, scheduled: list, rows: Callable[[np.ndarray], np.ndarray]) -> torch.Tensor:
        """One packed forward of the scheduled tokens (their KV written into the pool): the logits of the packed
        rows rows(query_start_loc) picks."""
        q_lens = np.fromiter((s.num_scheduled_tokens for s in scheduled), np.int64, len(scheduled))
        starts = np.fromiter((s.num_computed_tokens for s in scheduled), np.int64, len(scheduled))
        step = StepContext.build(self.pool, self.backend, q_lens, starts + q_lens, [s.block_ids for s in scheduled])
        meta = step.meta
        input_ids = np.concatenate([np.asarray(s.token_ids[s.num_computed_tokens:s.num_computed_tokens
                                                          + s.num_scheduled_tokens]) for s in scheduled])
        keep = torch.from_numpy(rows(meta.query_start_loc_host)).to(self.device)
        return self._logits(torch.from_numpy(input_ids).to(self.device, torch.long),
                            torch.from_numpy(meta.positions_host).to(self.device, torch.long),
                            step, keep)

    @staticmethod
    def _advance(scheduled: list) -> None:
        for s in scheduled:
            s.num_computed_tokens += s.num_scheduled_tokens
            s.num_scheduled_tokens = 0

    def score(self, plan: StepPlan) -> torch.Tensor:
        """Teacher forcing: runs a plan like step() but samples nothing and returns EVERY scheduled token's
        next-token logits, float32 [plan.num_scheduled_tokens, vocab], packed in the plan's order (new_seqs, then
        running). Perplexity and KL measurements read the model through this, on the real pool and backend."""
        if any(d.draft_token_ids for d in plan.running):
            raise BadPlan("score() verifies no drafts: teacher forcing schedules known tokens only")
        scheduled = self._apply(plan)
        if not scheduled:
            return torch.empty((0, self.loaded.vocab_size))
        with torch.inference_mode():
            logits = self._forward(scheduled, lambda qsl: np.arange(qsl[-1])).float()
        self._advance(scheduled)
        return logits

    def step(self, plan: StepPlan) -> StepResult:
        """Runs one plan; raises BadPlan (and changes nothing) when the plan does not fit this worker. The
        result's step_seconds is this call's wall time."""
        t0 = time.perf_counter()
        scheduled = self._apply(plan)
        if not scheduled:
            return StepResult(plan.step_id, step_seconds=time.perf_counter() - t0)
        sampling_rows = [i for i, s in enumerate(scheduled) if s.samples_this_step]
        spec = Verification.of(scheduled, sampling_rows)  # speculating sequences: their rows after the samplers'
        if spec is not None:
            sampling_rows = [i for i in sampling_rows if not scheduled[i].num_draft_tokens]
        prompt = PromptRows.of(scheduled)  # prompt logprobs: their prompt rows come last
        num_sampling = len(sampling_rows)
        num_spec = spec.num_rows if spec is not None else 0

        def rows(qsl: np.ndarray) -> np.ndarray:
            picked = qsl[1:][sampling_rows] - 1
            if spec is None and prompt is None:  # NOTE: the common case: no concatenation
                return picked
            return np.concatenate([picked, *(() if spec is None else (spec.rows(qsl),)),
                                   *(() if prompt is None else (prompt.rows(qsl),))])

        with torch.inference_mode():
            logits = self._forward(scheduled, rows)
            prompt_logprobs = {} if prompt is None else prompt.gather(logits[num_sampling + num_spec:])
            if spec is not None:
                verdicts = spec.verify(self.sampler, logits[num_sampling:num_sampling + num_spec])
            if spec is not None or prompt is not None:
                logits = logits[:num_sampling]
            sampled = [scheduled[i] for i in sampling_rows]
            # NOTE: a sampled token's randomness depends only on (seed, position = tokens known so far): the same
            # whatever else is batched, and a preempted or migrated sequence redraws exactly what it drew before.
            # NOTE: penalties, biases and masks change what is sampled; logprobs stay those of the raw logits.
            masks = plan.token_bitmasks
            process = None if not masks and not any(s.processed for s in sampled) else \
                (lambda x: self.logits_processor(x, sampled, masks))
            result = self.sampler.sample(logits, [s.sampling for s in sampled],
                                         [len(s.token_ids) for s in sampled], process)
        self._advance(scheduled)
        for s, tok in zip(sampled, result.token_ids):
            s.token_ids.append(tok)
        logprobs = {s.seq_id: lp for s, lp in zip(sampled, result.logprobs) if lp is not None}
        tokens = {s.seq_id: tok for s, tok in zip(sampled, result.token_ids)}
        accepted = {}
        if spec is not None:
            spec.settle(verdicts)
            for s, (n, tok) in zip(spec.seqs, verdicts):
                tokens[s.seq_id] = tok
                if n:
                    accepted[s.seq_id] = n
        return StepResult(plan.step_id, tokens, logprobs, time.perf_counter() - t0, num_accepted_drafts=accepted,
                          prompt_logprobs=prompt_logprobs)
