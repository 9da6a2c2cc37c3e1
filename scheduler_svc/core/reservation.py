"""Static kv_allocation modes: how many tokens a request reserves at admission, and whether it ever can."""

from __future__ import annotations

from pagedserve_common.sampling import InvalidField


def _num_blocks(cfg, num_tokens: int) -> int:
    return -(-num_tokens // cfg.block_size)


def num_reserved_tokens(cfg, num_prompt_tokens: int, max_tokens: int) -> int:
    """max_model_len (static-max-model-len), or the request's longest possible sequence: prompt + max_tokens, at
    most max_model_len (static-request). `cfg` is a SchedulerConfig."""
    if cfg.kv_allocation == "static-max-model-len":
        return cfg.max_model_len
    return min(num_prompt_tokens + max_tokens, cfg.max_model_len)


def check_fits(cfg, num_prompt_tokens: int, sampling) -> None:
    """Raises InvalidField when a request could never get its reservation (or asks for n > 1)."""
    if sampling.n > 1:
        raise InvalidField("n", f"n={sampling.n}: kv_allocation {cfg.kv_allocation} runs one sample per request "
                                "(forks share blocks, which contiguous reservations never do)")
    num_tokens = num_reserved_tokens(cfg, num_prompt_tokens, sampling.max_tokens)
    num_blocks = _num_blocks(cfg, num_tokens)
    if num_blocks > cfg.num_blocks:
        # NOTE: max_tokens only when a smaller one would fit (never with static-max-model-len)
        fits_shorter = _num_blocks(cfg, num_reserved_tokens(cfg, num_prompt_tokens, 1)) <= cfg.num_blocks
        raise InvalidField("max_tokens" if fits_shorter else "prompt_token_ids",
                           f"kv_allocation {cfg.kv_allocation} reserves {num_tokens} tokens for this request: "
                           f"{num_blocks} KV blocks; the pool has {cfg.num_blocks}")


def max_output_tokens(cfg, num_prompt_tokens: int, n: int = 1) -> int:
    """The largest max_tokens check_fits accepts (0: none): one reservation per request, within the pool."""
    if n > 1 or (cfg.kv_allocation == "static-max-model-len" and
                 _num_blocks(cfg, cfg.max_model_len) > cfg.num_blocks):
        return 0
    return max(0, min(cfg.num_blocks * cfg.block_size, cfg.max_model_len) - num_prompt_tokens)
