"""The check of a worker's StepResult against the plan it answers and the vocabulary, before anything uses it."""

from __future__ import annotations

import math
from bisect import bisect_left
from collections.abc import Mapping
from dataclasses import dataclass

from pagedserve_common.step import PositionLogprobs, StepResult
from scheduler_svc.core.prompt_logprobs import PromptDue

# NOTE: log_softmax rounds; the most likely token's logprob may come out a hair above 0 in low precision.
LOGPROB_EPSILON = 1e-3


@dataclass(slots=True, frozen=True)
class WrongResult:
    """What is wrong with an answer, naming the field and the sequence; `seq_id` is the one sequence whose own entry
    is wrong (None when the answer as a whole is: a wrong step_id, a missing or an extra sequence)."""

    message: str
    seq_id: int | None = None


# A worker's idle between two back-to-back steps, as it measured it (a metric's observation): an honest worker's is
# its wait for the scheduler, never negative, never anywhere near an hour. NOTE: -1e308 made the metric's sum -Inf.
MAX_IDLE_SECONDS = 3600.0


def check_result(step_id: int, result: StepResult, due: Mapping[int, int | None], vocab_size: int, *,
                 bitmasks: Mapping[int, bytes] | None = None,
                 banned: Mapping[int, frozenset[int]] | None = None,
                 allowed: Mapping[int, tuple[int, ...]] | None = None,
                 drafted: Mapping[int, int] | None = None,
                 prompt_due: Mapping[int, PromptDue] | None = None) -> WrongResult | None:
    """None when `result` is a well-formed answer to plan `step_id`; else what is wrong (WrongResult). `due` holds
    each sequence of the plan that samples a token this step (it reaches the end of its known tokens; one mid
    chunked prefill samples nothing) -> the number of top logprobs it asked for (None: no logprobs).

    The rules: the plan's step_id; idle_seconds in [0, MAX_IDLE_SECONDS]; exactly the due sequences sampled; every
    token id in [0, vocab_size); logprobs
    only for sequences that asked, for every one of them, with the sampled token as their sampled entry, at most
    the asked number of top entries, token ids in the vocabulary, and finite logprobs <= 0 (LOGPROB_EPSILON); each
    token of a sequence the plan sent a bitmask for (structured output) one that its bitmask allows; and no token a
    sequence may not sample this step (`banned`: seq_id -> its stop ids while it has fewer than min_tokens outputs,
    which the worker masks), nor one outside a sequence's allow-list (`allowed`: seq_id -> its allowed_token_ids,
    ascending); drafts accepted (speculative decoding) only by a sequence that drafted (`drafted`:
    seq_id -> its number of drafts), at most that many; prompt logprobs for exactly the sequences `prompt_due` lists
    (seq_id -> PromptDue), each with its positions, their prompt tokens as their sampled entries, a rank in
    [1, vocab_size], at most the asked number of top entries, and logprobs as above."""
    # NOTE: the order of blame: the first check that fails is the answer; each assumes the ones before it passed
    # (the token checks index `sampled` by the plan's sequences, which _check_sampled holds to `due`'s)
    sampled = result.sampled
    return (_check_step(step_id, result)
            or _check_sampled(sampled, due, vocab_size)
            or _check_drafts(result.num_accepted_drafts, drafted or {}, due)
            or _check_constraints(sampled, bitmasks or {}, banned or {}, allowed or {})
            or _check_sample_logprobs(result.logprobs, sampled, due, vocab_size)
            or _check_prompt_logprobs(result, prompt_due or {}, vocab_size))


def _check_step(step_id: int, result: StepResult) -> WrongResult | None:
    """The answer as a whole: the plan it answers and the idle its worker measured."""
    if result.step_id != step_id:
        return WrongResult(f"step_id {result.step_id} answers plan {step_id}")
    if not 0.0 <= result.idle_seconds <= MAX_IDLE_SECONDS:  # NOTE: written so that NaN fails it too
        return WrongResult(f"idle_seconds {result.idle_seconds!r} is not in [0, {MAX_IDLE_SECONDS:g}]")
    return None


def _check_sampled(sampled: Mapping[int, int], due: Mapping[int, int | None], vocab_size: int) -> WrongResult | None:
    """Exactly the due sequences sampled, each a token of the vocabulary."""
    if sampled.keys() != due.keys():
        extra, missing = sorted(sampled.keys() - due.keys()), sorted(due.keys() - sampled.keys())
        if missing:
            return WrongResult(f"tokens: no token for seq {missing[0]}, which samples this step "
                               f"({len(missing)} missing)")
        return WrongResult(f"tokens: a token for seq {extra[0]}, which does not sample this step ({len(extra)} extra)")
    if sampled and not (min(sampled.values()) >= 0 and max(sampled.values()) < vocab_size):
        seq_id, tok = next((s, t) for s, t in sampled.items() if not 0 <= t < vocab_size)
        return WrongResult(f"token_id {tok} of seq {seq_id} is outside the vocabulary (0 .. {vocab_size - 1})",
                           seq_id)
    return None


def _check_drafts(num_accepted: Mapping[int, int], drafted: Mapping[int, int],
                  due: Mapping[int, int | None]) -> WrongResult | None:
    """Drafts accepted only by a sequence that drafted, at most as many as it drafted."""
    for seq_id, n in num_accepted.items():
        num_drafts = drafted.get(seq_id, 0)
        if not 0 <= n <= num_drafts:
            return WrongResult(f"num_accepted_drafts {n} of seq {seq_id}, which drafted {num_drafts} tokens",
                               seq_id if seq_id in due else None)
    return None


def _check_constraints(sampled: Mapping[int, int], bitmasks: Mapping[int, bytes],
                       banned: Mapping[int, frozenset[int]],
                       allowed: Mapping[int, tuple[int, ...]]) -> WrongResult | None:
    """Each token one its sequence may sample this step: its bitmask's, not banned, in its allow-list."""
    for seq_id, bitmask in bitmasks.items():
        tok = sampled.get(seq_id)
        if tok is not None and not token_allowed(bitmask, tok):
            return WrongResult(f"token_id {tok} of seq {seq_id} is not allowed by its token_bitmask (structured "
                               f"output): the worker ignored the mask", seq_id)
    for seq_id, ids in banned.items():
        if sampled[seq_id] in ids:
            return WrongResult(f"token_id {sampled[seq_id]} of seq {seq_id} is a stop id before its min_tokens",
                               seq_id)
    for seq_id, ids in allowed.items():
        tok = sampled[seq_id]
        at = bisect_left(ids, tok)
        if at == len(ids) or ids[at] != tok:
            return WrongResult(f"token_id {tok} of seq {seq_id} is not in its allowed_token_ids", seq_id)
    return None


def _check_sample_logprobs(logprobs: Mapping[int, PositionLogprobs], sampled: Mapping[int, int],
                           due: Mapping[int, int | None], vocab_size: int) -> WrongResult | None:
    """Logprobs for exactly the sequences that asked, each well-formed for its sampled token."""
    for seq_id in logprobs:
        if due[seq_id] is None:
            return WrongResult(f"logprobs for seq {seq_id}, which asked for none", seq_id)
    for seq_id, num_top in due.items():
        if num_top is None:
            continue
        lp = logprobs.get(seq_id)
        if lp is None:
            return WrongResult(f"logprobs: none for seq {seq_id}, which asked for them", seq_id)
        if (wrong := _check_logprobs(lp, sampled[seq_id], num_top, vocab_size)) is not None:
            return WrongResult(f"logprobs of seq {seq_id}: {wrong}", seq_id)
    return None


def _check_prompt_logprobs(result: StepResult, due: Mapping[int, PromptDue], vocab_size: int) -> WrongResult | None:
    got = result.prompt_logprobs
    if got.keys() != due.keys():
        extra, missing = sorted(got.keys() - due.keys()), sorted(due.keys() - got.keys())
        if missing:
            return WrongResult(f"prompt_logprobs: none for seq {missing[0]}, whose prompt rows ran "
                               f"({len(missing)} missing)")
        return WrongResult(f"prompt_logprobs for seq {extra[0]}, which has no prompt rows due ({len(extra)} extra)")
    for seq_id, want in due.items():
        chunk = got[seq_id]
        if chunk.first_position != want.first_position or len(chunk.positions) != len(want.token_ids):
            return WrongResult(f"prompt_logprobs of seq {seq_id}: positions {chunk.first_position} .. "
                               f"{chunk.first_position + len(chunk.positions) - 1}, but {want.first_position} .. "
                               f"{want.first_position + len(want.token_ids) - 1} ran", seq_id)
        for i, (lp, token_id) in enumerate(zip(chunk.positions, want.token_ids)):
            if not 1 <= lp.rank <= vocab_size:
                wrong = f"rank {lp.rank} is outside 1 .. {vocab_size}"
            else:
                wrong = _check_logprobs(lp, token_id, want.num_top, vocab_size)
            if wrong is not None:
                return WrongResult(f"prompt_logprobs of seq {seq_id} at position {want.first_position + i}: "
                                   f"{wrong.replace('sampled token', 'prompt token')}", seq_id)
    return None


def token_allowed(bitmask: bytes, token_id: int) -> bool:
    """Whether a StepPlan bitmask allows `token_id` (little-endian uint32 words: bit t % 8 of byte t // 8)."""
    byte = token_id >> 3
    return byte < len(bitmask) and bool(bitmask[byte] >> (token_id & 7) & 1)


def _check_logprobs(lp: PositionLogprobs, token_id: int, num_top: int, vocab_size: int) -> str | None:
    if lp.sampled.token_id != token_id:
        return f"sampled.token_id {lp.sampled.token_id} is not the sampled token {token_id}"
    if len(lp.top) > num_top:
        return f"top has {len(lp.top)} entries; {num_top} were asked for"
    for name, entry in (("sampled", lp.sampled), *(("top", t) for t in lp.top)):
        if not 0 <= entry.token_id < vocab_size:
            return f"{name}.token_id {entry.token_id} is outside the vocabulary (0 .. {vocab_size - 1})"
        if not (math.isfinite(entry.logprob) and entry.logprob <= LOGPROB_EPSILON):
            return f"{name}.logprob {entry.logprob!r} of token {entry.token_id} is not a finite value <= 0"
    return None
