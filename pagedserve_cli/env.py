"""Every long flag can be set by an environment variable: --max-num-seqs is PAGEDSERVE_MAX_NUM_SEQS."""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping

PREFIX = "PAGEDSERVE_"
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")


def env_name(option: str) -> str:
    """The variable for a long option: --kv-memory -> PAGEDSERVE_KV_MEMORY."""
    return PREFIX + option.lstrip("-").upper().replace("-", "_")


def _long_option(action: argparse.Action) -> str | None:
    return next((s for s in action.option_strings if s.startswith("--") and s != "--help"), None)


def _convert(action: argparse.Action, text: str):
    if isinstance(action, argparse._StoreTrueAction | argparse._StoreFalseAction):
        lowered = text.strip().lower()
        if lowered not in TRUE + FALSE:
            raise ValueError(f"expected one of {', '.join(TRUE + FALSE[:-1])}, got {text!r}")
        return action.const if lowered in TRUE else not action.const
    if action.nargs == "+":  # NOTE: values space-separated, as on the command line
        values = [_convert_one(action, word) for word in text.split()]
        if not values:
            raise ValueError("expected one or more values, got none")
        return values
    return _convert_one(action, text)


def _convert_one(action: argparse.Action, text: str):
    value = action.type(text) if action.type is not None else text
    if action.choices is not None and value not in action.choices:
        raise ValueError(f"expected one of {', '.join(map(str, action.choices))}, got {text!r}")
    return value


class EnvArgumentParser(argparse.ArgumentParser):
    """An ArgumentParser (its subcommands' too) that reports a malformed PAGEDSERVE_* variable when it parses, and
    any usage error in one line.

    NOTE: one variable may feed flags of several subcommands with different choices (PAGEDSERVE_DTYPE=auto suits
    `worker`, not `kv-plan`), so an error belongs to the subcommand that runs, not to building the parser.
    """

    env_errors: list[str]

    def __init__(self, *args, **kwargs) -> None:
        # NOTE: no prefix matching: `--api-key secret` once became `--api-key-file secret` (a file named "secret");
        # a flag is spelled out or refused by name. Subcommands' parsers are made by this class, so this holds there.
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        for message in getattr(self, "env_errors", []):
            self.error(message)
        return super().parse_known_args(args, namespace)

    def error(self, message: str):
        """A usage error as one line (argparse prints its usage first: a wall of flags for `up`), exit code 2."""
        self.exit(2, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")


def apply_env(parser: argparse.ArgumentParser, environ: Mapping[str, str] | None = None) -> None:
    """Turns PAGEDSERVE_* variables into the defaults of the flags they name, in `parser` and every subcommand.

    NOTE: a flag on the command line still wins (the variable only replaces the default), so compose files,
    Kubernetes manifests and shells configure the same thing the same way. A malformed value is an error naming
    the variable when that (sub)command parses (see EnvArgumentParser), not a silent fallback.
    """
    environ = os.environ if environ is None else environ
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in set(action.choices.values()):
                apply_env(sub, environ)
            continue
        option = _long_option(action)
        if option is None or not isinstance(action, (argparse._StoreAction, argparse._StoreTrueAction,
                                                     argparse._StoreFalseAction)):
            continue
        name = env_name(option)
        if action.help is not argparse.SUPPRESS:
            action.help = f"{action.help or ''} [env {name}]".lstrip()
        if name not in environ:
            continue
        try:
            action.default = _convert(action, environ[name])
        except (ValueError, TypeError, argparse.ArgumentTypeError) as e:
            parser.env_errors = [*getattr(parser, "env_errors", []), f"environment variable {name}: {e}"]
            continue
        action.required = False
