"""One scheduled step, as Scheduler.schedule() returns it: the plan to send and what its answer is checked and
applied against. The caller holds it from schedule() to update() (vLLM V1's SchedulerOutput); the Scheduler keeps
nothing about the step in flight."""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from pagedserve_common.step import NewSequence, StepPlan
from scheduler_svc.core.prompt_logprobs import PromptDue, due_rows
from scheduler_svc.core.request import Request


@dataclass(slots=True)
class ScheduledStep:
    """Invariant: `scheduled` lists the plan's sequences in plan order, each with the tokens scheduled for it, and
    their state (num_computed_tokens, all_token_ids) is still the state before the step until update() runs."""

    plan: StepPlan
    scheduled: list[tuple[Request, int]] = field(default_factory=list)  # (sequence, tokens scheduled)
    drafted: dict[int, int] = field(default_factory=dict)  # seq_id -> its drafts this step (speculative decoding)
    # NOTE: swapped in this step: free once the worker has read them (update(), or release_all on a loss)
    cpu_block_ids_to_free: list[int] = field(default_factory=list)
    any_constrained: bool = False  # some request here has structured output: constrained_due looks
    any_min_tokens: bool = False  # some request here may be short of its min_tokens: banned_samples looks

    @property
    def step_id(self) -> int:
        return self.plan.step_id

    def _sampling(self):
        """(sequence, tokens scheduled) of those that sample a token this step: they reach the end of their known
        tokens (one mid chunked prefill samples nothing, nor a fork parent). NOTE: also those aborted or finished
        while the step runs: the worker samples them all the same."""
        return ((req, num) for req, num in self.scheduled if req.num_computed_tokens + num >= len(req.all_token_ids))

    def due_samples(self) -> dict[int, int | None]:
        """seq_id -> the number of top logprobs it asked for (None: none), for each sequence that samples: what the
        worker's answer must hold (scheduler_svc.core.result_check)."""
        return {req.seq_id: req.sampling.logprobs for req, _ in self._sampling()}

    def prompt_logprobs_due(self) -> dict[int, PromptDue]:
        """The sequences whose answer must hold prompt logprobs (the worker holds them with prompt_logprobs set and
        their scheduled tokens include prompt rows with a next prompt token), each -> what."""
        due = {}
        for req, num in self.scheduled:
            if not req.prompt_logprobs_on_worker:
                continue
            first, count = due_rows(len(req.prompt_token_ids), req.num_computed_tokens, num)
            if count:
                due[req.seq_id] = PromptDue(first + 1, tuple(req.prompt_token_ids[first + 1:first + 1 + count]),
                                            req.sampling.prompt_logprobs)
        return due

    def constrained_due(self) -> list[Request]:
        """The sequences that sample under structured output (they need a bitmask)."""
        if not self.any_constrained:
            return []
        return [req for req, _ in self._sampling() if req.constraint is not None]

    def banned_samples(self) -> dict[int, frozenset[int]]:
        """The sequences whose token may not be a stop id (its EOS or stop_token_ids): those with fewer than
        min_tokens outputs; each -> those ids (what the worker masked). NOTE: not a constrained sample: its grammar's
        mask wins over min_tokens on the worker (a whole match may allow EOS alone), and result_check holds its
        token to that mask instead."""
        if not self.any_min_tokens:
            return {}
        return {req.seq_id: req.stop_ids for req, _ in self._sampling()
                if req.sampling.min_tokens > len(req.output_token_ids) and req.stop_ids and req.constraint is None}

    def allowed_samples(self) -> dict[int, tuple[int, ...]]:
        """The sequences that sample under an allow-list (allowed_token_ids); each -> its ids, ascending. NOTE: not
        a constrained sample, as banned_samples."""
        return {req.seq_id: req.sampling.allowed_token_ids for req, _ in self._sampling()
                if req.sampling.allowed_token_ids and req.constraint is None}

    def request_ids(self) -> set[str]:
        """Client requests with a sequence in this step (the suspects when the worker dies on it)."""
        return {seq.request_id for seq, _ in self.scheduled}

    def request_id_of(self, seq_id: int) -> str | None:
        """The client request of a sequence in this step (None when it is not in it)."""
        return next((seq.request_id for seq, _ in self.scheduled if seq.seq_id == seq_id), None)


def new_sequence(req: Request, block_table: list[int], num_new: int) -> NewSequence:
    """A sequence's whole state for the plan (new to the worker, or a table that is not an extension of what the
    worker holds: a swap-in, a fork child's first step); marks it as held by the worker. The sampling sent is what
    the worker applies: no grammar (it gets masks), this scheduler's stop ids under min_tokens, prompt logprobs only
    while some are still due."""
    req.on_worker = True
    sampling = req.sampling
    if sampling.structured_output is not None:  # NOTE: the worker gets masks (token_bitmasks), not the spec
        sampling = replace(sampling, structured_output=None)
    if sampling.min_tokens and req.stop_ids != frozenset(sampling.stop_token_ids):
        # NOTE: the worker masks stop_token_ids and its model's EOS until min_tokens: it is told this
        # scheduler's EOS ids too (the tokenizer's), so that both sides agree on what may not end a sample early.
        sampling = replace(sampling, stop_token_ids=tuple(sorted(req.stop_ids)))
    log = req.prompt_log
    req.prompt_logprobs_on_worker = log is not None and not log.complete
    if sampling.prompt_logprobs is not None and not req.prompt_logprobs_on_worker:
        # NOTE: every position is in already (a fork's sample, a recomputation past them): none computed again
        sampling = replace(sampling, prompt_logprobs=None)
    return NewSequence(req.seq_id, list(req.all_token_ids), block_table, req.num_computed_tokens, num_new,
                       sampling, req.seed, len(req.prompt_token_ids))


@dataclass(slots=True)
class StepRoom:
    """The working state of one schedule() call, passed from phase to phase: the step being built, what is left of
    its token budget, and what the policies need between phases."""

    step: ScheduledStep
    budget: int  # tokens left this step (max_num_batched_tokens)
    cap: int  # one sequence's tokens this step at most (long_prefill_token_threshold)
    num_preempted: int = 0  # under memory pressure this step: then nobody is admitted
    num_charged: int = 0  # fair: step.scheduled[:num_charged] is charged already
    fair_head: tuple[str, int] | None = None  # fair: (the waiting head's tenant, its first chunk's tokens)
    yielded: list[Request] = field(default_factory=list)  # fair: running chunks that gave way to the head
