"""`pagedserve generate "PROMPT"`: streams a completion from a running server to the terminal."""

from __future__ import annotations

import argparse
import sys

from pagedserve_cli import access_args
from pagedserve_common.defaults import DEFAULT_LISTEN


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="stream a completion from a running server")
    p.add_argument("prompt")
    p.add_argument("--server", default=DEFAULT_LISTEN, help="the client API, HOST:PORT")
    p.add_argument("--max-tokens", type=int, default=128)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--seed", type=int)
    p.add_argument("--chat", action="store_true",
                   help="send the prompt as a user message (the server applies the model's chat template)")
    access_args.add_client_args(p)
    p.set_defaults(func=run)


def build_request(args: argparse.Namespace):
    """The GenerateRequest the command line asks for (with --chat, the prompt as the user's message)."""
    from pagedserve.v1 import generate_pb2

    sampling = generate_pb2.SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature)
    if args.seed is not None:
        sampling.seed = args.seed
    if args.chat:
        return generate_pb2.GenerateRequest(messages=[generate_pb2.ChatMessage(role="user", content=args.prompt)],
                                            sampling=sampling)
    return generate_pb2.GenerateRequest(prompt=args.prompt, sampling=sampling)


def stream(channel, request, out=None, err=None, metadata=()) -> int:
    """Streams `request` over `channel`: text to `out` as it arrives, the finish line or the error to `err`."""
    import grpc

    out, err = out or sys.stdout, err or sys.stderr
    from pagedserve.v1 import generate_pb2, generate_pb2_grpc

    try:
        for resp in generate_pb2_grpc.GenerationStub(channel).Generate(request, metadata=metadata):
            out.write(resp.text)
            out.flush()
            if resp.finish_reason:
                reason = generate_pb2.FinishReason.Name(resp.finish_reason)
                print(f"\n[{reason.removeprefix('FINISH_REASON_').lower()}: {resp.usage.prompt_tokens} prompt "
                      f"+ {resp.usage.completion_tokens} generated tokens, {resp.usage.cached_prompt_tokens} "
                      f"cached]", file=err)
    except grpc.RpcError as e:
        print(f"\npagedserve generate: {e.code().name}: {e.details()}", file=err)
        return 1
    return 0


def run(args: argparse.Namespace) -> int:
    with access_args.client_channel(args, args.server) as channel:
        return stream(channel, build_request(args), metadata=access_args.client_metadata(args))
