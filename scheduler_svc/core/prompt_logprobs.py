"""Prompt logprobs on the scheduler: what one client request has received of its prompt's logprobs, chunk by chunk,
and what the next step's answer must hold.

Position p of a prompt of P tokens (1 <= p < P; position 0 has none: no token precedes it) is read off the logits of
row p - 1, which the worker computes only for the rows it is scheduled this step. So a request that asks:
  - takes no prefix-cache hit over rows whose positions it does not have yet (max_hit_tokens): a skipped row's
    logits are never computed. It still fills the cache for others;
  - collects each step's positions in order (merge); a position it holds already (a recomputation after a
    preemption or a migration computes the same rows again) is dropped, never delivered twice, and a gap (a chunk
    whose answer never came) is an error, never a silently lost position.
The log lives on the client request (for n > 1, the parent, shared with its samples), so a recomputed or migrated
sequence keeps what its earlier runs delivered.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagedserve_common.step import PositionLogprobs, PromptLogprobs


@dataclass(slots=True, frozen=True)
class PromptDue:
    """What one sequence's answer to the plan in flight must hold: positions first_position .. + len(token_ids) - 1,
    whose tokens are token_ids, each with at most num_top top entries."""

    first_position: int
    token_ids: tuple[int, ...]
    num_top: int


def due_rows(num_prompt_tokens: int, num_computed: int, num_scheduled: int) -> tuple[int, int]:
    """(first row, number of rows) of a step's scheduled tokens [num_computed, num_computed + num_scheduled) that
    give prompt logprobs: those below num_prompt_tokens - 1 (the last prompt token's row predicts the first output,
    a sample). The number is 0 when none do (decodes, a fork child's last prompt token)."""
    end = min(num_computed + num_scheduled, num_prompt_tokens - 1)
    return num_computed, max(0, end - num_computed)


@dataclass(slots=True)
class PromptLogprobsLog:
    """The prompt logprobs one client request has received so far. Invariant: `positions` holds exactly positions
    1 .. len(positions), in order, each once."""

    num_prompt_tokens: int
    positions: list[PositionLogprobs] = field(default_factory=list)

    @property
    def next_position(self) -> int:
        """The first position it does not have (>= 1)."""
        return len(self.positions) + 1

    @property
    def complete(self) -> bool:
        return self.next_position >= self.num_prompt_tokens

    def max_hit_tokens(self) -> int:
        """The most prompt tokens a (re)admission may take from the prefix cache: rows 0 .. next_position - 2 gave
        the positions it has; the next one needs row next_position - 1 computed."""
        return self.next_position - 1

    def merge(self, chunk: PromptLogprobs) -> int:
        """Appends the positions of `chunk` it does not have yet; returns how many. Raises ValueError when the chunk
        starts past next_position (the positions between would be lost) or runs past the prompt."""
        first, entries = chunk.first_position, chunk.positions
        if first < 1 or first > self.next_position:
            raise ValueError(f"prompt logprobs from position {first}, but position {self.next_position} is the next "
                             f"one missing")
        if first + len(entries) > self.num_prompt_tokens:
            raise ValueError(f"prompt logprobs up to position {first + len(entries) - 1} of a prompt of "
                             f"{self.num_prompt_tokens} tokens")
        new = entries[self.next_position - first:]
        self.positions.extend(new)
        return len(new)

    def for_client(self) -> list[PositionLogprobs | None]:
        """One entry per prompt token, None first (vLLM's shape); the positions not received yet are None too."""
        return [None, *self.positions, *[None] * (self.num_prompt_tokens - 1 - len(self.positions))]
