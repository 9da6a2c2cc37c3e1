"""`pagedserve scheduler` and `pagedserve worker`: the two services, one process each."""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

from pagedserve_cli import access_args
from pagedserve_cli.flags import DefaultsFormatter, add_flags, forward_argv
from pagedserve_common.config import SchedulerOptions, WorkerOptions
from pagedserve_common.options import build, values
from pagedserve_common.options import parse_device  # noqa: F401  NOTE: re-exported (`up`'s tests use it from here)


def scheduler_policy_argv(args: argparse.Namespace) -> list[str]:
    """The scheduler flags given to `up` that it forwards only when given, as scheduler command-line arguments."""
    return forward_argv(args, SchedulerOptions, given_only=True)


def model_dir(spec: str, revision: str | None = None, relay=None) -> str:
    """A local model directory for --model `spec` (pagedserve_common.model_spec): a directory as is, else pulled
    (fetched or converted once into the cache) by `pagedserve model pull` in a child process, which keeps torch out
    of here; its progress and log lines go to our stderr (through `relay`, up's pagedserve_cli.up_logs.Relay, when
    it writes JSON: then each line says it came from the pull). Its failure is ours: ModelSpecError or
    ModelFetchError, one line."""
    from pagedserve_cli.model_cmd import ERRORS_TO_STDOUT
    from pagedserve_common.model_spec import ModelFetchError, ModelSpecError

    if revision is None and (Path(spec).expanduser() / "config.json").is_file():
        return spec
    argv = [spec, *(["--revision", revision] if revision is not None else [])]
    cmd = [sys.executable, "-m", "pagedserve_cli.main", "model", "pull", ERRORS_TO_STDOUT, *argv]
    if relay is not None and relay.json:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=relay.child_env())
        reader = relay.follow("pull", proc.stderr)
        stdout = proc.stdout.read().decode("utf-8", "replace")
        proc.wait()
        reader.join()
        out = subprocess.CompletedProcess(cmd, proc.returncode, stdout)
    else:  # NOTE: a terminal (or no relay): the pull's own progress bars, as they are
        out = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)
    lines = out.stdout.strip().splitlines() or [""]
    if out.returncode == 0:
        return lines[-1]
    message = lines[-1].partition(": error: ")[2] or f"cannot resolve --model {spec!r} (`pagedserve model pull` " \
                                                     f"exited {out.returncode})"
    raise (ModelSpecError if out.returncode == 2 else ModelFetchError)(message)


def add_parsers(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("scheduler", help="run the scheduler service (CPU only)", formatter_class=DefaultsFormatter)
    add_flags(p, SchedulerOptions)
    p.set_defaults(func=run_scheduler)

    w = sub.add_parser("worker", help="run a worker that dials in to the scheduler", formatter_class=DefaultsFormatter)
    add_flags(w, WorkerOptions)
    w.set_defaults(func=run_worker)


def scheduler_config(args: argparse.Namespace, path: str):
    """The ServerConfig of `pagedserve scheduler`'s flags, for the model at `path`."""
    from scheduler_svc.server import ServerConfig

    return build(ServerConfig, args, model_dir=path)


def run_scheduler(args: argparse.Namespace) -> int:
    import asyncio

    from pagedserve_cli.logs import configure
    from pagedserve_common.signals import exit_on_stop_signals

    exit_on_stop_signals()  # until serve() drains on them: a signal during start-up just exits
    configure()
    from scheduler_svc.server import serve

    cfg = scheduler_config(args, model_dir(args.model, args.revision))
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
    credentials = access_args.worker_credentials(args)  # before torch and the model load: a bad file fails at once
    metadata = access_args.worker_token_metadata(args.worker_token_file)
    from pagedserve_common.descriptors import raise_open_files_limit

    raise_open_files_limit("worker")
    from worker_svc.threads import bound_openmp_spin

    bound_openmp_spin()  # NOTE: before torch loads libgomp, on the next import
    from worker_svc import cpu_path

    cpu_path.apply(args.cpu_path)  # NOTE: before torch loads too: oneDNN and ATen read their ISA caps once
    from worker_svc.client import run_worker as run
    from worker_svc.worker import WorkerConfig

    opts = build(WorkerOptions, args)
    device = "cuda:0" if opts.runner.device == "cuda" else opts.runner.device
    if device == "cuda:auto":
        import torch

        from worker_svc.gpu_claim import claim_gpu, default_lock_dir
        device = f"cuda:{claim_gpu(torch.cuda.device_count(), default_lock_dir())}"
    return run(opts.scheduler, WorkerConfig(**{**values(opts.runner), "device": device}), credentials=credentials,
               channel_options=access_args.name_override(opts.access.tls_server_name), metadata=metadata)
