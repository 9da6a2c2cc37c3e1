"""`pagedserve serve MODEL [flags]`: what `vllm serve` users type. It is `pagedserve up` (the same configuration tree,
the same processes) with the model as a positional argument and vLLM's names for the flags both have; a vLLM flag
pagedserve does not implement is refused by name with the reason, one that cannot change an answer is accepted.
docs/coming-from-vllm.md sets the two side by side."""

from __future__ import annotations

import argparse
import os
from dataclasses import dataclass

from pagedserve_cli import up_cmd
from pagedserve_cli.flags import DefaultsFormatter, add_flags
from pagedserve_cli.private_files import private_file
from pagedserve_common.config import SchedulerOptions, UpOptions, WorkerOptions
from pagedserve_common.defaults import DEFAULT_HTTP, DEFAULT_MODEL
from pagedserve_common.options import at_least

API_KEY_VARIABLE = "VLLM_API_KEY"  # vLLM's: a key when --api-key is not given
LOG_LEVELS = {"critical": "error", "error": "error", "warning": "warning", "info": "info", "debug": "debug",
              "trace": "debug"}  # --uvicorn-log-level -> PAGEDSERVE_LOG_LEVEL
DTYPES = {"half": "float16", "float": "float32"}  # vLLM's other spellings of --dtype
KV_CACHE_DTYPES = {"fp8": "fp8_e4m3"}  # vLLM's fp8 is e4m3
_DEFAULT_HOST, _, _DEFAULT_PORT = DEFAULT_HTTP.rpartition(":")


@dataclass(frozen=True, slots=True)
class VllmFlag:
    """A vLLM flag `serve` has no flag of its own for: accepted (its value cannot change an answer here, or only
    `accepted` values) or refused, with the reason either way."""

    reason: str
    takes_value: bool = True
    accepted: tuple[str, ...] | None = None  # None: any value accepted; (): refused whatever its value


_REFUSED = ()
VLLM_FLAGS = {
    "--tensor-parallel-size": VllmFlag("a model is not split across devices here: each worker holds it whole "
                                       "(--data-parallel-size N runs N workers)", accepted=("1",)),
    "--pipeline-parallel-size": VllmFlag("a model is not split across devices here: each worker holds it whole",
                                         accepted=("1",)),
    "--quantization": VllmFlag("a GGUF checkpoint's blocks (Q4_0, Q4_1, Q8_0, Q4_K, Q6_K) run as stored by default "
                               "(--weight-dtype auto); other quantisation methods are not implemented yet",
                               accepted=("gguf",)),
    "--gpu-memory-utilization": VllmFlag("the KV pool is sized in bytes: --kv-memory BYTES", accepted=_REFUSED),
    "--tokenizer": VllmFlag("the model's own tokenizer is used", accepted=_REFUSED),
    "--load-format": VllmFlag("checkpoints load as their files say", accepted=("auto",)),
    "--download-dir": VllmFlag("models are cached under $PAGEDSERVE_CACHE", accepted=_REFUSED),
    "--speculative-config": VllmFlag("speculative decoding is --speculative ngram [--num-speculative-tokens K]",
                                     accepted=_REFUSED),
    "--ssl-certfile": VllmFlag("TLS is --tls-cert, --tls-key and --tls-ca (every port of the scheduler, mutual "
                               "for its workers)", accepted=_REFUSED),
    "--ssl-keyfile": VllmFlag("TLS is --tls-cert, --tls-key and --tls-ca", accepted=_REFUSED),
    "--cpu-offload-gb": VllmFlag("weights are not offloaded: swapped-out KV blocks are (--swap-space)",
                                 accepted=_REFUSED),
    "--response-role": VllmFlag("the answer's role is always assistant", accepted=("assistant",)),
    "--return-tokens-as-token-ids": VllmFlag("logprobs' tokens are their text", takes_value=False,
                                             accepted=_REFUSED),
    # accepted: cannot change an answer here
    "--enforce-eager": VllmFlag("there are no CUDA graphs to turn off", takes_value=False),
    "--trust-remote-code": VllmFlag("no code is run from a checkpoint: the architectures served are built in",
                                    takes_value=False),
    "--disable-log-stats": VllmFlag("there is no periodic stats line; /metrics has the figures", takes_value=False),
    "--disable-log-requests": VllmFlag("a request logs one line when it ends, at info (PAGEDSERVE_LOG_LEVEL=warning "
                                       "silences it)", takes_value=False),
    "--enable-log-requests": VllmFlag("a request logs one line when it ends, at info", takes_value=False),
    "--enable-chunked-prefill": VllmFlag("prefill is always chunked under --max-num-batched-tokens (batch "
                                         "invariant: chunking does not change a token)", takes_value=False),
    "--no-enable-chunked-prefill": VllmFlag("prefill is always chunked under --max-num-batched-tokens (batch "
                                            "invariant: chunking does not change a token)", takes_value=False),
    "--max-log-len": VllmFlag("request log lines never carry prompts"),
}


class _VllmFlagAction(argparse.Action):
    def __call__(self, parser, namespace, values, option_string=None) -> None:
        rule: VllmFlag = VLLM_FLAGS[option_string]
        value = values if rule.takes_value else None
        if rule.accepted is not None and (value is None or value not in rule.accepted):
            shown = f"{option_string} {value}" if value is not None else option_string
            accepted = f" (accepted: {', '.join(rule.accepted)})" if rule.accepted else ""
            parser.error(f"{shown}: not supported: {rule.reason}{accepted}")
        namespace.vllm_accepted = [*getattr(namespace, "vllm_accepted", []), option_string]


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="vLLM's command line: serve MODEL (a scheduler and workers, as up) on "
                                     "--host/--port", formatter_class=DefaultsFormatter)
    p.add_argument("model_tag", nargs="?", metavar="MODEL", help="the model: a directory, a known name or a Hub "
                                                                  "repo id (as --model; default: --model's)")
    v = p.add_argument_group("vLLM's flags")
    v.add_argument("--host", default=_DEFAULT_HOST, help="the HTTP API's address (vLLM's default is every interface; "
                                                         "here loopback unless given, e.g. 0.0.0.0)")
    v.add_argument("--port", type=at_least(int, 0, "a port number"), default=int(_DEFAULT_PORT),
                   help="the HTTP API's port")
    v.add_argument("--api-key", action="append", metavar="KEY",
                   help=f"a key the API then requires (`authorization: Bearer KEY` or `x-api-key: KEY`); "
                        f"repeatable; default: ${API_KEY_VARIABLE}")
    v.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=None,
                   help="reuse the KV blocks of prompts' common prefixes (default: on)")
    v.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="tool_choice auto (needs --tool-call-parser: it is what parses the calls)")
    v.add_argument("--data-parallel-size", type=at_least(int, 1, "an integer >= 1"), metavar="N",
                   help="workers, each with the whole model (= --workers)")
    v.add_argument("--uvicorn-log-level", choices=tuple(LOG_LEVELS), help="the log level (PAGEDSERVE_LOG_LEVEL)")
    for flag, rule in VLLM_FLAGS.items():
        v.add_argument(flag, action=_VllmFlagAction, nargs=None if rule.takes_value else 0, help=argparse.SUPPRESS)
    add_flags(p, UpOptions)
    add_flags(p, SchedulerOptions, child="scheduler")
    add_flags(p, WorkerOptions, child="worker")
    _widen_choices(p)
    p.set_defaults(func=run)


def _widen_choices(p: argparse.ArgumentParser) -> None:
    """vLLM's spellings of --dtype and --kv-cache-dtype values are accepted too (to_up_args maps them); --model is
    None unless given (or set by PAGEDSERVE_MODEL), so that the positional MODEL can take its place."""
    for action in p._actions:
        if action.dest == "model":
            action.default = None
        elif action.dest == "swap_space":
            action.type = _gib_when_bare(action.type)
        elif action.dest == "dtype":
            action.choices = (*action.choices, *DTYPES)
        elif action.dest == "kv_cache_dtype":
            action.choices = (*action.choices, *KV_CACHE_DTYPES)


def _gib_when_bare(parse):
    """--swap-space: a bare number is GiB, as vLLM reads it (`up` reads bytes); a unit (4GiB) is as written."""
    def gib(text: str) -> int:
        try:
            return int(float(text) * (1 << 30))
        except ValueError:
            return parse(text)
    return gib


def to_up_args(args: argparse.Namespace, environ=os.environ) -> argparse.Namespace:
    """`serve`'s arguments as `up`'s (in place). Raises ValueError naming the flag when two say different things."""
    if args.model_tag is not None and args.model not in (None, args.model_tag):
        raise ValueError(f"the model is given twice: {args.model_tag!r} and --model {args.model!r}")
    args.model = args.model_tag or args.model or DEFAULT_MODEL
    host_port = f"[{args.host}]:{args.port}" if ":" in args.host else f"{args.host}:{args.port}"
    if args.http != DEFAULT_HTTP and host_port != DEFAULT_HTTP:
        raise ValueError(f"--http {args.http} and --host/--port {host_port}: give one")
    if host_port != DEFAULT_HTTP:
        args.http = host_port
    if args.enable_prefix_caching is not None:
        if args.no_prefix_caching and args.enable_prefix_caching:
            raise ValueError("--enable-prefix-caching and --no-prefix-caching: give one")
        args.no_prefix_caching = not args.enable_prefix_caching
    if args.enable_auto_tool_choice and args.tool_call_parser in (None, "none"):
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (the format the model calls tools in)")
    if args.data_parallel_size is not None:
        args.workers = args.data_parallel_size
    args.dtype = DTYPES.get(args.dtype, args.dtype)
    args.kv_cache_dtype = KV_CACHE_DTYPES.get(args.kv_cache_dtype, args.kv_cache_dtype)
    keys = args.api_key or ([environ[API_KEY_VARIABLE]] if environ.get(API_KEY_VARIABLE) else [])
    if keys:
        if args.api_key_file:
            raise ValueError("--api-key and --api-key-file: give one")
        args.api_key_file = _key_file(keys)
    return args


def _key_file(keys: list[str]) -> str:
    """The keys in a file only this user reads, removed at exit: the scheduler reads keys from a file (a key on its
    command line would show in `ps` to every user)."""
    for key in keys:
        if not key or any(c.isspace() for c in key):
            raise ValueError("--api-key: a key is one word (no spaces)")
    # NOTE: operator keys: vLLM's keys may do anything (any priority, any tenant header), and so may these
    return private_file("api-keys", "".join(f"{key} role=operator\n" for key in keys))


def run(args: argparse.Namespace) -> int:
    to_up_args(args)
    if args.uvicorn_log_level:
        os.environ["PAGEDSERVE_LOG_LEVEL"] = LOG_LEVELS[args.uvicorn_log_level]
    return up_cmd.run(args)
