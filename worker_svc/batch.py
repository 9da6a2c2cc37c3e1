"""The persistent batch: per-sequence state kept across steps; a plan is checked against it once (check_plan: no
write outside the pool, ever), then applied (its deltas)."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

import torch

from pagedserve_common.kv_geometry import KVGroups, blocks_before_window
from pagedserve_common.step import StepPlan
from pagedserve_common.sampling import SamplingParams
from worker_svc.logits import TokenCounts, allows_any, bitmask_num_bytes, needs_processing


@dataclass(slots=True)
class SeqState:
    seq_id: int
    token_ids: list[int]
    block_ids: list[int]
    num_computed_tokens: int
    sampling: SamplingParams  # NOTE: its seed is the one in use (the plan's): a sampled token depends on it
    num_scheduled_tokens: int = 0  # this step's
    num_prompt_tokens: int = 0  # token_ids[:num_prompt_tokens] is the prompt, the rest outputs
    processed: bool = False  # any logits rule (worker_svc.logits.needs_processing), fixed at admission
    counts: TokenCounts | None = None  # the penalties' token counts, built on its first sample
    # this step's drafts (speculative decoding), appended to token_ids until the step's verification settles them
    num_draft_tokens: int = 0
    _bias: tuple[torch.Tensor, torch.Tensor] | None = field(default=None, repr=False)
    _refused: torch.Tensor | None = field(default=None, repr=False)

    def logit_bias_tensors(self, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(token ids, biases) of sampling.logit_bias, built once."""
        if self._bias is None:
            ids, biases = zip(*self.sampling.logit_bias)
            self._bias = (torch.tensor(ids, dtype=torch.long, device=device),
                          torch.tensor(biases, dtype=torch.float32, device=device))
        return self._bias

    def refused_tokens(self, device, vocab_size: int) -> torch.Tensor:
        """[vocab_size] bools, True where sampling.allowed_token_ids refuses the token, built once (the list may be
        as long as the vocabulary: not a per-step scatter). NOTE: an id past the row allows nothing, so no index
        ever leaves it."""
        if self._refused is None:
            ids = [t for t in self.sampling.allowed_token_ids if 0 <= t < vocab_size]
            refused = torch.ones(vocab_size, dtype=torch.bool)
            refused[torch.tensor(ids, dtype=torch.long)] = False
            self._refused = refused.to(device)
        return self._refused

    @property
    def samples_this_step(self) -> bool:
        """A sequence samples once its scheduled tokens reach the end of its known tokens."""
        return self.num_computed_tokens + self.num_scheduled_tokens == len(self.token_ids)


class BadPlan(ValueError):
    """A plan the worker refuses (reported as StepError BAD_PLAN); the worker's state is unchanged."""


def _in_range(ids: Iterable[int], limit: int, what: str) -> None:
    for b in ids:
        if not 0 <= b < limit:
            raise BadPlan(f"{what} {b} is outside the pool (0..{limit - 1})")


def check_plan(plan: StepPlan, seqs: Mapping[int, SeqState], num_blocks: int, num_cpu_blocks: int,
               block_size: int, vocab_size: int | None = None, groups: KVGroups | None = None) -> None:
    """Raises BadPlan naming the first thing wrong: an unknown or duplicate sequence id, a block id outside
    the pool (or the swap space), a block twice in one sequence's table, a block table too short for the tokens
    scheduled, more tokens scheduled than the sequence has, a token id outside the vocabulary (an embedding
    lookup out of range fails the step on a CPU and may kill the context on a GPU), a token bitmask of the wrong
    length, for a sequence that does not sample this step, or that allows no token. NOTE: it reads `seqs` only, so
    a refused plan leaves the batch as it was. `groups`: the pool's KV groups (None: one group of full attention);
    a table's entries i * num_groups + g are group g's, and those of sliding groups' blocks out of every query's
    window are stale (live_entries): their blocks may be anyone's now, this sequence's new ones included."""
    ng = 1 if groups is None else groups.num_groups
    dropped = set(plan.finished_seq_ids) | set(plan.preempted_seq_ids)
    if len(dropped) != len(plan.finished_seq_ids) + len(plan.preempted_seq_ids):
        raise BadPlan("a finished/preempted seq is dropped twice")
    for seq_id in dropped:
        if seq_id not in seqs:
            raise BadPlan(f"finished/preempted seq {seq_id} is not on this worker")
    seen: set[int] = set()
    for new in plan.new_seqs:
        if (new.seq_id in seqs and new.seq_id not in dropped) or new.seq_id in seen:
            raise BadPlan(f"new seq {new.seq_id} is already on this worker")
        seen.add(new.seq_id)
        _in_range(new.block_ids, num_blocks, f"seq {new.seq_id}: block")
        _no_repeats(new.seq_id, (), live_entries(new.block_ids, new.num_computed_tokens, groups, block_size))
        ids = new.token_ids
        if vocab_size is not None and ids and not (0 <= min(ids) and max(ids) < vocab_size):
            raise BadPlan(f"seq {new.seq_id}: a token id is outside the vocabulary (0..{vocab_size - 1})")
        _check_tokens(new.seq_id, new.num_computed_tokens, new.num_scheduled_tokens, len(new.token_ids),
                      len(new.block_ids) // ng, block_size)
    for delta in plan.running:
        s = seqs.get(delta.seq_id)
        if s is None or delta.seq_id in dropped or delta.seq_id in seen:
            raise BadPlan(f"running seq {delta.seq_id} is not on this worker")
        seen.add(delta.seq_id)
        _in_range(delta.new_block_ids, num_blocks, f"seq {delta.seq_id}: block")
        if delta.new_block_ids:  # NOTE: only then: the table is walked about once a block's worth of tokens
            _no_repeats(delta.seq_id, live_entries(s.block_ids, s.num_computed_tokens, groups, block_size),
                        delta.new_block_ids)
        drafts = delta.draft_token_ids
        if drafts:
            _check_drafts(s, delta.num_scheduled_tokens, drafts, vocab_size, plan.token_bitmasks)
        _check_tokens(delta.seq_id, s.num_computed_tokens, delta.num_scheduled_tokens, len(s.token_ids) + len(drafts),
                      (len(s.block_ids) + len(delta.new_block_ids)) // ng, block_size)
    for src, dst in plan.copies:
        _in_range((src, dst), num_blocks, "copy: block")
    for src, dst in plan.swap_out:
        _in_range((src,), num_blocks, "swap_out: block")
        _in_range((dst,), num_cpu_blocks, "swap_out: CPU block")
    for src, dst in plan.swap_in:
        _in_range((src,), num_cpu_blocks, "swap_in: CPU block")
        _in_range((dst,), num_blocks, "swap_in: block")
    if plan.token_bitmasks:
        _check_bitmasks(plan, seqs, vocab_size)


def _check_bitmasks(plan: StepPlan, seqs: Mapping[int, SeqState], vocab_size: int | None) -> None:
    """Each bitmask: for a sequence of the plan that samples this step, exactly ceil(vocab / 32) words long,
    allowing at least one token of the vocabulary."""
    sampling = {n.seq_id for n in plan.new_seqs if n.num_computed_tokens + n.num_scheduled_tokens == len(n.token_ids)}
    for d in plan.running:
        s = seqs[d.seq_id]
        if s.num_computed_tokens + d.num_scheduled_tokens == len(s.token_ids):
            sampling.add(d.seq_id)
    for seq_id, bitmask in plan.token_bitmasks.items():
        if seq_id not in sampling:
            in_plan = any(n.seq_id == seq_id for n in plan.new_seqs) or any(d.seq_id == seq_id for d in plan.running)
            raise BadPlan(f"token_bitmasks: seq {seq_id} " + ("does not sample this step" if in_plan
                                                              else "is not in this plan"))
        if vocab_size is None:
            continue
        if len(bitmask) != bitmask_num_bytes(vocab_size):
            raise BadPlan(f"token_bitmasks: seq {seq_id}: the bitmask has {len(bitmask)} bytes; a vocabulary of "
                          f"{vocab_size} takes {bitmask_num_bytes(vocab_size)}")
        if not allows_any(bitmask, vocab_size):
            raise BadPlan(f"token_bitmasks: seq {seq_id}: the bitmask allows no token")


def _check_drafts(s: SeqState, num_scheduled: int, drafts: list[int], vocab_size: int | None,
                  bitmasks: Mapping[int, bytes]) -> None:
    """Drafts only follow a decoding sequence's last known token (all of them scheduled with it), with token ids in
    the vocabulary, and only for a sequence whose samples no logits rule, logprobs or bitmask touches (the
    verification (worker_svc.speculative) samples the raw distribution)."""
    if s.num_computed_tokens + 1 != len(s.token_ids) or num_scheduled != 1 + len(drafts):
        raise BadPlan(f"seq {s.seq_id}: {len(drafts)} drafts must follow its last known token, scheduled with it "
                      f"({num_scheduled} tokens scheduled after {s.num_computed_tokens} of {len(s.token_ids)})")
    if vocab_size is not None and not (0 <= min(drafts) and max(drafts) < vocab_size):
        raise BadPlan(f"seq {s.seq_id}: a draft token id is outside the vocabulary (0..{vocab_size - 1})")
    if s.processed or s.sampling.logprobs is not None or s.seq_id in bitmasks:
        raise BadPlan(f"seq {s.seq_id}: drafts for a sequence with logprobs, a logits rule or a token bitmask")


def live_entries(block_ids: list[int], num_computed: int, groups: KVGroups | None, block_size: int) -> list[int]:
    """The entries of a table a query from position num_computed on may read: all but those of a sliding group's
    blocks wholly before that query's window (the scheduler may have freed them: scheduler_svc.kv.manager)."""
    if groups is None or not any(groups.windows):
        return block_ids
    ng = groups.num_groups
    stale = [blocks_before_window(num_computed, w, block_size) if w else 0 for w in groups.windows]
    return [b for k, b in enumerate(block_ids) if k // ng >= stale[k % ng]]


def _no_repeats(seq_id: int, table: Iterable[int], new: Iterable[int]) -> None:
    """A block may stand once in a sequence's table: twice, two positions' K/V would share one slot."""
    held = set(table)
    for b in new:
        if b in held:
            raise BadPlan(f"seq {seq_id}: block {b} would stand twice in its block table")
        held.add(b)


def _check_tokens(seq_id: int, num_computed: int, num_scheduled: int, num_known: int, num_table_blocks: int,
                  block_size: int) -> None:
    end = num_computed + num_scheduled
    if num_scheduled < 1 or end > num_known:
        raise BadPlan(f"seq {seq_id}: {num_scheduled} tokens scheduled after {num_computed} computed, but only "
                      f"{num_known} known")
    if end > num_table_blocks * block_size:
        raise BadPlan(f"seq {seq_id}: {end} tokens need {-(-end // block_size)} blocks, its table has "
                      f"{num_table_blocks}")


class PersistentBatch:
    """Sequences by id. Running sequences change only by their plan deltas; new ones arrive whole.
    NOTE: apply() trusts its plan: check_plan has refused any plan that does not fit this batch."""

    def __init__(self) -> None:
        self.seqs: dict[int, SeqState] = {}

    def __len__(self) -> int:
        return len(self.seqs)

    def apply(self, plan: StepPlan) -> list[SeqState]:
        """Applies a checked plan; returns the sequences scheduled this step, in plan order (new ones first)."""
        seqs = self.seqs
        for seq_id in plan.finished_seq_ids:
            del seqs[seq_id]
        for seq_id in plan.preempted_seq_ids:
            del seqs[seq_id]  # NOTE: recompute preemption: it comes back as a new sequence
        scheduled = []
        for new in plan.new_seqs:
            sampling = new.sampling if new.sampling.seed == new.seed else replace(new.sampling, seed=new.seed)
            s = SeqState(new.seq_id, list(new.token_ids), list(new.block_ids), new.num_computed_tokens, sampling,
                         new.num_scheduled_tokens, new.num_prompt_tokens, needs_processing(sampling))
            seqs[new.seq_id] = s
            scheduled.append(s)
        for delta in plan.running:
            s = seqs[delta.seq_id]
            s.block_ids.extend(delta.new_block_ids)
            s.num_scheduled_tokens = delta.num_scheduled_tokens
            if delta.draft_token_ids:  # NOTE: computed as known tokens; the step's verification settles them
                s.token_ids.extend(delta.draft_token_ids)
                s.num_draft_tokens = len(delta.draft_token_ids)
            scheduled.append(s)
        return scheduled
