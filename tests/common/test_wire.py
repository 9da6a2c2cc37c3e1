"""The worker protocol's codec: every type goes to the wire and back unchanged, under the proto's own names."""

from __future__ import annotations

import dataclasses

import pytest

from pagedserve.v1 import generate_pb2, worker_pb2
from pagedserve_common import wire
from pagedserve_common.kv_geometry import KVGeometry
from pagedserve_common.step import (NewSequence, PositionLogprobs, PromptLogprobs, SequenceDelta, StepError,
                                    StepErrorKind, StepPlan, StepResult, TokenLogprob)
from pagedserve_common.registration import WorkerRegistration
from pagedserve_common.sampling import SamplingParams, StructuredOutput


def through_the_wire(message):
    return type(message).FromString(message.SerializeToString())


def test_a_plan_with_every_field_set_comes_back_equal():
    sampling = SamplingParams(max_tokens=7, temperature=0.5, top_p=0.75, top_k=3, min_p=0.25, seed=11, n=2,
                              stop_token_ids=(5, 6), ignore_eos=True, logprobs=4, presence_penalty=0.5,
                              frequency_penalty=-0.25, repetition_penalty=1.5, logit_bias=((3, -100.0), (9, 2.5)),
                              min_tokens=2, bad_words_token_ids=((4,), (5, 6)), prompt_logprobs=3,
                              allowed_token_ids=(0, 4, 2**32 - 1))
    plan = StepPlan(9, new_seqs=[NewSequence(3, [1, 2, 3], [4, 5], 1, 2, sampling, 2**63 + 1, 2)],
                    running=[SequenceDelta(4, [7], 1), SequenceDelta(8, [], 4, [30, 31, 2**32 - 1])],
                    finished_seq_ids=[1],
                    preempted_seq_ids=[2], copies=[(1, 2)], swap_out=[(3, 0)], swap_in=[(1, 6)],
                    token_bitmasks={3: b"\x01\x00\x00\x80", 4: b"\xff\xff\xff\xff"})
    assert wire.plan_from_pb(through_the_wire(wire.plan_to_pb(plan))) == plan


@pytest.mark.parametrize("structured", [
    StructuredOutput("json_schema", '{"type": "object"}'), StructuredOutput("json_object"),
    StructuredOutput("regex", "[a-z]+"), StructuredOutput("choice", choices=("yes", "no")),
    StructuredOutput("grammar", 'start: "a"+'),
])
def test_each_kind_of_structured_output_comes_back_equal(structured):
    sampling = SamplingParams(structured_output=structured)
    assert wire.sampling_from_pb(through_the_wire(wire.sampling_to_pb(sampling))) == sampling


def test_unset_sampling_fields_read_as_the_documented_defaults():
    assert wire.sampling_from_pb(generate_pb2.SamplingParams()) == SamplingParams()
    assert wire.sampling_from_pb(generate_pb2.SamplingParams(temperature=0.0)).temperature == 0.0  # set, not unset


def test_a_clients_allowed_token_ids_read_ascending_each_once():
    pb = generate_pb2.SamplingParams(allowed_token_ids=[9, 3, 9, 0, 3])
    assert wire.sampling_from_pb(through_the_wire(pb)).allowed_token_ids == (0, 3, 9)
    assert wire.sampling_from_pb(generate_pb2.SamplingParams()).allowed_token_ids == ()  # none: every token


def test_a_result_keeps_its_tokens_and_logprobs_per_sequence():
    lp = PositionLogprobs(TokenLogprob(7, -0.5), (TokenLogprob(7, -0.5), TokenLogprob(3, -1.25)))
    result = StepResult(4, {10: 7, 11: 2}, {10: lp}, step_seconds=0.25, idle_seconds=0.125)
    assert wire.result_from_pb(through_the_wire(wire.result_to_pb(result))) == result


def test_a_result_keeps_each_sequences_prompt_logprobs_with_their_first_position_and_ranks():
    position = PositionLogprobs(TokenLogprob(9, -2.5), (TokenLogprob(3, -0.25),), rank=4)
    result = StepResult(4, {10: 7}, prompt_logprobs={10: PromptLogprobs(1, (position, position)),
                                                     11: PromptLogprobs(17, (position,))})  # 11: mid-prefill
    assert wire.result_from_pb(through_the_wire(wire.result_to_pb(result))) == result
    pb = wire.result_to_pb(result)
    pb.prompt_logprobs.add(seq_id=10, first_position=3)
    with pytest.raises(ValueError, match="prompt_logprobs: a seq has more than one entry"):
        wire.result_from_pb(pb)


def test_a_result_keeps_the_accepted_drafts_per_sequence_and_none_reads_as_zero():
    result = StepResult(4, {10: 7, 11: 2, 12: 5}, num_accepted_drafts={10: 3, 12: 1})
    pb = wire.result_to_pb(result)
    assert [t.num_accepted_drafts for t in pb.tokens] == [3, 0, 1]
    assert wire.result_from_pb(through_the_wire(pb)) == result
    old_worker = worker_pb2.StepResult(step_id=4, tokens=[worker_pb2.SampledToken(seq_id=10, token_id=7)])
    assert wire.result_from_pb(old_worker).num_accepted_drafts == {}  # an answer from before drafts: none accepted


def test_a_result_naming_a_sequence_twice_is_refused():
    pb = worker_pb2.StepResult(step_id=4)
    for seq_id, token_id in ((10, 7), (11, 2), (10, 3)):
        pb.tokens.add(seq_id=seq_id, token_id=token_id)
    with pytest.raises(ValueError, match="seq 10 has more than one token"):
        wire.result_from_pb(pb)


def test_a_step_error_keeps_its_kind_and_an_unknown_kind_reads_as_a_failed_step():
    err = StepError(3, StepErrorKind.BAD_PLAN, "block 99 is outside the pool")
    assert wire.step_error_from_pb(through_the_wire(wire.step_error_to_pb(err))) == err
    assert wire.step_error_from_pb(worker_pb2.StepError(step_id=1, kind=0)).kind is StepErrorKind.STEP_FAILED


def test_a_registration_and_its_kv_geometry_come_back_equal():
    reg = WorkerRegistration("m", 2048, "cuda:1", KVGeometry(30, 3, 64, "bfloat16", 32), 900, 40, "host:12")
    assert wire.registration_from_pb(through_the_wire(wire.registration_to_pb(reg))) == reg
    assert (reg.block_size, reg.dtype, reg.kv_geometry.bytes_per_token) == (32, "bfloat16", 2 * 30 * 3 * 64 * 2)


@pytest.mark.parametrize("geometry, match", [
    (worker_pb2.KVGeometry(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float64", block_size=16),
     "kv_geometry.dtype must be one of float32, float16, bfloat16, int8, fp8_e4m3, fp8_e5m2, got 'float64'"),
    (worker_pb2.KVGeometry(num_layers=1, num_kv_heads=1, head_dim=8, dtype="int4", block_size=16),
     "kv_geometry.dtype .* got 'int4'"),
    (worker_pb2.KVGeometry(num_layers=1, num_kv_heads=1, head_dim=8, dtype="x" * 100_000, block_size=16),
     "kv_geometry.dtype .* got 'x{40}'$"),
    (worker_pb2.KVGeometry(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", block_size=0), "block_size"),
    (None, "num_layers"),
])
def test_a_registration_whose_pool_cannot_exist_is_refused_naming_the_field(geometry, match):
    pb = worker_pb2.WorkerRegistration(model_id="m", num_blocks=4, max_model_len=64, device="cpu")
    if geometry is not None:
        pb.kv_geometry.CopyFrom(geometry)
    with pytest.raises(ValueError, match=match):
        wire.registration_from_pb(pb)


@pytest.mark.parametrize("cls, message", [
    (NewSequence, worker_pb2.NewSequence), (SequenceDelta, worker_pb2.SequenceDelta), (StepPlan, worker_pb2.StepPlan),
    (WorkerRegistration, worker_pb2.WorkerRegistration), (KVGeometry, worker_pb2.KVGeometry),
    (StepError, worker_pb2.StepError), (SamplingParams, generate_pb2.SamplingParams),
    (PositionLogprobs, generate_pb2.PositionLogprobs), (TokenLogprob, generate_pb2.TokenLogprob),
])
def test_each_type_has_the_fields_of_its_message_under_the_same_names(cls, message):
    """One name per concept: the in-memory type and its wire message differ only where the wire needs more
    (SamplingParams has no stop strings nor bad words: they need the tokenizer and stay with the front end)."""
    names = {f.name for f in dataclasses.fields(cls)}
    # NOTE: the front end's settings of the text ride in the proto's SamplingParams but not in the dataclass
    front_end = {"stop", "bad_words", "include_stop_str_in_output", "skip_special_tokens"}
    wire_names = set(message.DESCRIPTOR.fields_by_name) - front_end
    assert names == wire_names
