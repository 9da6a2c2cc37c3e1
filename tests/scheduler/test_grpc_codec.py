"""The client API's lenient request parsing (scheduler_svc.grpc.convert): a message that does not parse becomes an
Undecodable naming the string field whose bytes are not UTF-8, found by walking the wire format."""

from __future__ import annotations

import pytest

from pagedserve.v1 import generate_pb2 as pb
from scheduler_svc.grpc.convert import Undecodable, bad_utf8_field, lenient

MARKER = b"QZQZ"


def broken(request) -> bytes:
    """The wire bytes of `request` with the one string holding MARKER made invalid UTF-8, at the same length."""
    data = request.SerializeToString()
    assert data.count(MARKER) == 1
    return data.replace(MARKER, b"\xff\xfe" + MARKER[2:])


@pytest.mark.parametrize("field, request_", [
    ("prompt", pb.GenerateRequest(prompt="QZQZ", request_id="r", prompt_token_ids=[1, 300_000])),
    ("request_id", pb.GenerateRequest(prompt="hi", request_id="QZQZ")),
    ("cache_salt", pb.GenerateRequest(prompt="hi", cache_salt="QZQZ", sampling=pb.SamplingParams(max_tokens=3))),
    ("messages[2].content", pb.GenerateRequest(messages=[pb.ChatMessage(role="user", content=c)
                                                         for c in ("a", "b", "QZQZ")])),
    ("sampling.stop[1]", pb.GenerateRequest(prompt="hi", sampling=pb.SamplingParams(seed=7, stop=["a", "QZQZ"]))),
])
def test_the_bad_string_is_named(field, request_):
    data = broken(request_)
    assert bad_utf8_field(data, pb.GenerateRequest.DESCRIPTOR) == field
    readable_id = "" if field == "request_id" else request_.request_id  # for the log's request_id
    assert lenient(pb.GenerateRequest)(data) == Undecodable(f"{field} is not valid UTF-8 (a protobuf string must be)",
                                                            field, readable_id)


def test_a_good_message_parses_and_a_corrupt_one_says_so():
    request_ = pb.GenerateRequest(prompt="héllo", sampling=pb.SamplingParams(stop=["ß"]))
    assert lenient(pb.GenerateRequest)(request_.SerializeToString()) == request_
    for data in (b"\x0a\xff\x01x", b"\x0a", b"\xff\xff\xff"):  # truncated, a bare tag, a runaway varint
        got = lenient(pb.GenerateRequest)(data)
        assert isinstance(got, Undecodable) and got.field is None
        assert got.message.startswith("the request is not a valid pagedserve.v1.GenerateRequest message")


def test_prompt_logprobs_go_out_one_entry_per_prompt_token_the_first_empty():
    from pagedserve_common.step import PositionLogprobs, TokenLogprob
    from scheduler_svc.frontend.stream import StreamItem
    from scheduler_svc.grpc.convert import item_to_pb

    second = PositionLogprobs(TokenLogprob(8, -1.5), (TokenLogprob(3, -0.25),), rank=2)
    out = item_to_pb("r", StreamItem(0, [7, 8], "ab", prompt_logprobs=[None, second], echo=True))
    first, entry = out.prompt_logprobs
    assert not first.HasField("sampled") and not first.top and first.rank == 0
    assert (entry.sampled.token_id, entry.sampled.logprob, entry.rank, [(t.token_id, t.logprob) for t in entry.top]) \
        == (8, -1.5, 2, [(3, -0.25)])
    assert not item_to_pb("r", StreamItem(0, [9], "c")).prompt_logprobs  # none asked: none sent
