"""The client API's codec (pagedserve.v1 generate.proto): requests in, stream items, model info and KV state out.
The worker protocol has its own (pagedserve_common.wire)."""

from __future__ import annotations

from pagedserve.v1 import generate_pb2

from pagedserve_common.wire import logprobs_to_pb, sampling_from_pb
from scheduler_svc.core.kv_snapshot import KVPoolSnapshot
from scheduler_svc.frontend.inputs import GenerateInput
from scheduler_svc.frontend.limits import Limits
from scheduler_svc.frontend.stream import StreamItem


def input_from_pb(pb: generate_pb2.GenerateRequest, limits: Limits) -> GenerateInput:
    """An input counts as set when present: prompt by presence (even empty), the lists when non-empty.
    NOTE: list lengths are checked before any list is copied; prompt_token_ids stays the message's own container
    (the front end checks its length before copying it)."""
    limits.check_counts(len(pb.sampling.stop), len(pb.sampling.stop_token_ids), len(pb.messages))
    return GenerateInput(prompt=pb.prompt if pb.HasField("prompt") else None,
                         prompt_token_ids=pb.prompt_token_ids or None,
                         messages=[{"role": m.role, "content": m.content} for m in pb.messages] or None,
                         sampling=sampling_from_pb(pb.sampling), stop=tuple(pb.sampling.stop),
                         request_id=pb.request_id, cache_salt=pb.cache_salt)


def item_to_pb(request_id: str, item: StreamItem) -> generate_pb2.GenerateResponse:
    pb = generate_pb2.GenerateResponse(request_id=request_id, index=item.index, token_ids=item.token_ids,
                                       text=item.text)
    for lp in item.logprobs:
        logprobs_to_pb(lp, pb.logprobs.add())
    if item.finish_reason is not None:
        pb.finish_reason = int(item.finish_reason)
        pb.usage.prompt_tokens = item.prompt_tokens
        pb.usage.completion_tokens = item.completion_tokens
        pb.usage.cached_prompt_tokens = item.cached_prompt_tokens
    return pb


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
