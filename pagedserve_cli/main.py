"""The `pagedserve` command: one subcommand per job; each imports only what it needs."""

from __future__ import annotations

import argparse
import sys

from pagedserve_cli import (bench_cmd, certs_cmd, generate_cmd, health_cmd, kv_map_cmd, kv_plan, model_cmd,
                            serve_cmd, up_cmd, vllm_serve_cmd, worker_token_cmd)
from pagedserve_cli.env import EnvArgumentParser, apply_env
from pagedserve_common.startup import USAGE, StartupError


def build_parser() -> argparse.ArgumentParser:
    p = EnvArgumentParser(prog="pagedserve", description="LLM serving with PagedAttention")
    sub = p.add_subparsers(dest="command", required=True)
    up_cmd.add_parser(sub)
    vllm_serve_cmd.add_parser(sub)
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
    from pagedserve_common.model_spec import ModelFetchError

    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # NOTE: said by the subcommand's parser, so that the line names it (`pagedserve up: error: ...`)
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        sub.choices[args.command].error(f"unrecognized arguments: {' '.join(unknown)}")
    try:
        return args.func(args)
    except StartupError as e:  # NOTE: one line naming the flag or path, no traceback (pagedserve_common.startup)
        print(f"pagedserve {args.command}: error: {e}", file=sys.stderr, flush=True)
        return e.exit_code
    except (ValueError, FileNotFoundError, KeyError) as e:
        print(f"pagedserve {args.command}: error: {e}", file=sys.stderr, flush=True)
        return USAGE
    except ModelFetchError as e:  # NOTE: the model could not be had (offline, no such repo): not a usage error
        print(f"pagedserve {args.command}: error: {e}", file=sys.stderr, flush=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
