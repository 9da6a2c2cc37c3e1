"""`pagedserve model pull [NAME]`: fetch and convert a known model once; print its directory last."""

from __future__ import annotations

import argparse

from pagedserve_common.defaults import DEFAULT_MODEL


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("model", help="manage the local model cache")
    msub = p.add_subparsers(dest="model_command", required=True)
    pull = msub.add_parser("pull", help="fetch and convert a known model into the cache; prints its directory")
    pull.add_argument("name", nargs="?", default=DEFAULT_MODEL,
                      help="a known model name, or a model directory (printed as is)")
    pull.set_defaults(func=run_pull)


def run_pull(args: argparse.Namespace) -> int:
    import sys

    from pagedserve_cli.logs import disable_progress_bars

    if not sys.stderr.isatty():  # a log file or a supervisor's pipe (`up`, the scheduler pull through this command)
        disable_progress_bars()
    from worker_svc.model_store import resolve_model

    # NOTE: a model directory of one's own is printed as is (nothing to fetch); an unknown name is a ValueError.
    print(resolve_model(args.name))
    return 0
