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
    # The worst case alone: the longest sequence, and n of them sharing only the prompt's full blocks.
    num_total = min(num_prompt_tokens + sampling.max_tokens, cfg.max_model_len)
    per_seq = -(-num_total // cfg.block_size)
    need = per_seq + (sampling.n - 1) * (per_seq - num_prompt_tokens // cfg.block_size)
    if need > cfg.num_blocks:
        raise InvalidField("max_tokens", f"prompt_token_ids + max_tokens need {need} KV blocks for n={sampling.n}; "
                                         f"the pool has {cfg.num_blocks}")


def max_output_tokens(cfg, num_prompt_tokens: int, n: int = 1) -> int:
    """The largest max_tokens check_fits accepts for a prompt this long with n samples (0: none)."""
    if cfg.kv_allocation in STATIC_KV_ALLOCATIONS:
        return reservation.max_output_tokens(cfg, num_prompt_tokens, n)
    # n sequences of b blocks each share the prompt's full blocks: b + (n - 1) * (b - shared) <= num_blocks
    shared = num_prompt_tokens // cfg.block_size
    per_seq = (cfg.num_blocks + (n - 1) * shared) // n
    return max(0, min(per_seq * cfg.block_size, cfg.max_model_len) - num_prompt_tokens)
