"""Sampling parameters, one type for both services: the client's settings, checked at admission, sampled by."""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_LOGPROBS = 20  # vLLM's default max_logprobs


class InvalidField(ValueError):
    """A request field out of range; `field` names it (as in generate.proto) so each client API can name its own."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(slots=True, frozen=True)
class SamplingParams:
    """pagedserve.v1.SamplingParams in memory. Its defaults are what an unset field means in every client API
    (generate.proto documents them; SamplingParams() is the one place they are written). Stop strings
    are not here: they need detokenized text, so they stay with the front end's stream."""

    max_tokens: int = 16
    temperature: float = 1.0  # 0: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    seed: int | None = None  # None: the scheduler draws one (a plan always carries the seed a sequence uses)
    n: int = 1  # parallel samples of one prompt
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the sampled token's only; N: also the top N

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def validate(self) -> None:
        """Raises InvalidField naming the first field out of range. NOTE: written as `not (ok)` so that NaN fails
        every check."""
        if not (self.max_tokens >= 1):
            raise InvalidField("max_tokens", f"max_tokens must be >= 1, got {self.max_tokens}")
        if not (self.n >= 1):
            raise InvalidField("n", f"n must be >= 1, got {self.n}")
        if not (self.temperature >= 0 and math.isfinite(self.temperature)):
            raise InvalidField("temperature", f"temperature must be a finite number >= 0, got {self.temperature}")
        if not (0 < self.top_p <= 1):
            raise InvalidField("top_p", f"top_p must be in (0, 1], got {self.top_p}")
        if not (self.top_k >= 0):
            raise InvalidField("top_k", f"top_k must be >= 0 (0 = off), got {self.top_k}")
        if not (0 <= self.min_p <= 1):
            raise InvalidField("min_p", f"min_p must be in [0, 1], got {self.min_p}")
        if self.logprobs is not None and not (0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidField("logprobs", f"logprobs must be in [0, {MAX_LOGPROBS}], got {self.logprobs}")
        if self.seed is not None and not (0 <= self.seed < 2**64):
            raise InvalidField("seed", f"seed must fit in 64 bits unsigned, got {self.seed}")
