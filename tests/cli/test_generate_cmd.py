"""`pagedserve generate` against a grpcio-testing channel: the test plays the server, message by message."""

from __future__ import annotations

import io
import threading

import grpc
import grpc_testing

from pagedserve.v1 import generate_pb2 as pb
from pagedserve_cli.generate_cmd import build_request, stream
from pagedserve_cli.main import build_parser

SERVICE = pb.DESCRIPTOR.services_by_name["Generation"]
GENERATE = SERVICE.methods_by_name["Generate"]


def start(request):
    """Runs the command's streaming loop in a thread; returns (request sent, rpc, thread, result, out, err)."""
    channel = grpc_testing.channel([SERVICE], grpc_testing.strict_real_time())
    out, err, result = io.StringIO(), io.StringIO(), []
    thread = threading.Thread(target=lambda: result.append(stream(channel, request, out, err)))
    thread.start()
    _, sent, rpc = channel.take_unary_stream(GENERATE)
    return sent, rpc, thread, result, out, err


def test_flags_become_the_request():
    args = build_parser().parse_args(["generate", "Hello", "--max-tokens", "7", "--temperature", "0.5",
                                      "--seed", "3"])
    assert build_request(args) == pb.GenerateRequest(prompt="Hello", sampling=pb.SamplingParams(
        max_tokens=7, temperature=0.5, seed=3))
    default = build_request(build_parser().parse_args(["generate", "Hi"]))
    assert default.sampling.max_tokens == 128 and default.sampling.HasField("temperature")
    assert default.sampling.temperature == 0 and not default.sampling.HasField("seed")  # greedy by default


def test_chat_sends_the_prompt_as_a_user_message_for_the_servers_template():
    request = build_request(build_parser().parse_args(["generate", "Name a color.", "--chat"]))
    assert not request.HasField("prompt")
    assert list(request.messages) == [pb.ChatMessage(role="user", content="Name a color.")]


def test_text_streams_as_it_arrives_then_the_usage_line():
    request = pb.GenerateRequest(prompt="The capital of France is")
    sent, rpc, thread, result, out, err = start(request)
    assert sent == request
    rpc.send_response(pb.GenerateResponse(text=" Par", token_ids=[1]))
    rpc.send_response(pb.GenerateResponse(text="is.", token_ids=[2], finish_reason=pb.FINISH_REASON_STOP,
                                          usage=pb.Usage(prompt_tokens=5, completion_tokens=2,
                                                         cached_prompt_tokens=0)))
    rpc.terminate((), grpc.StatusCode.OK, "")
    thread.join(120)  # NOTE: a hang guard only, never a measure of speed
    assert result == [0]
    assert out.getvalue() == " Paris."
    assert err.getvalue() == "\n[stop: 5 prompt + 2 generated tokens, 0 cached]\n"


def test_a_server_error_is_printed_with_its_status_and_exits_1():
    _, rpc, thread, result, out, err = start(pb.GenerateRequest(prompt="x"))
    rpc.terminate((), grpc.StatusCode.INVALID_ARGUMENT, "temperature must be a finite number >= 0, got -1.0")
    thread.join(120)  # NOTE: a hang guard only, never a measure of speed
    assert result == [1] and out.getvalue() == ""
    assert err.getvalue() == "\npagedserve generate: INVALID_ARGUMENT: temperature must be a finite number >= 0, " \
                             "got -1.0\n"
