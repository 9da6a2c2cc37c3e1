"""Whether a worker's pool can ever hold a request, and the longest output it can: its worst case alone."""

from __future__ import annotations

from pagedserve_common.sampling import InvalidField, SamplingParams
from scheduler_svc.core import reservation
from scheduler_svc.kv.static import STATIC_KV_ALLOCATIONS


def check_fits(cfg, num_prompt_tokens: int, sampling: SamplingParams) -> None:
    """Raises InvalidField naming the field when a pool of `cfg` (a SchedulerConfig) can never serve the request:
    its prompt does not fit max_model_len, or its worst case alone needs more than the pool. NOTE: the front end
    checked the request's shape and ranges (FrontEnd._check) before it reached a scheduler."""
    if num_prompt_tokens > cfg.max_model_len - 1:
        raise InvalidField("prompt_token_ids", f"prompt_token_ids has {num_prompt_tokens} tokens; "
                           f"max_model_len {cfg.max_model_len} leaves room for at most {cfg.max_model_len - 1}")
    if cfg.kv_allocation in STATIC_KV_ALLOCATIONS:
        reservation.check_fits(cfg, num_prompt_tokens, sampling)
        return
    num_total = min(num_prompt_tokens + sampling.max_tokens, cfg.max_model_len)
    need = _blocks_needed(cfg, num_prompt_tokens, num_total, sampling.n)
    if need > cfg.num_blocks:
        raise InvalidField("max_tokens", f"prompt_token_ids + max_tokens need {need} KV blocks for n={sampling.n}; "
                                         f"the pool has {cfg.num_blocks}")


def max_output_tokens(cfg, num_prompt_tokens: int, n: int = 1) -> int:
    """The largest max_tokens check_fits accepts for a prompt this long with n samples (0: none)."""
    if cfg.kv_allocation in STATIC_KV_ALLOCATIONS:
        return reservation.max_output_tokens(cfg, num_prompt_tokens, n)
    if cfg.kv_group_windows != (0,):  # KV groups: the largest total _blocks_needed admits (it grows with it)
        lo, hi = num_prompt_tokens, cfg.max_model_len
        while lo < hi:
            mid = (lo + hi + 1) // 2
            lo, hi = (mid, hi) if _blocks_needed(cfg, num_prompt_tokens, mid, n) <= cfg.num_blocks else (lo, mid - 1)
        return lo - num_prompt_tokens
    # n sequences of b blocks each share the prompt's full blocks: b + (n - 1) * (b - shared) <= num_blocks
    shared = num_prompt_tokens // cfg.block_size
    per_seq = (cfg.num_blocks + (n - 1) * shared) // n
    return max(0, min(per_seq * cfg.block_size, cfg.max_model_len) - num_prompt_tokens)


def _blocks_needed(cfg, num_prompt_tokens: int, num_total: int, n: int) -> int:
    """The most blocks n sequences of num_total tokens from one prompt hold at once, alone: the worst case.

    One group: n tables sharing only the prompt's full blocks. KV groups (cfg.kv_group_windows): a full group holds
    every block; a sliding group (window w) holds those from its first query's window on to the step's last token:
    at most ceil((w - 1 + C) / block_size) + 1, C the most tokens one step computes of a sequence (its prefill chunk
    cap; a decode: ceil(w / block_size) + 1). Only full groups' prompt blocks are counted as shared.
    """
    bs = cfg.block_size
    per_seq = -(-num_total // bs)
    shared = num_prompt_tokens // bs
    chunk = cfg.long_prefill_token_threshold or cfg.max_num_batched_tokens
    need = 0
    for window in cfg.kv_group_windows:
        if window:
            need += n * min(per_seq, -(-(window - 1 + chunk) // bs) + 1)
        else:
            need += per_seq + (n - 1) * (per_seq - shared)
    return need
