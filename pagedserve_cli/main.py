"""The `pagedserve` command: one subcommand per job; each imports only what it needs."""

from __future__ import annotations

import argparse
import sys

from pagedserve_cli import (bench_cmd, certs_cmd, generate_cmd, health_cmd, kv_map_cmd, kv_plan, model_cmd,
                            serve_cmd, up_cmd, worker_token_cmd)
from pagedserve_cli.env import EnvArgumentParser, apply_env


def build_parser() -> argparse.ArgumentParser:
    p = EnvArgumentParser(prog="pagedserve", description="LLM serving with PagedAttention")
    sub = p.add_subparsers(dest="command", required=True)
    up_cmd.add_parser(sub)
    generate_cmd.add_parser(sub)
    bench_cmd.add_parser(sub)
    serve_cmd.add_parsers(sub)
    kv_plan.add_parser(sub)
    kv_map_cmd.add_parser(sub)
    model_cmd.add_parser(sub)
    health_cmd.add_parser(sub)
    certs_cmd.add_parser(sub)
    worker_token_cmd.add_parser(sub)
    apply_env(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from pagedserve_common.model_spec import ModelFetchError

    try:
        return args.func(args)
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"pagedserve {args.command}: error: {e}", file=sys.stderr)
        return 2
    except ModelFetchError as e:  # NOTE: the model could not be had (offline, no such repo): not a usage error
        print(f"pagedserve {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
