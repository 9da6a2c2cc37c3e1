"""Worker plans and results to and from the wire protocol: the only place the worker touches protobuf."""

from __future__ import annotations

from pagedserve.v1 import worker_pb2
from worker_svc.plan import NewSeq, SeqDelta, StepOutput, StepPlan
from worker_svc.sampling import SamplingOptions


def sampling_from_pb(pb, seed: int) -> SamplingOptions:
    """Unset optional fields take the documented defaults; the scheduler always fixes the seed."""
    return SamplingOptions(temperature=pb.temperature if pb.HasField("temperature") else 1.0,
                           top_p=pb.top_p if pb.HasField("top_p") else 1.0,
                           top_k=pb.top_k, min_p=pb.min_p, seed=seed,
                           logprobs=pb.logprobs if pb.HasField("logprobs") else None)


def plan_from_pb(pb: worker_pb2.StepPlan) -> StepPlan:
    return StepPlan(
        step_id=pb.step_id,
        new_seqs=[NewSeq(n.seq_id, list(n.token_ids), list(n.block_ids), n.num_computed_tokens,
                         n.num_scheduled_tokens, sampling_from_pb(n.sampling, n.seed)) for n in pb.new_requests],
        running=[SeqDelta(r.seq_id, list(r.new_block_ids), r.num_scheduled_tokens) for r in pb.running],
        finished_seq_ids=list(pb.finished_seq_ids), preempted_seq_ids=list(pb.preempted_seq_ids),
        copies=[(c.src, c.dst) for c in pb.copies], swap_out=[(c.src, c.dst) for c in pb.swap_out],
        swap_in=[(c.src, c.dst) for c in pb.swap_in])


def result_to_pb(out: StepOutput) -> worker_pb2.StepResult:
    pb = worker_pb2.StepResult(step_id=out.step_id, step_seconds=out.step_seconds)
    for seq_id, token_id, lp in zip(out.seq_ids, out.token_ids, out.logprobs):
        t = pb.tokens.add(seq_id=seq_id, token_id=token_id)
        if lp is not None:
            t.logprobs.sampled.token_id, t.logprobs.sampled.logprob = lp.token_id, lp.logprob
            for tok, logprob in lp.top:
                t.logprobs.top.add(token_id=tok, logprob=logprob)
    return pb
