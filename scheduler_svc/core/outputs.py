"""Applying a worker's answer to one sequence (Scheduler.update): its sampled tokens, its prompt logprobs."""

from __future__ import annotations

from pagedserve_common.step import PromptLogprobs
from scheduler_svc.core.prompt_logprobs import due_rows
from scheduler_svc.core.request import FinishReason, Request


def append_token(req: Request, tok: int, max_model_len: int) -> FinishReason | None:
    """Commits one sampled token to `req`; why its sample ends there (None: it goes on)."""
    req.all_token_ids.append(tok)
    out = req.output_token_ids
    out.append(tok)
    if tok in req.stop_ids and len(out) > req.sampling.min_tokens:
        return FinishReason.STOP
    if req.constraint is not None and (not req.constraint.accept(tok) or req.constraint.finished):
        # NOTE: a whole match that allows nothing more ends the sample, EOS or not (result_check checked
        # the token against its bitmask, so a refusal here is the engine giving up: the sample ends too)
        return FinishReason.STOP
    if len(out) >= req.sampling.max_tokens or len(req.all_token_ids) >= max_model_len:
        return FinishReason.LENGTH
    return None


def merge_prompt_logprobs(req: Request, num: int, step_id: int,
                          prompt_logprobs: dict[int, PromptLogprobs] | None) -> None:
    """Before its num_computed_tokens moves: the positions its `num` scheduled tokens gave, into its log."""
    if not due_rows(len(req.prompt_token_ids), req.num_computed_tokens, num)[1]:
        return
    chunk = prompt_logprobs.get(req.seq_id) if prompt_logprobs else None
    if chunk is None:
        raise ValueError(f"step {step_id}: no prompt logprobs for seq {req.seq_id}, whose prompt rows ran")
    req.prompt_log.merge(chunk)


def constraint_failed(req: Request) -> bool:
    """Whether `req`'s sample ended because its structured output's matcher gave up (not a whole match)."""
    return req.constraint is not None and req.constraint.failed
