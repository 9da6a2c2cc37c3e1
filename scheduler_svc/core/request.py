"""Requests as the scheduler sees them: sampling settings, lifecycle state and the tokens known so far."""

from __future__ import annotations

import enum
import time
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagedserve_common.sampling import SamplingParams
from scheduler_svc.core.prompt_logprobs import PromptLogprobsLog
from scheduler_svc.core.tenancy import client_request_id


class RequestStatus(enum.Enum):
    WAITING = 0  # never admitted
    RUNNING = 1  # holds blocks (or, for a forked parent, its children do)
    PREEMPTED = 2  # lost its blocks; waits at the front of the queue to be recomputed (or swapped back in)
    FINISHED = 3


class FinishReason(enum.IntEnum):
    # NOTE: values match pagedserve.v1.FinishReason, so the front end can pass them through.
    LENGTH = 1
    STOP = 2
    STOP_STRING = 3  # set by the caller through Scheduler.finish(): stop strings need detokenization
    ABORT = 4


TOKEN_TYPECODE = "i"  # int32: every vocabulary's ids fit (uint32 on the wire; the engine refuses the rest)


def token_ids(ids: Iterable[int] = ()) -> array:
    """Token ids as a Request holds them: array('i'), 4 bytes a token. An array('i') given is kept, not copied.

    NOTE: an array's GC traversal is O(1): a full collection never walks its tokens, as it walks a list's, so
    100,000 queued requests cost the collector 100,000 visits, not 100 million (bench/sched_scale.py).
    """
    if type(ids) is array and ids.typecode == TOKEN_TYPECODE:
        return ids
    return array(TOKEN_TYPECODE, ids)


# NOTE: eq=False: a request is equal only to itself. `running.remove(seq)` and `seq in waiting` then compare by
# identity, not field by field (which cost ~1.4 ms a step at 1,024 running sequences, bench/sched_scale.py).
@dataclass(slots=True, eq=False)
class Request:
    """A client request as the scheduler holds it: its prompt, sampling, state and tokens, and the sequence it
    runs as on its worker (seq_id, the name the worker protocol knows). With n == 1 that is the whole request.
    With n > 1 the request first computes its prompt but the last token (the parent), then forks into n child
    Requests, one per sample (index 0..n-1, the same request_id, each with a seq_id of its own), that share the
    parent's blocks, each computing the last prompt token itself (copy-on-write of the shared partial block).
    The parent never samples; it finishes when its last child does.
    """

    request_id: str  # the engine's key: the client's id scoped by its tenant (core.tenancy.scoped_request_id)
    # NOTE: token ids are array('i') (token_ids()): compare them with list(...) == [...]. A list given is copied.
    prompt_token_ids: array
    sampling: SamplingParams = field(default_factory=SamplingParams)
    cache_salt: str | None = None  # its prefix-cache chain's salt: its tenant and the client's (tenancy.prefix_salt)
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0  # the priority policy admits lower first (scheduler_svc.core.waiting)
    tenant: str = ""  # whose service it counts as under the fair policy ("": the one shared tenant)
    admitted_priority: int = 0  # its effective priority (aged) when last admitted: what a newcomer must beat
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: array = field(default_factory=token_ids)
    # NOTE: prompt + outputs, appended to as tokens arrive; never rebuilt (the hot path reads it every step).
    all_token_ids: array = field(default_factory=token_ids)
    num_computed_tokens: int = 0
    seq_id: int = -1  # assigned by the scheduler; the sequence's id on the worker
    seed: int = 0  # the seed actually used (assigned by the scheduler when sampling.seed is None)
    num_preemptions: int = 0
    num_migrations: int = 0  # workers lost while this request was in their step (see Engine, --max-migrations)
    num_cached_prompt_tokens: int = 0  # prefix-cache hit at first admission
    first_scheduled_time: float = 0.0  # monotonic, at its first admission on a worker (its queue time ends); 0: not yet
    finish_reason: FinishReason | None = None
    index: int = 0  # which of the n samples this sequence is
    # NOTE: set on the children of a forked request until the parent finishes; then None, so that a finished
    # request is no reference cycle (refcounting frees it, not a full collection: scheduler_svc/gc_policy.py).
    parent: Request | None = None
    children: list[Request] = field(default_factory=list)
    fork_into: int = 0  # > 0: a parent still to fork into this many children once its prefix is computed
    on_worker: bool = False  # the worker holds this sequence's state: send deltas, never the table again
    cpu_block_ids: list[int] | None = None  # swapped out: its computed KV sits in these CPU swap blocks
    stop_ids: frozenset[int] = frozenset()  # stop_token_ids, plus EOS unless ignore_eos
    # Structured output: this sample's grammar state (scheduler_svc.structured.Constraint; None: free text). It
    # consumes each committed output token; a fork parent's is only the template of its children's.
    constraint: object | None = None
    # Speculative decoding (scheduler_svc.core.speculation): the drafts of the plan in flight, and the backoff of a
    # sequence whose drafts failed (steps to wait before drafting again; drafts refused in a row).
    draft_token_ids: list[int] | tuple[()] = ()  # NOTE: a shared () while not drafting: no list a request
    spec_backoff: int = 0
    spec_misses: int = 0
    # Prompt logprobs (sampling.prompt_logprobs set; else None): the positions received so far, kept across
    # preemptions and migrations; a fork's samples share their parent's (scheduler_svc.core.prompt_logprobs).
    prompt_log: PromptLogprobsLog | None = None
    # The worker holds this sequence with prompt_logprobs in its sampling (set by each NewSequence sent: left out
    # once the log is complete), so its prompt rows answer them.
    prompt_logprobs_on_worker: bool = False

    def __post_init__(self) -> None:
        if self.prompt_log is None and self.sampling.prompt_logprobs is not None:
            self.prompt_log = PromptLogprobsLog(len(self.prompt_token_ids))
        try:
            self.prompt_token_ids = token_ids(self.prompt_token_ids)
            self.output_token_ids = token_ids(self.output_token_ids)
            self.all_token_ids = token_ids(self.all_token_ids) if self.all_token_ids else \
                self.prompt_token_ids + self.output_token_ids
        except OverflowError:
            # NOTE: an id outside int32 is in no vocabulary: kept as given (lists), so that the engine's check
            # refuses the request naming the field (FrontEnd._check); such a request never reaches a Scheduler.
            self.prompt_token_ids, self.output_token_ids = list(self.prompt_token_ids), list(self.output_token_ids)
            self.all_token_ids = [*self.prompt_token_ids, *self.output_token_ids]

    @property
    def client_request_id(self) -> str:
        """The request id its client sent (or was given): what answers, logs and GetKVState show."""
        return client_request_id(self.request_id)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    def fork_child(self, index: int, seq_id: int) -> Request:
        """Sample `index` of this parent, whose prefix is computed: it shares the parent's tokens so far (its
        blocks: KVCacheManager.fork), runs with the parent's seed + index, and starts running at once."""
        return Request(self.request_id, self.prompt_token_ids, self.sampling, self.cache_salt, self.arrival_time,
                       self.priority, self.tenant, status=RequestStatus.RUNNING,
                       admitted_priority=self.admitted_priority, all_token_ids=self.all_token_ids[:],
                       num_computed_tokens=self.num_computed_tokens, seq_id=seq_id,
                       seed=(self.seed + index) % 2**64, index=index, parent=self,
                       num_cached_prompt_tokens=self.num_cached_prompt_tokens, stop_ids=self.stop_ids,
                       constraint=self.constraint and self.constraint.fork(),
                       prompt_log=self.prompt_log)  # NOTE: complete: the parent computed rows 0 .. P - 2

    def num_target_tokens(self) -> int:
        """Tokens to compute before the next sample; a parent to fork stops before its last prompt token."""
        return len(self.all_token_ids) - 1 if self.fork_into else len(self.all_token_ids)


@dataclass(slots=True)
class RequestOutput:
    """What one step produced for one sample of a request, for streaming."""

    request_id: str
    index: int  # which of the n samples
    new_token_ids: list[int]
    finish_reason: FinishReason | None = None
    seq_id: int = -1  # the sequence on the worker (to pick its logprobs off the step result)
    # The sample ended because its structured output's matcher gave up (a step's work limit): its text does not
    # match the grammar, so the request ends with an error, never with a finish reason (Engine.deliver)
    constraint_failed: bool = False
