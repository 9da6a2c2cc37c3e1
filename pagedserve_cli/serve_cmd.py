"""`pagedserve scheduler` and `pagedserve worker`: the two services, one process each."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from pagedserve_cli import access_args
from pagedserve_cli.units import parse_bytes
from scheduler_svc.kv.static import KV_ALLOCATIONS

DEFAULT_MODEL = "smollm2-135m-instruct"
DEFAULT_DRAIN_TIMEOUT = 30.0  # ServerConfig.drain_seconds; `pagedserve up` waits this plus a margin on stop
ROUTING = ("kv", "least-loaded", "round-robin")


def parse_device(text: str) -> str:
    """argparse type for --device: cpu, cuda, cuda:N or cuda:auto (kept as given; `up` spreads plain cuda over the
    GPUs; a worker resolves cuda:auto by claiming a GPU no other worker on the host holds)."""
    head, sep, index = text.partition(":")
    if text in ("cpu", "cuda", "cuda:auto") or (head == "cuda" and sep and index.isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"expected cpu, cuda, cuda:N (N a GPU index) or cuda:auto, got {text!r}")


def _number(kind, minimum, what: str):
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value
    return parse


def _bytes_at_least(minimum: int):
    def parse(text: str) -> int:
        try:
            value = parse_bytes(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected at least {minimum} bytes, got {text!r}")
        return value
    return parse


def add_scheduler_policy_args(p: argparse.ArgumentParser, with_defaults: bool = True) -> None:
    """KV, routing, failure handling, drain and input-bound flags, shared by `scheduler` and `up` (which forwards
    only those given: `with_defaults=False` leaves them None)."""
    def d(value):
        return value if with_defaults else None
    p.add_argument("--max-model-len", type=_number(int, 1, "an integer >= 1"), default=None, metavar="N",
                   help="longest sequence, prompt and output together (default and upper bound: the model's)")
    p.add_argument("--no-prefix-caching", action="store_true", default=d(False),
                   help="never reuse the KV blocks of a prompt's prefix computed before")
    p.add_argument("--kv-allocation", choices=KV_ALLOCATIONS, default=d("paged"),
                   help="paged: a KV block whenever a sequence needs one (default); static-max-model-len: each "
                        "sequence reserves one contiguous run of blocks for max_model_len tokens when admitted, "
                        "static-request: for prompt + max_tokens (FasterTransformer/Orca-style preallocation, to "
                        "compare; no prefix caching, n = 1, no swap space)")
    p.add_argument("--routing", choices=ROUTING, default=d("kv"),
                   help="which worker takes a new request: kv (the one holding the longest prefix of the prompt, "
                        "unless it is much busier than the others), least-loaded (fewest pending tokens) or "
                        "round-robin (default kv)")
    p.add_argument("--step-timeout", type=_number(float, 1e-3, "seconds > 0"), default=d(60.0), metavar="SECONDS",
                   help="a worker that takes longer for one step is declared lost and its requests are recomputed "
                        "elsewhere; a worker's first step may take 4x that, for kernel compilation (default 60)")
    p.add_argument("--max-migrations", type=_number(int, 1, "an integer >= 1"), default=d(3), metavar="N",
                   help="a request whose steps took down N workers ends with INTERNAL (default 3)")
    p.add_argument("--no-worker-timeout", type=_number(float, 0, "seconds >= 0"), default=d(60.0), metavar="SECONDS",
                   help="while no worker is attached requests wait this long, then UNAVAILABLE (default 60)")
    p.add_argument("--drain-timeout", type=_number(float, 0, "seconds >= 0"), default=d(DEFAULT_DRAIN_TIMEOUT),
                   metavar="SECONDS", help="on SIGTERM the scheduler stops admitting (UNAVAILABLE) and lets "
                                           "in-flight streams finish this long (default 30)")
    # Input bounds (scheduler_svc.frontend.limits): beyond one, a request is refused naming the field and the bound.
    p.add_argument("--max-message-size", type=_bytes_at_least(1024), default=None, metavar="BYTES",
                   help="largest client request: one gRPC message (RESOURCE_EXHAUSTED beyond) or one HTTP body "
                        "(413), e.g. 16MiB (default 4MiB)")
    p.add_argument("--max-prompt-chars", type=_number(int, 1, "an integer >= 1"), default=None, metavar="N",
                   help="characters of a text prompt, or of a chat's messages together, checked before tokenizing "
                        "(default: 32 per token of max_model_len)")
    p.add_argument("--max-stop-strings", type=_number(int, 0, "an integer >= 0"), default=None, metavar="N",
                   help="stop strings per request, each up to 1024 characters (default 16)")


def scheduler_policy_argv(args: argparse.Namespace) -> list[str]:
    """The flags of add_scheduler_policy_args that were given, as scheduler command-line arguments."""
    argv = []
    for flag in ("--max-model-len", "--no-prefix-caching", "--kv-allocation", "--routing", "--step-timeout",
                 "--max-migrations", "--no-worker-timeout", "--drain-timeout", "--max-message-size",
                 "--max-prompt-chars", "--max-stop-strings"):
        value = getattr(args, flag[2:].replace("-", "_"))
        if value is True:  # a switch
            argv.append(flag)
        elif value is not None and value is not False:
            argv += [flag, str(value)]
    return argv


def model_dir(spec: str) -> str:
    """A local model directory, pulling a known model first in a child process (keeps torch out of here)."""
    if (Path(spec) / "config.json").is_file():
        return spec
    out = subprocess.run([sys.executable, "-m", "pagedserve_cli.main", "model", "pull", spec],
                         stdout=subprocess.PIPE, text=True)
    if out.returncode != 0:
        raise ValueError(f"cannot resolve --model {spec!r}")
    return out.stdout.strip().splitlines()[-1]


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("scheduler", help="run the scheduler service (CPU only)")
    p.add_argument("--model", default=DEFAULT_MODEL)
    p.add_argument("--listen", default="127.0.0.1:50051", help="client API (pagedserve.v1.Generation)")
    p.add_argument("--worker-listen", default="127.0.0.1:50052", help="where workers dial in")
    p.add_argument("--metrics", default="127.0.0.1:9464", help="Prometheus endpoint HOST:PORT ('' = off)")
    p.add_argument("--http", default="", metavar="HOST:PORT",
                   help="serve the OpenAI-compatible HTTP API here too, e.g. 127.0.0.1:8000 ('' = off, the default)")
    p.add_argument("--max-num-seqs", type=int, default=64)
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per step; bounds inter-token latency during long prefills "
                        "(default: 512 for a CPU worker, 2048 for a GPU worker)")
    p.add_argument("--max-queued-requests", type=int, default=1024)
    add_scheduler_policy_args(p)
    access_args.add_scheduler_args(p)
    p.set_defaults(func=run_scheduler)

    w = sub.add_parser("worker", help="run a worker that dials in to the scheduler")
    w.add_argument("--scheduler", default="127.0.0.1:50052")
    w.add_argument("--model", default=DEFAULT_MODEL)
    w.add_argument("--device", default="cpu", type=parse_device, help="cpu, cuda (= cuda:0), cuda:N, or cuda:auto (the first GPU no other "
                        "worker sharing $PAGEDSERVE_CACHE has claimed: one GPU per compose replica)")
    w.add_argument("--dtype", default="auto", choices=["auto", "float32", "float16", "bfloat16"])
    w.add_argument("--kv-memory", type=parse_bytes, help="bytes for the KV pool, e.g. 1GiB")
    w.add_argument("--block-size", type=int, default=16)
    w.add_argument("--threads", type=int,
                   help="compute threads on the CPU (default: the cores this process may run on)")
    w.add_argument("--attention-backend", default="auto", choices=["auto", "cpu", "torch", "cupy"],
                   help="auto: the C++ kernel on the CPU, CuPy kernels on a GPU")
    w.add_argument("--transformers-forward", action="store_true",
                   help="run the model through the transformers modules instead of the lean forward")
    w.add_argument("--swap-space", type=parse_bytes, default=0,
                   help="host memory for swapped-out KV blocks, e.g. 4GiB (default 0: preemption recomputes)")
    access_args.add_worker_args(w)
    w.set_defaults(func=run_worker)


def scheduler_config(args: argparse.Namespace, path: str):
    """The ServerConfig of `pagedserve scheduler`'s flags, for the model at `path`."""
    from scheduler_svc.server import ServerConfig

    return ServerConfig(model_dir=path, model_id=args.model, listen=args.listen,
                        worker_listen=args.worker_listen, metrics=args.metrics or None, http=args.http or None,
                        tls_cert=args.tls_cert, tls_key=args.tls_key, tls_ca=args.tls_ca,
                        api_key_file=args.api_key_file,
                        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                        max_model_len=args.max_model_len, enable_prefix_caching=not args.no_prefix_caching,
                        kv_allocation=args.kv_allocation,
                        max_queued_requests=args.max_queued_requests, routing=args.routing,
                        step_timeout=args.step_timeout, max_migrations=args.max_migrations,
                        no_worker_timeout=args.no_worker_timeout, drain_seconds=args.drain_timeout,
                        max_message_size=args.max_message_size, max_prompt_chars=args.max_prompt_chars,
                        max_stop_strings=args.max_stop_strings)


def run_scheduler(args: argparse.Namespace) -> int:
    import asyncio

    from pagedserve_cli.logs import configure
    from pagedserve_common.signals import exit_on_stop_signals

    exit_on_stop_signals()  # until serve() drains on them: a signal during start-up just exits
    configure()
    from scheduler_svc.server import serve

    cfg = scheduler_config(args, model_dir(args.model))
    asyncio.run(serve(cfg))
    return 0


def run_worker(args: argparse.Namespace) -> int:
    from pagedserve_cli.logs import configure
    from pagedserve_common.signals import exit_on_stop_signals

    # NOTE: while torch imports and the model loads there is nothing to hand over: a signal just exits. Once the
    # worker serves, the first SIGTERM/SIGINT announces that it leaves (worker_svc.client.Shutdown), a second one
    # exits. Both before the imports below, which take seconds; configure() too: no progress bars in JSON logs.
    exit_on_stop_signals()
    configure()
    from worker_svc.client import run_worker as run
    from worker_svc.worker import WorkerConfig

    credentials = access_args.worker_credentials(args)  # before the model loads: a bad file fails at once
    device = "cuda:0" if args.device == "cuda" else args.device
    if device == "cuda:auto":
        import torch

        from worker_svc.gpu_claim import claim_gpu, default_lock_dir
        device = f"cuda:{claim_gpu(torch.cuda.device_count(), default_lock_dir())}"
    return run(args.scheduler, WorkerConfig(
        model=args.model, device=device, dtype=args.dtype, block_size=args.block_size, kv_memory=args.kv_memory,
        threads=args.threads, swap_space=args.swap_space, attention_backend=args.attention_backend,
        lean=not args.transformers_forward), credentials=credentials,
        channel_options=access_args.name_override(args.tls_server_name))
