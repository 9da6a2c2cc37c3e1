"""A compiled grammar, one sample's state of it (a Constraint), and the step's bitmasks of many."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import structlog

if TYPE_CHECKING:
    import llguidance

log = structlog.get_logger("pagedserve.scheduler")

# NOTE: llguidance's own thread pool fills a batch's masks in parallel, outside the GIL
_EXECUTOR: llguidance.LLExecutor | None = None


def _executor() -> llguidance.LLExecutor:
    global _EXECUTOR
    if _EXECUTOR is None:
        import llguidance

        _EXECUTOR = llguidance.LLExecutor()
    return _EXECUTOR


@dataclass(slots=True, frozen=True, eq=False)
class Grammar:
    """A compiled spec (scheduler_svc.structured.compiler). `template` never consumes a token: each sample's matcher
    is a copy of it."""

    template: llguidance.LLMatcher
    vocab_size: int
    eos_token_id: int

    def constraint(self) -> Constraint:
        """A fresh matcher for one sample (NOTE: on the event loop only; matchers are not shared across threads)."""
        return Constraint(self.template.deep_copy(), self)


class Constraint:
    """The grammar state of one sample: it lives with the sample's Request on the scheduler (so it survives
    preemption and migration as is) and consumes exactly the tokens committed to the sample's output (a step
    whose result is discarded never reaches it)."""

    __slots__ = ("matcher", "grammar", "failed")

    def __init__(self, matcher: llguidance.LLMatcher, grammar: Grammar) -> None:
        self.matcher = matcher
        self.grammar = grammar
        self.failed = False  # the engine gave up mid-output (a step's work limit): the sample is ended

    def fork(self) -> Constraint:
        """A fresh matcher of the same grammar (a child of an n > 1 request: each sample its own)."""
        return self.grammar.constraint()

    def accept(self, token_id: int) -> bool:
        """Consumes a committed token; False when the grammar refuses it (the sample must end)."""
        ok = self.matcher.consume_token(token_id)
        if not ok or self.matcher.is_error():
            self.failed = True
            return False
        return True

    @property
    def finished(self) -> bool:
        """The output is a whole match and nothing more may follow (or the grammar failed): end the sample."""
        return self.failed or self.matcher.is_stopped()


def fill_bitmasks(constraints: Sequence[Constraint], vocab_size: int) -> list[bytes]:
    """Each constraint's allowed next tokens as a StepPlan bitmask (little-endian uint32 words, ceil(vocab/32)),
    computed in parallel. A constraint whose matcher fails here (its step ran out of work) gets a mask of EOS
    alone, so its sample ends at once."""
    # NOTE: imported at the first structured output, not with the module, as llguidance itself (the compiler's):
    # numpy holds ~11 MB of a scheduler's memory, llguidance ~5 MB (a server never asked for one never loads them)
    import llguidance.numpy as lnp
    import numpy as np

    num_words = (vocab_size + 31) // 32
    masks = np.zeros((len(constraints), num_words), dtype=np.int32)
    if len(constraints) == 1:
        lnp.fill_next_token_bitmask(constraints[0].matcher, masks, 0)
    else:
        lnp.fill_next_token_bitmask_par(_executor(), [(c.matcher, i) for i, c in enumerate(constraints)], masks)
    out = []
    for i, c in enumerate(constraints):
        if c.matcher.is_error() and not c.failed:
            c.failed = True
            log.warning("structured output failed mid-output; the sample ends", error=c.matcher.get_error()[:200])
        if c.failed:
            row = np.zeros(num_words, dtype=np.uint32)
            eos = c.grammar.eos_token_id
            row[eos >> 5] = 1 << (eos & 31)
            out.append(row.tobytes())
        else:
            out.append(masks[i].tobytes())
    return out
