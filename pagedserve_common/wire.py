"""The worker protocol's codec (pagedserve.v1 worker.proto): the one place either service turns a plan, a
result, a step error or a registration into protobuf or back. Both ends import it, so they cannot drift."""

from __future__ import annotations

import dataclasses

from pagedserve.v1 import generate_pb2, worker_pb2
from pagedserve_common.kv_geometry import DTYPE_BYTES, KVGeometry
from pagedserve_common.step import (NewSequence, PositionLogprobs, PromptLogprobs, SequenceDelta, StepError,
                                    StepErrorKind, StepPlan, StepResult, TokenLogprob)
from pagedserve_common.registration import WorkerRegistration
from pagedserve_common.sampling import SamplingParams, StructuredOutput, allow_list

# NOTE: requests mostly share a few sampling settings, and a plan of new sequences carries one per sequence:
# both directions are cached (bounded) so that a step of 256 admissions converts them once, not 256 times.
_MAX_CACHED = 4096
_sampling_cache: dict[SamplingParams, generate_pb2.SamplingParams] = {}
_sampling_decoded: dict[bytes, SamplingParams] = {}


# -- sampling (also the client API's message) ----------------------------------------------------------------
def sampling_to_pb(sp: SamplingParams) -> generate_pb2.SamplingParams:
    pb = _sampling_cache.get(sp)
    if pb is None:
        pb = generate_pb2.SamplingParams(max_tokens=sp.max_tokens, temperature=sp.temperature, top_p=sp.top_p,
                                         top_k=sp.top_k, min_p=sp.min_p, n=sp.n,
                                         stop_token_ids=sp.stop_token_ids, ignore_eos=sp.ignore_eos,
                                         allowed_token_ids=sp.allowed_token_ids)
        if sp.seed is not None:
            pb.seed = sp.seed
        if sp.logprobs is not None:
            pb.logprobs = sp.logprobs
        if sp.prompt_logprobs is not None:
            pb.prompt_logprobs = sp.prompt_logprobs
        d = _DEFAULT
        for name in ("presence_penalty", "frequency_penalty", "repetition_penalty", "min_tokens"):
            if getattr(sp, name) != getattr(d, name):
                setattr(pb, name, getattr(sp, name))
        for token_id, bias in sp.logit_bias:
            pb.logit_bias[token_id] = bias
        for ids in sp.bad_words_token_ids:
            pb.bad_words_token_ids.add(token_ids=ids)
        if sp.structured_output is not None:
            structured_to_pb(sp.structured_output, pb.structured_output)
        if len(_sampling_cache) < _MAX_CACHED:
            _sampling_cache[sp] = pb
    return pb


def structured_to_pb(so: StructuredOutput, pb: generate_pb2.StructuredOutput) -> None:
    if so.kind == "json_object":
        pb.json_object = True
    elif so.kind == "choice":
        pb.choice.choices.extend(so.choices)
    else:
        setattr(pb, so.kind, so.spec)


def structured_from_pb(pb: generate_pb2.StructuredOutput) -> StructuredOutput | None:
    """None when no kind is set. NOTE: json_object false is kept as a json_object (validate refuses nothing
    there): only its presence counts, as with every oneof."""
    kind = pb.WhichOneof("kind")
    if kind is None:
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    if kind == "choice":
        return StructuredOutput("choice", choices=tuple(pb.choice.choices))
    return StructuredOutput(kind, getattr(pb, kind))


def _opt(pb, name: str, default):
    return getattr(pb, name) if pb.HasField(name) else default


def sampling_from_pb(pb: generate_pb2.SamplingParams) -> SamplingParams:
    """Unset fields take the defaults (SamplingParams', which generate.proto documents)."""
    key = pb.SerializeToString(deterministic=True)
    sp = _sampling_decoded.get(key)
    if sp is None:
        sp = _decode_sampling(pb)
        if len(_sampling_decoded) < _MAX_CACHED:
            _sampling_decoded[key] = sp
    return sp


# The fields a model's generation_config.json may give defaults to (scheduler_svc.frontend.model_defaults)
MODEL_DEFAULT_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def with_defaults(pb: generate_pb2.SamplingParams, sp: SamplingParams, defaults: SamplingParams) -> SamplingParams:
    """`sp` (decoded from `pb`) with the fields `pb` leaves unset taken from `defaults` instead of the API's."""
    if defaults == _DEFAULT:
        return sp
    unset = {name: getattr(defaults, name) for name in MODEL_DEFAULT_FIELDS if not pb.HasField(name)}
    return dataclasses.replace(sp, **unset) if unset else sp


def _decode_sampling(pb: generate_pb2.SamplingParams) -> SamplingParams:
    d = SamplingParams()
    return SamplingParams(max_tokens=_opt(pb, "max_tokens", d.max_tokens),
                          temperature=_opt(pb, "temperature", d.temperature), top_p=_opt(pb, "top_p", d.top_p),
                          top_k=_opt(pb, "top_k", d.top_k), min_p=_opt(pb, "min_p", d.min_p),
                          seed=_opt(pb, "seed", d.seed), n=_opt(pb, "n", d.n),
                          stop_token_ids=tuple(pb.stop_token_ids), ignore_eos=pb.ignore_eos,
                          logprobs=_opt(pb, "logprobs", d.logprobs),
                          prompt_logprobs=_opt(pb, "prompt_logprobs", d.prompt_logprobs),
                          presence_penalty=_opt(pb, "presence_penalty", d.presence_penalty),
                          frequency_penalty=_opt(pb, "frequency_penalty", d.frequency_penalty),
                          repetition_penalty=_opt(pb, "repetition_penalty", d.repetition_penalty),
                          logit_bias=tuple(sorted(pb.logit_bias.items())),
                          min_tokens=_opt(pb, "min_tokens", d.min_tokens),
                          bad_words_token_ids=tuple(tuple(t.token_ids) for t in pb.bad_words_token_ids),
                          allowed_token_ids=allow_list(pb.allowed_token_ids),
                          structured_output=structured_from_pb(pb.structured_output)
                          if pb.HasField("structured_output") else None)


_DEFAULT = SamplingParams()


# -- the plan: scheduler -> worker, every step ----------------------------------------------------------------
def plan_to_pb(plan: StepPlan) -> worker_pb2.StepPlan:
    pb = worker_pb2.StepPlan(step_id=plan.step_id, finished_seq_ids=plan.finished_seq_ids,
                             preempted_seq_ids=plan.preempted_seq_ids)
    add_new = pb.new_seqs.add
    for s in plan.new_seqs:
        add_new(seq_id=s.seq_id, token_ids=s.token_ids, block_ids=s.block_ids,
                num_computed_tokens=s.num_computed_tokens, num_scheduled_tokens=s.num_scheduled_tokens,
                sampling=sampling_to_pb(s.sampling), seed=s.seed, num_prompt_tokens=s.num_prompt_tokens)
    add_delta = pb.running.add
    for r in plan.running:
        if r.draft_token_ids:
            add_delta(seq_id=r.seq_id, new_block_ids=r.new_block_ids, num_scheduled_tokens=r.num_scheduled_tokens,
                      draft_token_ids=r.draft_token_ids)
        else:  # NOTE: the common case, without an empty list for protobuf to walk (once per sequence per step)
            add_delta(seq_id=r.seq_id, new_block_ids=r.new_block_ids, num_scheduled_tokens=r.num_scheduled_tokens)
    for pairs, field in ((plan.copies, pb.copies), (plan.swap_out, pb.swap_out), (plan.swap_in, pb.swap_in)):
        for src, dst in pairs:
            field.add(src=src, dst=dst)
    for seq_id, bitmask in plan.token_bitmasks.items():
        pb.token_bitmasks.add(seq_id=seq_id, bitmask=bitmask)
    return pb


def plan_from_pb(pb: worker_pb2.StepPlan) -> StepPlan:
    return StepPlan(
        step_id=pb.step_id,
        new_seqs=[NewSequence(n.seq_id, list(n.token_ids), list(n.block_ids), n.num_computed_tokens,
                              n.num_scheduled_tokens, sampling_from_pb(n.sampling), n.seed, n.num_prompt_tokens)
                  for n in pb.new_seqs],
        running=[SequenceDelta(r.seq_id, list(r.new_block_ids), r.num_scheduled_tokens, list(r.draft_token_ids))
                 for r in pb.running],
        finished_seq_ids=list(pb.finished_seq_ids), preempted_seq_ids=list(pb.preempted_seq_ids),
        copies=[(c.src, c.dst) for c in pb.copies], swap_out=[(c.src, c.dst) for c in pb.swap_out],
        swap_in=[(c.src, c.dst) for c in pb.swap_in],
        token_bitmasks={m.seq_id: m.bitmask for m in pb.token_bitmasks})


# -- the answer: worker -> scheduler, every step --------------------------------------------------------------
def logprobs_to_pb(lp: PositionLogprobs, pb: generate_pb2.PositionLogprobs) -> None:
    """Fills `pb` (a message's sub-message, or a new one) from `lp`."""
    pb.sampled.token_id, pb.sampled.logprob = lp.sampled.token_id, lp.sampled.logprob
    if lp.rank:
        pb.rank = lp.rank
    add = pb.top.add
    for t in lp.top:
        add(token_id=t.token_id, logprob=t.logprob)


def logprobs_from_pb(pb: generate_pb2.PositionLogprobs) -> PositionLogprobs:
    return PositionLogprobs(TokenLogprob(pb.sampled.token_id, pb.sampled.logprob),
                            tuple(TokenLogprob(t.token_id, t.logprob) for t in pb.top), pb.rank)


def result_to_pb(result: StepResult) -> worker_pb2.StepResult:
    pb = worker_pb2.StepResult(step_id=result.step_id, step_seconds=result.step_seconds,
                               idle_seconds=result.idle_seconds)
    add, logprobs, accepted = pb.tokens.add, result.logprobs, result.num_accepted_drafts
    for seq_id, token_id in result.sampled.items():
        t = add(seq_id=seq_id, token_id=token_id)
        if accepted and (n := accepted.get(seq_id)):
            t.num_accepted_drafts = n
        lp = logprobs.get(seq_id) if logprobs else None
        if lp is not None:
            logprobs_to_pb(lp, t.logprobs)
    for seq_id, chunk in result.prompt_logprobs.items():
        out = pb.prompt_logprobs.add(seq_id=seq_id, first_position=chunk.first_position)
        add_position = out.positions.add
        for lp in chunk.positions:
            logprobs_to_pb(lp, add_position())
    return pb


def result_from_pb(pb: worker_pb2.StepResult) -> StepResult:
    """Raises ValueError when a seq_id appears twice in tokens or in prompt_logprobs (a dict would keep the last
    silently)."""
    sampled, logprobs, accepted = {}, {}, {}
    for t in pb.tokens:
        sampled[t.seq_id] = t.token_id
        if t.HasField("logprobs"):
            logprobs[t.seq_id] = logprobs_from_pb(t.logprobs)
        if t.num_accepted_drafts:
            accepted[t.seq_id] = t.num_accepted_drafts
    if len(sampled) != len(pb.tokens):
        seen: set[int] = set()
        twice = next(t.seq_id for t in pb.tokens if t.seq_id in seen or seen.add(t.seq_id))
        raise ValueError(f"tokens: seq {twice} has more than one token")
    prompt = {p.seq_id: PromptLogprobs(p.first_position, tuple(logprobs_from_pb(lp) for lp in p.positions))
              for p in pb.prompt_logprobs}
    if len(prompt) != len(pb.prompt_logprobs):
        raise ValueError("prompt_logprobs: a seq has more than one entry")
    return StepResult(pb.step_id, sampled, logprobs, pb.step_seconds, pb.idle_seconds, accepted, prompt)


def step_error_to_pb(err: StepError) -> worker_pb2.StepError:
    return worker_pb2.StepError(step_id=err.step_id, kind=int(err.kind), message=err.message)


def step_error_from_pb(pb: worker_pb2.StepError) -> StepError:
    """NOTE: an unknown kind (a newer worker's) reads as STEP_FAILED: either way the worker is lost."""
    kind = pb.kind if pb.kind in StepErrorKind._value2member_map_ else StepErrorKind.STEP_FAILED
    return StepError(pb.step_id, StepErrorKind(kind), pb.message)


# -- registration: a worker's first message ------------------------------------------------------------------
def registration_to_pb(reg: WorkerRegistration) -> worker_pb2.WorkerRegistration:
    g = reg.kv_geometry
    return worker_pb2.WorkerRegistration(
        model_id=reg.model_id, max_model_len=reg.max_model_len, device=reg.device,
        kv_geometry=worker_pb2.KVGeometry(num_layers=g.num_layers, num_kv_heads=g.num_kv_heads, head_dim=g.head_dim,
                                          dtype=g.dtype, block_size=g.block_size, layer_windows=g.layer_windows),
        num_blocks=reg.num_blocks, num_cpu_blocks=reg.num_cpu_blocks, name=reg.name)


def registration_from_pb(pb: worker_pb2.WorkerRegistration) -> WorkerRegistration:
    """Raises ValueError naming the field when the geometry is not one a pool can have (an unknown dtype, a zero
    size)."""
    g = pb.kv_geometry
    if min(g.num_layers, g.num_kv_heads, g.head_dim, g.block_size) < 1:
        raise ValueError("kv_geometry: num_layers, num_kv_heads, head_dim and block_size must be >= 1")
    if g.dtype not in DTYPE_BYTES:  # NOTE: what a peer sent: quoted short, whatever its length
        raise ValueError(f"kv_geometry.dtype must be one of {', '.join(DTYPE_BYTES)}, got {g.dtype[:40]!r}")
    if g.layer_windows and len(g.layer_windows) != g.num_layers:
        raise ValueError(f"kv_geometry.layer_windows must have one window per layer ({g.num_layers}), got "
                         f"{len(g.layer_windows)}")
    return WorkerRegistration(
        model_id=pb.model_id, max_model_len=pb.max_model_len, device=pb.device,
        kv_geometry=KVGeometry(g.num_layers, g.num_kv_heads, g.head_dim, g.dtype, g.block_size,
                               tuple(g.layer_windows)),
        num_blocks=pb.num_blocks, num_cpu_blocks=pb.num_cpu_blocks, name=pb.name)
