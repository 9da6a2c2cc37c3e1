"""`pagedserve model pull [MODEL] [--revision R]`: fetch or convert a model into the cache once; print its
directory last."""

from __future__ import annotations

import argparse

from pagedserve_common.defaults import DEFAULT_MODEL
from pagedserve_common.model_spec import MODEL_HELP, REVISION_HELP

ERRORS_TO_STDOUT = "--errors-to-stdout"  # NOTE: for serve_cmd.model_dir, which reads the one error line back


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("model", help="manage the local model cache")
    msub = p.add_subparsers(dest="model_command", required=True)
    pull = msub.add_parser("pull", help="fetch or convert a model into the cache; prints its directory")
    pull.add_argument("name", nargs="?", default=DEFAULT_MODEL, metavar="MODEL",
                      help=f"{MODEL_HELP} (default: {DEFAULT_MODEL}); a directory is printed as is")
    pull.add_argument("--revision", default=None, metavar="REV", help=f"{REVISION_HELP} (default: the repo's "
                                                                      f"default branch)")
    pull.add_argument(ERRORS_TO_STDOUT, action="store_true", help=argparse.SUPPRESS)
    pull.set_defaults(func=run_pull)


def run_pull(args: argparse.Namespace) -> int:
    import sys

    from pagedserve_cli.logs import configure
    from pagedserve_common.model_spec import ModelFetchError, ModelSpecError

    # NOTE: before huggingface_hub and transformers are imported: on a terminal their progress bars show what is
    # fetched and converted; otherwise (a log file, `up`'s pipe) they are off and each stage is one log line.
    configure()
    from worker_svc.model_store import resolve_model

    try:
        path = resolve_model(args.name, args.revision)
    except (ModelSpecError, ModelFetchError) as e:
        print(f"pagedserve model pull: error: {e}", file=sys.stdout if args.errors_to_stdout else sys.stderr,
              flush=True)
        return 2 if isinstance(e, ModelSpecError) else 1
    print(path)
    return 0
