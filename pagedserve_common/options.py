"""Configuration fields that carry their flag: default, help text, parser, bounds and how `pagedserve up` takes it."""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pagedserve_common.units import parse_bytes

OPTION, GROUP = "pagedserve.option", "pagedserve.group"
ALWAYS, GIVEN = "always", "given"  # Option.up: `up` has the flag with this default and always forwards it / only
# forwards it when given (its default is then None: the child's own default holds)


def show_default(value: Any) -> str:
    """--help's spelling of a default."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, float):
        return f"{value:g}"
    return "''" if value == "" else str(value)


@dataclass(slots=True, frozen=True)
class Option:
    """One flag of a configuration field: --NAME for the field NAME (underscores as dashes)."""

    help: str
    type: Callable[[str], Any] | None = None  # argparse type (None: str; a bool field is a switch)
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    default_text: str | None = None  # --help's default where the field's is None (worked out later)
    show: Callable[[Any], str] = show_default  # --help's spelling of a default
    up: str | None = None  # ALWAYS, GIVEN or None: `pagedserve up` has no such flag
    nargs: str | None = None  # "+": one or more values (a tuple); its variable holds them space-separated


def option(default: Any, help: str, **kw: Any) -> Any:
    """A dataclass field that is a flag (see Option)."""
    return dataclasses.field(default=default, metadata={OPTION: Option(help, **kw)})


def count(default: Any, help: str, minimum: int = 1, **kw: Any) -> Any:
    """A flag of an integer >= `minimum` (metavar N unless given)."""
    kw.setdefault("metavar", "N")
    return option(default, help, type=at_least(int, minimum, f"an integer >= {minimum}"), **kw)


def seconds(default: Any, help: str, positive: bool = True, **kw: Any) -> Any:
    """A flag of a duration in seconds: > 0 (at least a millisecond), or >= 0 unless `positive`."""
    check = at_least(float, 1e-3, "seconds > 0") if positive else at_least(float, 0, "seconds >= 0")
    return option(default, help, type=check, metavar="SECONDS", **kw)


def group(cls: type, title: str) -> Any:
    """A dataclass field holding a group of options; `title` heads its section of --help."""
    return dataclasses.field(default_factory=cls, metadata={GROUP: title})


@dataclass(slots=True, frozen=True)
class Leaf:
    """An option of a configuration tree, where it sits (`title`: its group's, '' at the root)."""

    name: str
    default: Any
    option: Option
    title: str

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")


def leaves(cls: type, title: str = "") -> Iterator[Leaf]:
    """Every option of the tree rooted at dataclass `cls`, depth first in field order."""
    for f in dataclasses.fields(cls):
        if OPTION in f.metadata:
            yield Leaf(f.name, f.default, f.metadata[OPTION], title)
        elif GROUP in f.metadata:
            yield from leaves(f.default_factory, f.metadata[GROUP])


def values(obj: Any) -> dict[str, Any]:
    """A dataclass's fields by name (shallow: groups stay objects)."""
    return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}


def default_of(cls: type, name: str) -> Any:
    """The default of field `name` of dataclass `cls` (for a config that shares a flag's default)."""
    return next(f.default for f in dataclasses.fields(cls) if f.name == name)


def build(cls: type, source: Any, **extra: Any) -> Any:
    """`cls` (a tree root) with each option read off `source` by its name (an argparse Namespace), plus `extra`."""
    kwargs = {}
    for f in dataclasses.fields(cls):
        if OPTION in f.metadata:
            kwargs[f.name] = getattr(source, f.name)
        elif GROUP in f.metadata:
            kwargs[f.name] = build(f.default_factory, source)
    return cls(**kwargs, **extra)


# -- argparse types ----------------------------------------------------------------------------------------------
def at_least(kind: Callable[[str], Any], minimum: Any, what: str) -> Callable[[str], Any]:
    """A number of type `kind` >= `minimum`; `what` names the expectation in the error."""
    def parse(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not value >= minimum:  # NOTE: `not >=` refuses NaN too
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}")
        return value
    return parse


def byte_size(minimum: int = 0) -> Callable[[str], int]:
    """A byte size (parse_bytes) of at least `minimum` bytes."""
    def parse(text: str) -> int:
        try:
            value = parse_bytes(text)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"expected at least {minimum} bytes, got {text!r}")
        return value
    return parse


def parse_device(text: str) -> str:
    """argparse type for --device: cpu, cuda, cuda:N or cuda:auto (kept as given; `up` spreads plain cuda over the
    GPUs; a worker resolves cuda:auto by claiming a GPU no other worker on the host holds)."""
    head, sep, index = text.partition(":")
    if text in ("cpu", "cuda", "cuda:auto") or (head == "cuda" and sep and index.isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"expected cpu, cuda, cuda:N (N a GPU index) or cuda:auto, got {text!r}")
