"""Sampling parameters, one type for both services: the client's settings, checked at admission, sampled by."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass

MAX_LOGPROBS = 20  # vLLM's default max_logprobs
GREEDY_BELOW = 1e-5  # a temperature under this samples greedily (vLLM's _SAMPLING_EPS)
MAX_PENALTY = 2.0  # presence/frequency penalties lie in [-2, 2] (OpenAI's range)
MAX_LOGIT_BIAS = 100.0  # a bias lies in [-100, 100] (OpenAI's range): -100 bans a token, 100 all but forces it
STRUCTURED_KINDS = ("json_schema", "json_object", "regex", "choice", "grammar")


class InvalidField(ValueError):
    """A request field out of range; `field` names it (as in generate.proto) so each client API can name its own."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(message)
        self.field = field


@dataclass(slots=True, frozen=True)
class StructuredOutput:
    """pagedserve.v1.StructuredOutput in memory: what the output must match. The scheduler compiles it and sends
    each step's allowed tokens (StepPlan.token_bitmasks); workers never see the spec."""

    kind: str  # one of STRUCTURED_KINDS
    spec: str = ""  # json_schema: the schema's JSON text; regex: the pattern; grammar: the grammar; else ""
    choices: tuple[str, ...] = ()  # choice: the output is exactly one of these

    def validate(self) -> None:
        if self.kind not in STRUCTURED_KINDS:
            raise InvalidField("structured_output", f"structured_output: unknown kind {self.kind!r} (one of "
                                                    f"{', '.join(STRUCTURED_KINDS)})")
        if self.kind == "choice" and not self.choices:
            raise InvalidField("structured_output", "structured_output.choice needs at least one choice")
        if self.kind in ("json_schema", "regex", "grammar") and not self.spec:
            raise InvalidField("structured_output", f"structured_output.{self.kind} is empty")


def allow_list(ids: Iterable[int]) -> tuple[int, ...]:
    """A client's allowed_token_ids as SamplingParams keeps them: ascending, each once (a repeat allows nothing
    more, and the worker's cache of settings then sees one list, not its orderings)."""
    return tuple(sorted(set(ids)))


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
    # None: none; 0: each prompt token's own logprob (position 0 has none: no token precedes it); N: also the top N
    # at each prompt position (vLLM's prompt_logprobs). NOTE: a request asking for them takes no prefix-cache hit
    # past the positions it already has (scheduler_svc.core.prompt_logprobs): the skipped rows' logits are needed.
    prompt_logprobs: int | None = None
    # Penalties and biases, applied on the worker to the logits before sampling (and before temperature).
    presence_penalty: float = 0.0  # minus this, once, for each token in the sample's output
    frequency_penalty: float = 0.0  # minus this times the token's count in the sample's output
    repetition_penalty: float = 1.0  # CTRL's: tokens of the prompt or output; > 1 discourages, 1 is off
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, bias) pairs, ids ascending, each once
    min_tokens: int = 0  # EOS and stop_token_ids are masked (and stop strings wait) until this many outputs
    # Token sequences never generated: the front end adds each bad word's tokenizations (with and without a
    # leading space) to the client's own; a sequence's last token is masked when the tokens before it match.
    bad_words_token_ids: tuple[tuple[int, ...], ...] = ()
    # vLLM's allow-list: only these ids may be sampled (every other logit is -inf). Ascending, each once (the
    # client APIs sort and dedupe the list they get); empty: no restriction.
    allowed_token_ids: tuple[int, ...] = ()
    structured_output: StructuredOutput | None = None  # None: free text

    @property
    def needs_token_counts(self) -> bool:
        """Whether the worker keeps this sequence's output token counts (the penalties read them)."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    @property
    def needs_processing(self) -> bool:
        """Whether a sequence's logits are ever changed before sampling (its structured-output bitmasks aside)."""
        return bool(self.needs_token_counts or self.logit_bias or self.min_tokens or self.bad_words_token_ids
                    or self.allowed_token_ids)

    @property
    def greedy(self) -> bool:
        """NOTE: a temperature under GREEDY_BELOW is greedy, as vLLM's: dividing logits by 1e-38 overflows them to
        inf, and softmax over infs is NaN (it sampled garbage)."""
        return self.temperature < GREEDY_BELOW

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
        if self.prompt_logprobs is not None and not (0 <= self.prompt_logprobs <= MAX_LOGPROBS):
            raise InvalidField("prompt_logprobs", f"prompt_logprobs must be in [0, {MAX_LOGPROBS}], got "
                                                  f"{self.prompt_logprobs}")
        if self.seed is not None and not (0 <= self.seed < 2**64):
            raise InvalidField("seed", f"seed must fit in 64 bits unsigned, got {self.seed}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not (-MAX_PENALTY <= value <= MAX_PENALTY):
                raise InvalidField(name, f"{name} must be in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}], got {value}")
        if not (0 < self.repetition_penalty <= MAX_PENALTY):
            raise InvalidField("repetition_penalty", f"repetition_penalty must be in (0, {MAX_PENALTY:g}] (1 is off), "
                                                     f"got {self.repetition_penalty}")
        for token_id, bias in self.logit_bias:
            if not (-MAX_LOGIT_BIAS <= bias <= MAX_LOGIT_BIAS):
                raise InvalidField("logit_bias", f"logit_bias[{token_id}] must be in [-{MAX_LOGIT_BIAS:g}, "
                                                 f"{MAX_LOGIT_BIAS:g}], got {bias}")
        if not (0 <= self.min_tokens <= self.max_tokens):
            raise InvalidField("min_tokens", f"min_tokens must be in [0, max_tokens = {self.max_tokens}], got "
                                             f"{self.min_tokens}")
        if any(not seq for seq in self.bad_words_token_ids):
            raise InvalidField("bad_words_token_ids", "bad_words_token_ids: a banned sequence is empty")
        self._validate_allowed()
        if self.structured_output is not None:
            self.structured_output.validate()

    def _validate_allowed(self) -> None:
        """Non-negative ids, strictly ascending (the vocabulary's bound is the front end's: it knows the model)."""
        ids = self.allowed_token_ids
        if ids and not (ids[0] >= 0):
            raise InvalidField("allowed_token_ids", f"allowed_token_ids: {ids[0]} is not a token id (ids are >= 0)")
        if any(not (a < b) for a, b in zip(ids, ids[1:])):
            raise InvalidField("allowed_token_ids", "allowed_token_ids must be ascending, each id once")
