"""argparse flags generated from the configuration tree (pagedserve_common.config), and `up`'s forwarding."""

from __future__ import annotations

import argparse

from pagedserve_common.options import ALWAYS, GIVEN, Leaf, leaves


class DefaultsFormatter(argparse.HelpFormatter):
    """Every generated flag's help ends with its default, as the parser holds it (a PAGEDSERVE_* variable
    included); a flag `up` forwards only when given shows the child's default."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        leaf: Leaf | None = getattr(action, "leaf", None)
        if leaf is None or text is argparse.SUPPRESS:
            return text
        head, sep, env = text.partition(" [env ")
        shown = default_text(leaf, action.default, getattr(action, "child", None))
        return f"{head} (default: {escape(shown)}){sep}{env}"


def default_text(leaf: Leaf, value, child: str | None = None) -> str:
    """--help's text for the default `value` of `leaf`'s flag; `child`: the command `up` forwards it to."""
    if value is None:
        own = leaf.option.default_text if leaf.default is None else leaf.option.show(leaf.default)
        return f"the {child}'s: {own}" if child else own or "none"
    return leaf.option.show(value)


def escape(text: str) -> str:
    return text.replace("%", "%%")  # NOTE: argparse expands help with %-formatting


def add_flags(p: argparse.ArgumentParser, root: type, child: str | None = None) -> None:
    """The flags of the tree rooted at `root`, one argument group per group of the tree. With `child` (the command
    `up` forwards them to): only those Option.up marks and `p` lacks; a GIVEN one defaults to None (forwarded only
    when given)."""
    for_up = child is not None
    have = {a.dest for a in p._actions}
    sections: dict[str, argparse._ArgumentGroup] = {}
    for leaf in leaves(root):
        opt = leaf.option
        if for_up and (opt.up is None or leaf.name in have):
            continue
        title = ": ".join(t for t in (child, leaf.title) if t)
        if title and title not in sections:
            sections[title] = p.add_argument_group(title)
        where = sections[title] if title else p
        default = None if for_up and opt.up == GIVEN else leaf.default
        kw = {"help": escape(opt.help), "default": default}
        if isinstance(leaf.default, bool):
            kw["action"] = "store_true"
        else:
            kw.update(type=opt.type, choices=opt.choices, metavar=opt.metavar, nargs=opt.nargs)
        action = where.add_argument(leaf.flag, **kw)
        action.leaf, action.child = leaf, child
        have.add(leaf.name)


def forward_argv(args: argparse.Namespace, root: type, given_only: bool = False) -> list[str]:
    """The command line that passes `up`'s flags of the tree at `root` on to its child: ALWAYS ones always, GIVEN
    ones when given (a switch when set). `given_only`: just the GIVEN ones."""
    argv = []
    for leaf in leaves(root):
        up = leaf.option.up
        if up is None or (given_only and up != GIVEN):
            continue
        value = getattr(args, leaf.name)
        if value is True:
            argv.append(leaf.flag)
        elif isinstance(value, list | tuple):  # nargs "+"
            argv += [leaf.flag, *map(str, value)]
        elif up == ALWAYS or (value is not None and value is not False):
            argv += [leaf.flag, str(value)]
    return argv
