"""Scheduler plans to and from the worker protocol: the only place the scheduler touches protobuf."""

from __future__ import annotations

from pagedserve.v1 import generate_pb2, worker_pb2

from scheduler_svc.core.kv_snapshot import KVPoolSnapshot
from scheduler_svc.core.plan import StepFailure, StepPlan, WorkerRegistration
from scheduler_svc.core.request import SamplingConfig
from scheduler_svc.frontend import GenerateInput, StreamItem
from scheduler_svc.frontend.limits import Limits

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
    for pairs, field in ((plan.copies, pb.copies), (plan.swap_out, pb.swap_out), (plan.swap_in, pb.swap_in)):
        for src, dst in pairs:
            field.add(src=src, dst=dst)
    return pb


def result_from_pb(result: worker_pb2.StepResult) -> dict[int, int]:
    """seq_id -> sampled token. Logprobs travel separately (the front end reads them off the message)."""
    return {t.seq_id: t.token_id for t in result.tokens}


# -- the client API -----------------------------------------------------------------------------------------
def _opt(pb, name: str, default):
    return getattr(pb, name) if pb.HasField(name) else default


def sampling_from_pb(pb: generate_pb2.SamplingParams) -> tuple[SamplingConfig, tuple[str, ...]]:
    """Unset fields take the defaults documented in generate.proto; returns (sampling, stop strings)."""
    sp = SamplingConfig(max_tokens=_opt(pb, "max_tokens", 16), temperature=_opt(pb, "temperature", 1.0),
                        top_p=_opt(pb, "top_p", 1.0), top_k=_opt(pb, "top_k", 0), min_p=_opt(pb, "min_p", 0.0),
                        seed=_opt(pb, "seed", None), n=_opt(pb, "n", 1), stop_token_ids=tuple(pb.stop_token_ids),
                        ignore_eos=pb.ignore_eos, logprobs=_opt(pb, "logprobs", None))
    return sp, tuple(pb.stop)


def input_from_pb(pb: generate_pb2.GenerateRequest, limits: Limits) -> GenerateInput:
    """An input counts as set when present: prompt by presence (even empty), the lists when non-empty.
    NOTE: list lengths are checked before any list is copied; prompt_token_ids stays the message's own container
    (the front end checks its length before copying it)."""
    limits.check_counts(len(pb.sampling.stop), len(pb.sampling.stop_token_ids), len(pb.messages))
    sampling, stop = sampling_from_pb(pb.sampling)
    return GenerateInput(prompt=pb.prompt if pb.HasField("prompt") else None,
                         prompt_token_ids=pb.prompt_token_ids or None,
                         messages=[{"role": m.role, "content": m.content} for m in pb.messages] or None,
                         sampling=sampling, stop=stop, request_id=pb.request_id, cache_salt=pb.cache_salt)


def item_to_pb(request_id: str, item: StreamItem) -> generate_pb2.GenerateResponse:
    pb = generate_pb2.GenerateResponse(request_id=request_id, index=item.index, token_ids=item.token_ids,
                                       text=item.text, logprobs=item.logprobs)
    if item.finish_reason is not None:
        pb.finish_reason = int(item.finish_reason)
        pb.usage.prompt_tokens = item.prompt_tokens
        pb.usage.completion_tokens = item.completion_tokens
        pb.usage.cached_prompt_tokens = item.cached_prompt_tokens
    return pb


def registration_from_pb(pb: worker_pb2.WorkerRegistration) -> WorkerRegistration:
    return WorkerRegistration(model_id=pb.model_id, num_blocks=pb.num_blocks, block_size=pb.block_size,
                              dtype=pb.dtype, max_model_len=pb.max_model_len, device=pb.device,
                              num_cpu_blocks=pb.num_cpu_blocks, name=pb.name)


def step_error_from_pb(pb: worker_pb2.StepError) -> StepFailure:
    return StepFailure(pb.step_id, worker_pb2.StepError.Kind.Name(pb.kind), pb.message)


def model_info_to_pb(model_id: str, max_model_len: int, vocab_size: int, max_n: int,
                     workers: dict) -> generate_pb2.GetModelInfoResponse:
    pb = generate_pb2.GetModelInfoResponse(model_id=model_id, max_model_len=max_model_len, vocab_size=vocab_size,
                                           max_n=max_n)
    for worker_id, w in workers.items():
        r = w.registration
        pb.block_size = r.block_size
        pb.workers.add(worker_id=worker_id, num_blocks=r.num_blocks, block_size=r.block_size, dtype=r.dtype,
                       device=r.device, name=r.name)
    return pb


def kv_state_to_pb(snap: KVPoolSnapshot) -> generate_pb2.KVState:
    pb = generate_pb2.KVState(
        worker_id=snap.worker_id, block_size=snap.block_size, num_blocks=snap.num_blocks,
        ref_counts=snap.ref_counts, cached=snap.cached, kv_allocation=snap.kv_allocation, num_steps=snap.num_steps,
        num_waiting=snap.num_waiting, prefix_query_tokens=snap.prefix_query_tokens,
        prefix_hit_tokens=snap.prefix_hit_tokens, num_evictions=snap.num_evictions,
        num_preemptions=snap.num_preemptions, num_prefill_tokens=snap.num_prefill_tokens, time=snap.time,
        waiting_for_blocks=snap.waiting_for_blocks)
    add = pb.sequences.add
    for s in snap.sequences:
        add(request_id=s.request_id, seq_id=s.seq_id, block_ids=s.block_ids, num_tokens=s.num_tokens)
    return pb
