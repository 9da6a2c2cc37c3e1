"""Tool calls in a model family's own output format, parsed as the text streams (--tool-call-parser)."""

from __future__ import annotations

import json
from dataclasses import dataclass

from scheduler_svc import json_text


@dataclass(slots=True, frozen=True)
class Content:
    """Text of the answer that is not a tool call."""

    text: str


@dataclass(slots=True, frozen=True)
class Call:
    """One whole tool call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str


Piece = Content | Call


def call_of(obj, arguments_keys: tuple[str, ...]) -> Call | None:
    """The Call a parsed JSON value spells ({"name": ..., KEY: {...}} for the first KEY present), or None."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    key = next((k for k in arguments_keys if k in obj), None)
    args = {} if key is None else obj[key]
    if isinstance(args, str):  # NOTE: some models write the arguments as a JSON string: it must hold an object
        try:
            args = json_text.loads(args)
        except ValueError:
            return None
    if not isinstance(args, dict):
        return None
    return Call(obj["name"], json.dumps(args, ensure_ascii=False))


def _held_prefix(text: str, tag: str) -> int:
    """How many characters at the end of `text` may be the start of `tag` (held back until the next text)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class HermesParser:
    """Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` blocks, with text around them.
    A block that does not parse stays text; an unclosed block at the end is a call if its JSON is whole."""

    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._buf = ""
        self._inside = False
        self._scanned = 0  # inside a block: where the search for its end resumes (a long call is not rescanned)

    def feed(self, text: str) -> list[Piece]:
        self._buf += text
        out: list[Piece] = []
        while True:
            if self._inside:
                end = self._buf.find(self.CLOSE, self._scanned)
                if end < 0:
                    self._scanned = max(0, len(self._buf) - len(self.CLOSE) + 1)
                    return out
                body, self._buf = self._buf[:end], self._buf[end + len(self.CLOSE):]
                self._inside, self._scanned = False, 0
                out.append(self._block(body, closed=True))
                continue
            start = self._buf.find(self.OPEN)
            if start < 0:
                keep = _held_prefix(self._buf, self.OPEN)
                text, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                if text:
                    out.append(Content(text))
                return out
            if start:
                out.append(Content(self._buf[:start]))
            self._buf = self._buf[start + len(self.OPEN):]
            self._inside = True

    def finish(self) -> list[Piece]:
        rest, self._buf = self._buf, ""
        if self._inside:
            self._inside = False
            return [self._block(rest, closed=False)]
        return [Content(rest)] if rest else []

    def _block(self, body: str, closed: bool) -> Piece:
        try:
            call = call_of(json_text.loads(body), ("arguments", "parameters"))
        except ValueError:
            call = None
        return call or Content(self.OPEN + body + (self.CLOSE if closed else ""))


class Llama3JsonParser:
    """Llama 3's JSON tool calls: the whole answer is `{"name": ..., "parameters": {...}}` (several separated by
    `;`), optionally after `<|python_tag|>`. An answer that starts otherwise is text, streamed as it comes; one
    that starts as JSON is held to its end, then is calls if every part parses, else text."""

    TAG = "<|python_tag|>"

    def __init__(self) -> None:
        self._buf = ""
        self._json: bool | None = None  # undecided until the first non-blank text

    def feed(self, text: str) -> list[Piece]:
        if self._json is False:
            return [Content(text)] if text else []
        self._buf += text
        if self._json is None:
            head = self._buf.lstrip()
            if not head or self.TAG.startswith(head):
                return []  # NOTE: blanks or part of the tag: not decided yet
            self._json = head.startswith(("{", self.TAG))
            if not self._json:
                rest, self._buf = self._buf, ""
                return [Content(rest)]
        return []

    def finish(self) -> list[Piece]:
        rest, self._buf = self._buf, ""
        if not self._json:
            return [Content(rest)] if rest else []
        calls = self._calls(rest.lstrip().removeprefix(self.TAG))
        return calls if calls else [Content(rest)]

    @staticmethod
    def _calls(text: str) -> list[Call]:
        decoder, calls, i = json.JSONDecoder(), [], 0
        while True:
            while i < len(text) and (text[i].isspace() or text[i] == ";"):
                i += 1
            if i == len(text):
                return calls
            try:
                obj, i = decoder.raw_decode(text, i)
            except ValueError:
                return []
            call = call_of(obj, ("parameters", "arguments"))
            if call is None:
                return []
            calls.append(call)


PARSERS = {"hermes": HermesParser, "llama3_json": Llama3JsonParser}  # --tool-call-parser (its "none": no parser)


def make_parser(name: str) -> HermesParser | Llama3JsonParser:
    return PARSERS[name]()
