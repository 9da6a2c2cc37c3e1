"""One worker's Scheduler's configuration: the engine's flags, the model's limits and the worker's pool."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve_common.config import EngineOptions, default_batched_tokens
from pagedserve_common.defaults import DEFAULT_BLOCK_SIZE
from pagedserve_common.options import default_of
from pagedserve_common.registration import WorkerRegistration


@dataclass(slots=True)
class SchedulerConfig:
    num_blocks: int
    max_model_len: int
    max_num_seqs: int = default_of(EngineOptions, "max_num_seqs")
    # NOTE: the engine always sets it (--max-num-batched-tokens, else default_batched_tokens by the worker's
    # device); None here means no token budget beyond max_num_seqs sequences of max_model_len tokens.
    max_num_batched_tokens: int | None = None
    block_size: int = DEFAULT_BLOCK_SIZE
    enable_prefix_caching: bool = True
    long_prefill_token_threshold: int = 0  # > 0: cap on one sequence's prefill chunk per step
    eos_token_ids: tuple[int, ...] = ()
    num_cpu_blocks: int = 0  # the worker's swap space; 0: preemption always recomputes
    kv_allocation: str = default_of(EngineOptions, "kv_allocation")  # or a contiguous reservation per sequence
    speculative: str = default_of(EngineOptions, "speculative")  # "ngram": decoding sequences draft tokens
    num_speculative_tokens: int = default_of(EngineOptions, "num_speculative_tokens")  # drafts per step at most
    # NOTE: admission order, checked in one place: WaitingQueue (core.waiting) refuses a policy it does not know
    scheduling_policy: str = default_of(EngineOptions, "scheduling_policy")
    priority_max_wait: float = default_of(EngineOptions, "priority_max_wait")  # priority: a wait's bound, seconds
    # Each KV group's sliding window, 0 for full attention (the worker's KVGeometry.groups); one group by default
    kv_group_windows: tuple[int, ...] = (0,)

    def __post_init__(self) -> None:
        if self.max_num_batched_tokens is None:
            self.max_num_batched_tokens = self.max_num_seqs * self.max_model_len

    @classmethod
    def for_worker(cls, engine: EngineOptions, reg: WorkerRegistration) -> SchedulerConfig:
        """The configuration of one attached worker's scheduler: the engine's flags and model, the worker's pool,
        swap space and block size (and its device: the token budget when --max-num-batched-tokens is not set).
        `engine`: scheduler_svc.engine.EngineConfig, these flags with the model's max_model_len and eos_token_ids.
        NOTE: typed by its base class: this module cannot import scheduler_svc.engine, which imports it."""
        return cls(num_blocks=reg.num_blocks, max_model_len=engine.max_model_len, max_num_seqs=engine.max_num_seqs,
                   max_num_batched_tokens=engine.max_num_batched_tokens or default_batched_tokens(reg.device),
                   block_size=reg.block_size, enable_prefix_caching=not engine.no_prefix_caching,
                   eos_token_ids=engine.eos_token_ids, num_cpu_blocks=reg.num_cpu_blocks,
                   kv_allocation=engine.kv_allocation, speculative=engine.speculative,
                   num_speculative_tokens=engine.num_speculative_tokens, scheduling_policy=engine.scheduling_policy,
                   priority_max_wait=engine.priority_max_wait, kv_group_windows=reg.kv_geometry.groups.windows)
