"""The configuration tree (pagedserve_common.config) is what `scheduler`, `worker` and `up` parse and show."""

from __future__ import annotations

import argparse
import os

import pytest

from pagedserve_cli.flags import default_text
from pagedserve_cli.main import build_parser
from pagedserve_cli.up_cmd import scheduler_argv, worker_argv
from pagedserve_common.config import SchedulerOptions, UpOptions, WorkerOptions
from pagedserve_common.defaults import (DEFAULT_HTTP, DEFAULT_LISTEN, DEFAULT_METRICS, DEFAULT_MODEL,
                                        DEFAULT_WORKER_LISTEN)
from pagedserve_common.options import GIVEN, leaves

TREES = {"scheduler": (SchedulerOptions,), "worker": (WorkerOptions,),
         "up": (UpOptions, SchedulerOptions, WorkerOptions)}


@pytest.fixture(autouse=True)
def no_env(monkeypatch):
    """PAGEDSERVE_* variables move defaults: none here."""
    for name in [n for n in os.environ if n.startswith("PAGEDSERVE_")]:
        monkeypatch.delenv(name)


def subparser(command: str) -> argparse.ArgumentParser:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return sub.choices[command]


def flag_actions(command: str) -> dict[str, argparse.Action]:
    return {a.option_strings[0]: a for a in subparser(command)._actions if a.option_strings[0] != "-h"}


def help_of(command: str) -> dict[str, str]:
    """Each flag's --help text, on one line."""
    p = subparser(command)
    formatter = p._get_formatter()
    return {a.option_strings[0]: " ".join(formatter._expand_help(a).split())
            for a in p._actions if a.option_strings[0] != "-h"}


@pytest.mark.parametrize("command", TREES)
def test_every_flag_comes_from_the_tree_with_help_and_its_default(command):
    actions, helps = flag_actions(command), help_of(command)
    tree = {}
    for leaf in (leaf for root in TREES[command] for leaf in leaves(root)):
        tree.setdefault(leaf.flag, leaf)  # up: its own flags first, as add_flags makes them
    for flag, action in actions.items():
        leaf = getattr(action, "leaf", None)
        assert leaf is not None and tree[flag] == leaf, f"{command} {flag}: not generated from the tree"
        assert leaf.option.help.strip(), f"{command} {flag} has no help text"
        assert leaf.default is not None or leaf.option.default_text, f"{flag}: None default with no default_text"
        forwarded_given = action.child is not None and leaf.option.up == GIVEN
        assert action.default == (None if forwarded_given else leaf.default), f"{command} {flag}"
        shown = leaf.option.default_text if leaf.default is None else leaf.option.show(leaf.default)
        assert f"(default: {shown})" in helps[flag] or f"(default: the scheduler's: {shown})" in helps[flag] \
            or f"(default: the worker's: {shown})" in helps[flag], f"{command} {flag}: {helps[flag]!r}"
        assert default_text(leaf, action.default, getattr(action, "child", None)) in helps[flag]


def test_the_services_have_every_flag_of_their_tree():
    for command in ("scheduler", "worker"):
        want = {leaf.flag for root in TREES[command] for leaf in leaves(root)}
        assert set(flag_actions(command)) == want, command


def sample_argv(action: argparse.Action) -> list[str]:
    """A valid command line giving `action`'s flag."""
    flag = action.option_strings[0]
    if action.nargs == 0:
        return [flag]
    if action.choices:
        return [flag, list(action.choices)[-1]]
    for text in ("cuda:1", "7", "3MiB", "x.pem"):
        try:
            (action.type or str)(text)
            return [flag, text]
        except (ValueError, argparse.ArgumentTypeError):
            continue
    raise AssertionError(f"no sample value for {flag}")


def test_every_flag_up_forwards_exists_on_the_child_and_arrives():
    """Give `up` every flag it has, build the children's command lines as `up` does and parse them with the
    scheduler's and the worker's own parsers: every forwarded flag exists there and keeps its value."""
    actions = flag_actions("up")
    argv = [word for action in actions.values() for word in sample_argv(action)]
    args = build_parser().parse_args(["up", *argv])
    sched = build_parser().parse_args(["scheduler", *scheduler_argv(args)])
    worker = build_parser().parse_args(["worker", *worker_argv(args, "cpu")])
    children = {"scheduler": sched, "worker": worker}
    for flag, action in actions.items():
        if action.child is None:  # up's own
            continue
        child = children[action.child]
        assert hasattr(child, action.dest), f"up {flag}: `{action.child}` has no such flag"
        assert getattr(child, action.dest) == getattr(args, action.dest), f"up {flag} lost on the way"
    assert (sched.http, worker.device) == (args.http, "cpu")  # up's own that it passes on


def test_up_forwards_only_what_was_given_beyond_the_addresses():
    args = build_parser().parse_args(["up"])
    assert scheduler_argv(args) == ["--model", DEFAULT_MODEL, "--listen", DEFAULT_LISTEN, "--worker-listen",
                                    DEFAULT_WORKER_LISTEN, "--metrics", DEFAULT_METRICS, "--http", DEFAULT_HTTP]
    assert worker_argv(args, "cpu") == ["--scheduler", DEFAULT_WORKER_LISTEN, "--device", "cpu",
                                        "--model", DEFAULT_MODEL, "--dtype", "auto"]
