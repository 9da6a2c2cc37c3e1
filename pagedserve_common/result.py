"""What a worker answers to a plan: the step's sampled tokens (StepResult) or why it ran none (StepError)."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


@dataclass(slots=True, frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float  # natural log, of the model's raw distribution (before temperature, top-k, top-p, min-p)


@dataclass(slots=True, frozen=True)
class PositionLogprobs:
    """Logprobs of one generated position: the sampled token's, and the top ones, most likely first."""

    sampled: TokenLogprob
    top: tuple[TokenLogprob, ...] = ()


@dataclass(slots=True)
class StepResult:
    """One token for each sequence that reached the end of its known tokens this step; logprobs only for the
    sequences that asked."""

    step_id: int
    sampled: dict[int, int] = field(default_factory=dict)  # seq_id -> the token it sampled
    logprobs: dict[int, PositionLogprobs] = field(default_factory=dict)  # seq_id -> its position's logprobs
    step_seconds: float = 0.0  # the step's wall time on the worker
    idle_seconds: float = 0.0  # the worker's wait between its previous answer and this plan (0 for its first)


class StepErrorKind(enum.IntEnum):
    """NOTE: values match pagedserve.v1.StepError.Kind."""

    BAD_PLAN = 1  # the worker refused the plan; nothing was written
    STEP_FAILED = 2  # running the step raised (out of device memory, a kernel fault, ...)


@dataclass(slots=True, frozen=True)
class StepError:
    """The answer to a plan that produced no result; the scheduler recomputes the worker's requests elsewhere."""

    step_id: int
    kind: StepErrorKind
    message: str
