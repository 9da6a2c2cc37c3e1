"""The documentation's tables of commands, limits, access and connection flags against the CLI (they moved from the
README to docs/: configuration.md, api.md, security.md): every flag a table lists exists on the commands the table
says, with the default it says."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import pytest

from pagedserve_cli.main import build_parser
from pagedserve_common.units import parse_bytes

DOCS = Path(__file__).resolve().parents[2] / "docs"
FLAG = re.compile(r"--[a-z][a-z0-9-]*")
METAVAR = re.compile(r"^[A-Z][A-Z_]*$")  # N, PATH, PEM, HOST:PORT's parts: a placeholder, not a value


@pytest.fixture(autouse=True)
def no_env(monkeypatch):
    """PAGEDSERVE_* variables move defaults: none here."""
    for name in [n for n in os.environ if n.startswith("PAGEDSERVE_")]:
        monkeypatch.delenv(name)


def parsers() -> dict[str, argparse.ArgumentParser]:
    sub = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def actions(command: str) -> dict[str, argparse.Action]:
    return {s: a for a in parsers()[command]._actions for s in a.option_strings}


def table(page: str, heading: str) -> tuple[str, list[dict[str, str]]]:
    """The first table after the line `heading` of docs/`page`: (the text between them, its rows as {column: cell})."""
    lines = (DOCS / page).read_text().splitlines()
    start = lines.index(heading)
    first = next(i for i in range(start, len(lines)) if lines[i].startswith("|"))
    end = next((i for i, line in enumerate(lines[first:]) if not line.startswith("|")), len(lines) - first)
    header, _, *rows = [split_row(line) for line in lines[first:first + end]]
    return "\n".join(lines[start:first]), [dict(zip(header, row)) for row in rows]


def split_row(line: str) -> list[str]:
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def code(cell: str) -> list[str]:
    """The `code` spans of a cell."""
    return re.findall(r"`([^`]*)`", cell)


def same_default(action: argparse.Action, text: str) -> bool:
    """Whether the docs' `text` spells `action`'s default ('60', '4 MiB', '1,024', '127.0.0.1:8000', '10 s')."""
    text = text.replace(",", "").removesuffix(" s").strip()
    if isinstance(action.default, int) and not isinstance(action.default, bool) and re.fullmatch(r"[\d.]+ ?[KMG]iB",
                                                                                                text):
        return parse_bytes(text.replace(" ", "")) == action.default
    value = action.type(text) if action.type is not None else text
    return value == action.default


# -- the command table (docs/configuration.md, ## Commands) -------------------------------------------------------
def test_the_command_table_lists_every_command_with_a_link_to_its_reference():
    """Each row names commands (`pagedserve NAME`), each linked to its section of the generated cli-reference.md (whose
    flags and defaults are the parser's: tests/test_docs.py); together the rows name every command."""
    _, rows = table("configuration.md", "## Commands")
    listed = []
    for row in rows:
        for name, anchor in re.findall(r"\[`pagedserve ([a-z-]+)`\]\(cli-reference\.md#([a-z-]+)\)", row["command"]):
            assert anchor == f"pagedserve-{name}", row["command"]
            listed.append(name)
    assert sorted(listed) == sorted(parsers()), listed


# -- the flag tables: Limits, Security, Connections -----------------------------------------------------------------
FLAG_TABLES = [
    # (the page in docs/, heading, the column of flags, the column of their default or None, the commands a row is on
    # or None: the `on` column's)
    ("api.md", "## Limits: every input is bounded", "flag", "bound", ("scheduler", "up")),
    ("security.md", "## Connections: every port is bounded", "flag (default)", "flag (default)", ("scheduler", "up")),
    ("security.md", "## Security: TLS, API keys and worker tokens", "flags", None, None),
]


def flag_rows():
    for page, heading, flag_column, default_column, commands in FLAG_TABLES:
        intro, rows = table(page, heading)
        if commands is not None:  # NOTE: the words before the table say which commands have its flags
            said = "Flags are on " + " and ".join(f"`pagedserve {c}`" for c in commands)
            assert said in " ".join(intro.split()), heading
        for row in rows:
            for flag in FLAG.findall(" ".join(code(row[flag_column]))):
                on = commands or tuple(c.strip("`") for c in re.split(r",\s*", row["on"]))
                if default_column == flag_column:  # `--flag` (its default), in one cell
                    after = re.search(rf"`{flag}` \(([^)]*)\)", row[flag_column])
                    default = after.group(1) if after else None
                else:
                    default = row[default_column] if default_column else None
                yield heading.lstrip("# ").split(":")[0], flag, on, default


@pytest.mark.parametrize("table_name, flag, on, default", list(flag_rows()),
                         ids=[f"{t} {f}" for t, f, _, _ in flag_rows()])
def test_each_flag_of_a_table_is_on_its_commands_with_its_default(table_name, flag, on, default):
    for command in on:
        assert flag in actions(command), f"the docs' {table_name} table lists {flag} on `{command}`, which " \
                                         f"`pagedserve {command}` does not have"
    if default is None:
        return
    # the default as the first command (the service itself, not `up`, which forwards it only when given) has it
    action = actions(on[0])[flag]
    shown = re.sub(r"`[^`]*`", "", default).replace("(", " ").replace(")", " ").split(";")[0].strip()
    number = re.match(r"^([\d,]+(?:\.\d+)?(?: ?[KMG]iB| s)?)\b", shown)  # '16 strings of ...': 16
    if action.default is None or number is None or ".." in default:
        return  # worked out at start (a share of the open files limit, of max_model_len), or a range
    assert same_default(action, number.group(1)), \
        f"the docs' {table_name} table says {flag} is {number.group(1)}; its default is {action.default!r}"


def test_the_tables_are_read():
    """A guard for the parsing above: the tables were found and hold the flags they are known to."""
    flags = {(t, f) for t, f, _, _ in flag_rows()}
    assert {("Limits", "--max-queued-requests"), ("Connections", "--header-timeout"),
            ("Security", "--tls-server-name")} <= flags
