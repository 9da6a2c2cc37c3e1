"""JSON text a client (or a model) sends, parsed with its nesting bounded: json.loads recurses once per level, so a
text of a few thousand `[` is a RecursionError (a 500 with a traceback), and what parses deep (a schema) recurses
again in whatever reads it (the grammar compiler, the chat template)."""

from __future__ import annotations

import json
from typing import Any

MAX_DEPTH = 64  # nesting levels of arrays and objects; a JSON schema of 20 nested objects is ~40
_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # as int8: +1, +1, -1, -1
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


class TooDeep(ValueError):
    """A JSON text nested deeper than MAX_DEPTH. NOTE: a ValueError, as json.loads' own failures are: a caller
    that treats text that is not JSON as plain text does the same with this."""

    def __init__(self) -> None:
        super().__init__(f"JSON nested more than {MAX_DEPTH} levels deep (arrays and objects), the most accepted")


def depth(text: str) -> int:
    """The deepest nesting of arrays and objects in `text`, brackets inside strings aside. NOTE: no parsing and no
    Python loop over characters (an adversary's 4 MB costs ~0.05 s): escapes go (an escaped backslash first, so
    that a quote after it still counts), strings are every other piece between quotes, the rest keeps its brackets
    alone, an opening one as +1 and a closing one as -1; the depth is their running sum's maximum."""
    import numpy as np  # NOTE: here: numpy holds ~11 MB of a scheduler's memory, which most requests never use

    unescaped = text.replace("\\\\", "").replace('\\"', "")
    outside = "".join(unescaped.split('"')[::2]).encode("ascii", "ignore")
    steps = np.frombuffer(outside.translate(_STEPS, _NOT_BRACKETS), dtype=np.int8)
    return int(np.cumsum(steps, dtype=np.int64).max()) if steps.size else 0


def loads(text: str) -> Any:
    """json.loads with the nesting bounded: raises TooDeep (a ValueError) past MAX_DEPTH levels."""
    if depth(text) > MAX_DEPTH:
        raise TooDeep()
    return json.loads(text)
