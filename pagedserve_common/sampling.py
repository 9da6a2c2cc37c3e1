"""Sampler setting ranges, checked by the scheduler at admission and by the worker before sampling."""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_LOGPROBS = 20  # vLLM's default max_logprobs


@dataclass(slots=True, frozen=True)
class SamplingDefaults:
    """What an unset sampler setting means, in every client API (generate.proto's SamplingParams documents them)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    min_p: float = 0.0
    n: int = 1


SAMPLING_DEFAULTS = SamplingDefaults()


class InvalidField(ValueError):
    """A request field out of range; `field` names it (as in generate.proto) so each client API can name its own."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


def check_sampling_ranges(temperature: float, top_p: float, top_k: int, min_p: float, logprobs: int | None) -> None:
    """Raises ValueError naming the first sampler setting out of range (shared with the worker's sampler)."""
    # NOTE: written as `not (ok)` so that NaN fails every check.
    if not (temperature >= 0 and math.isfinite(temperature)):
        raise InvalidField("temperature", f"temperature must be a finite number >= 0, got {temperature}")
    if not (0 < top_p <= 1):
        raise InvalidField("top_p", f"top_p must be in (0, 1], got {top_p}")
    if not (top_k >= 0):
        raise InvalidField("top_k", f"top_k must be >= 0 (0 = off), got {top_k}")
    if not (0 <= min_p <= 1):
        raise InvalidField("min_p", f"min_p must be in [0, 1], got {min_p}")
    if logprobs is not None and not (0 <= logprobs <= MAX_LOGPROBS):
        raise InvalidField("logprobs", f"logprobs must be in [0, {MAX_LOGPROBS}], got {logprobs}")
