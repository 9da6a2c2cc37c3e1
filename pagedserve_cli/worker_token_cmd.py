"""`pagedserve worker-token PATH`: a new worker token file for the scheduler's and the workers' --worker-token-file."""

from __future__ import annotations

import argparse
import secrets
from pathlib import Path

from pagedserve_cli.certs_cmd import write_private

HEADER = (b"# pagedserve worker tokens: one a line (# comments). The scheduler accepts any of them; a worker sends the "
          b"first.\n")


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("worker-token", help="write a file with a new random worker token (--worker-token-file)")
    p.add_argument("path", help="the file to write (readable by its owner only)")
    exists = p.add_mutually_exclusive_group()
    exists.add_argument("--keep", action="store_true", help="when PATH exists, leave it as it is and exit 0 (a "
                                                            "one-shot set-up step, as compose.yaml runs it)")
    exists.add_argument("--force", action="store_true", help="when PATH exists, replace it with a new token")
    p.set_defaults(func=run)


def token_file() -> bytes:
    return HEADER + secrets.token_urlsafe(32).encode() + b"\n"


def run(args: argparse.Namespace) -> int:
    path = Path(args.path)
    if path.exists() and not args.force:
        if args.keep:
            print(f"{path} exists; kept")
            return 0
        raise ValueError(f"{path} exists already (--force replaces it, --keep leaves it)")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_private(path, token_file())
    print(f"wrote a new worker token to {path}")  # NOTE: never the token itself
    return 0
