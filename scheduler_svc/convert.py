"""Scheduler plans to and from the worker protocol: the only place the scheduler touches protobuf."""

from __future__ import annotations

from pagedserve.v1 import generate_pb2, worker_pb2

from scheduler_svc.core.plan import StepPlan
from scheduler_svc.core.request import SamplingConfig

_sampling_cache: dict[SamplingConfig, generate_pb2.SamplingParams] = {}


def sampling_to_pb(sp: SamplingConfig) -> generate_pb2.SamplingParams:
    """What the worker needs to sample; stop strings stay on the scheduler (they need detokenization)."""
    pb = _sampling_cache.get(sp)
    if pb is None:
        pb = generate_pb2.SamplingParams(max_tokens=sp.max_tokens, temperature=sp.temperature, top_p=sp.top_p,
                                         top_k=sp.top_k, min_p=sp.min_p, n=sp.n,
                                         stop_token_ids=sp.stop_token_ids, ignore_eos=sp.ignore_eos)
        if sp.seed is not None:
            pb.seed = sp.seed
        if sp.logprobs is not None:
            pb.logprobs = sp.logprobs
        if len(_sampling_cache) < 4096:  # NOTE: requests mostly share a few configs; bound it anyway
            _sampling_cache[sp] = pb
    return pb


def plan_to_pb(plan: StepPlan) -> worker_pb2.StepPlan:
    pb = worker_pb2.StepPlan(step_id=plan.step_id, finished_seq_ids=plan.finished_seq_ids,
                             preempted_seq_ids=plan.preempted_seq_ids)
    add_new = pb.new_requests.add
    for s in plan.new:
        add_new(seq_id=s.seq_id, token_ids=s.token_ids, block_ids=s.block_ids,
                num_computed_tokens=s.num_computed_tokens, num_scheduled_tokens=s.num_scheduled_tokens,
                sampling=sampling_to_pb(s.sampling), seed=s.seed)
    add_running = pb.running.add
    for r in plan.running:
        add_running(seq_id=r.seq_id, new_block_ids=r.new_block_ids, num_scheduled_tokens=r.num_scheduled_tokens)
    if plan.copies:
        add_copy = pb.copies.add
        for src, dst in plan.copies:
            add_copy(src=src, dst=dst)
    return pb


def result_from_pb(result: worker_pb2.StepResult) -> dict[int, int]:
    """seq_id -> sampled token. Logprobs travel separately (the front end reads them off the message)."""
    return {t.seq_id: t.token_id for t in result.tokens}
