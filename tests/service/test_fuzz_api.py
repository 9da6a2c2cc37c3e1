"""Hypothesis-generated GenerateRequests against a live scheduler and worker: each ends OK, INVALID_ARGUMENT or
RESOURCE_EXHAUSTED within its deadline (never INTERNAL, UNKNOWN or a hang), and nothing leaks."""

from __future__ import annotations

import math

import grpc
import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc
from tests.support.service import assert_idle_and_serving

U32, U64 = 2**32, 2**64
ALLOWED = {grpc.StatusCode.OK, grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED}
RPC_TIMEOUT = 120  # NOTE: valid requests are kept small (a few tokens); this only catches a hang


@pytest.fixture(scope="module")
def api(service):
    """(stub, GetModelInfo): the server's bounds, so that valid values stay small and invalid ones are just over."""
    with service.channel() as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        yield stub, stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=30)


def text(max_size: int = 64, min_size: int = 0) -> st.SearchStrategy[str]:
    return st.text(st.characters(exclude_categories=("Cs",)), min_size=min_size, max_size=max_size)  # UTF-8 only


def big_text() -> st.SearchStrategy[str]:
    """A few KB (other bounds may refuse it: INVALID_ARGUMENT)."""
    return st.one_of(st.integers(1000, 4000).map(lambda n: "x" * n), text(3000, min_size=1000))


def over(limit: int) -> st.SearchStrategy[int]:
    """An unsigned value out of range: 0, just over `limit`, any uint32 over it, or a negative number as
    JavaScript sends it (wrapped to 2^32 - x)."""
    return st.one_of(st.just(0), st.integers(limit + 1, limit + 3), st.integers(limit + 1, U32 - 1),
                     st.integers(1, 2**31).map(lambda x: U32 - x))


def bad_float(*also: float) -> st.SearchStrategy[float]:
    return st.sampled_from((math.nan, math.inf, -math.inf, -1.0, -1e-30, *also))


def fields(info) -> dict[str, tuple[st.SearchStrategy, st.SearchStrategy]]:
    """Each SamplingParams / GenerateRequest field: (valid values, broken ones). Valid requests stay small."""
    vocab, max_len = info.vocab_size, info.max_model_len
    tiny = st.sampled_from((1e-38, 1e-30, 1e-7))  # valid, and hard on a sampler
    chat = st.builds(pb.ChatMessage, role=st.sampled_from(("system", "user", "assistant")), content=text(200))
    return {
        "max_tokens": (st.integers(1, 6), over(max_len)),
        "temperature": (st.one_of(st.floats(0, 2, width=32), tiny, st.just(3e38)), bad_float()),
        "top_p": (st.one_of(st.floats(0, 1, width=32, exclude_min=True), tiny), bad_float(0.0, 1.0001, 2.0)),
        "top_k": (st.one_of(st.integers(-1, 60), st.integers(vocab - 2, 2**31 - 1)), st.integers(-2**31, -2)),
        "min_p": (st.one_of(st.floats(0, 1, width=32), tiny), bad_float(1.0001, 2.0)),
        "seed": (st.integers(0, U64 - 1), st.integers(0, U64 - 1)),
        "n": (st.integers(1, 3), over(info.max_n)),
        "stop": (st.lists(text(8), max_size=4), st.lists(st.one_of(text(8), big_text()), min_size=1, max_size=40)),
        "stop_token_ids": (st.lists(st.integers(0, vocab - 1), max_size=4),
                           st.lists(st.integers(vocab, U32 - 1), min_size=1, max_size=4)),
        "ignore_eos": (st.booleans(), st.booleans()),
        "logprobs": (st.integers(0, 20), over(20)),
        "request_id": (text(40), big_text()),
        "cache_salt": (text(40), big_text()),
        "prompt": (text(200, min_size=1), st.one_of(st.just(""), big_text())),
        "prompt_token_ids": (st.lists(st.integers(0, vocab - 1), min_size=1, max_size=40),
                             st.one_of(st.lists(st.integers(vocab, U32 - 1), min_size=1, max_size=4),
                                       st.lists(st.integers(0, vocab - 1), min_size=max_len - 2,
                                                max_size=max_len + 4))),
        "messages": (st.lists(chat, min_size=1, max_size=4),
                     st.lists(st.builds(pb.ChatMessage, role=text(12), content=text(200)), max_size=4)),
    }


REQUEST_FIELDS = ("request_id", "cache_salt")
INPUTS = ("prompt", "prompt_token_ids", "messages")


@st.composite
def requests(draw, info) -> pb.GenerateRequest:
    """Mostly one input and valid fields, some unset; in most requests one field broken, or two inputs, or none."""
    table = fields(info)
    broken = draw(st.sampled_from((None, None, "two inputs", "no input", *table)))
    inputs = {draw(st.sampled_from(INPUTS))} if broken != "no input" else set()
    if broken == "two inputs":
        inputs |= set(draw(st.lists(st.sampled_from(INPUTS), min_size=1, max_size=3)))
    if broken in INPUTS:
        inputs = {broken}
    values = {}
    for name, (valid, bad) in table.items():
        if name == broken:
            values[name] = draw(bad)
        elif name in inputs or (name not in INPUTS and draw(st.booleans())):
            values[name] = draw(valid)
    sampling = pb.SamplingParams(**{k: v for k, v in values.items() if k not in INPUTS + REQUEST_FIELDS})
    return pb.GenerateRequest(sampling=sampling, **{k: v for k, v in values.items() if k in INPUTS + REQUEST_FIELDS})


def check_stream(request: pb.GenerateRequest, responses: list[pb.GenerateResponse]) -> None:
    """An OK stream ends every one of its n samples with a finish_reason, within max_tokens."""
    sp = request.sampling
    n = sp.n if sp.HasField("n") else 1
    finished = {r.index: r for r in responses if r.finish_reason != pb.FINISH_REASON_UNSPECIFIED}
    assert sorted(finished) == list(range(n)), (n, responses[-3:])
    max_tokens = sp.max_tokens if sp.HasField("max_tokens") else 16
    assert all(r.usage.completion_tokens <= max_tokens for r in finished.values()), finished


@settings(derandomize=True, deadline=None, max_examples=400, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_generated_requests_end_with_a_meaningful_status(api, data):
    stub, info = api
    request = data.draw(requests(info))
    try:
        responses = list(stub.Generate(request, timeout=RPC_TIMEOUT))
    except grpc.RpcError as e:
        event(e.code().name)  # pytest --hypothesis-show-statistics counts them
        assert e.code() in ALLOWED, f"{e.code().name}: {e.details()}\nfor {request}"
        return
    event("OK")
    check_stream(request, responses)


def test_afterwards_no_block_is_held_and_a_normal_request_works(api, service):
    assert_idle_and_serving(service)
