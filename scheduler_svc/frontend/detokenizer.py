"""Streaming detokenization: text deltas per step, held back over split UTF-8 characters and stop strings."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

# Prompt tokens decoded ahead of the output as context, as vLLM does: decoders such as SentencePiece's drop
# the leading space of the first token they see, so the output's first word needs something before it.
PROMPT_CONTEXT_TOKENS = 5
REPLACEMENT_CHAR = "\ufffd"


class Decoder(Protocol):
    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(slots=True, frozen=True)
class DetokenizeResult:
    text_delta: str  # new text safe to send; "" when everything new is held back
    stopped: bool = False  # a stop string matched; the text ends just before it (or with it: include_stop_str)
    stop_string: str | None = None


class IncrementalDetokenizer:
    """Turns one sequence's output tokens into text deltas whose concatenation is decode(output ids).

    Two hold-backs, in order:
      1. tokens whose text is still an incomplete UTF-8 character (the window decodes to a trailing U+FFFD) wait
         for the next token (vLLM's prefix_offset/read_offset scheme, as in TGI);
      2. the longest tail of the text that could still begin a stop string waits until it no longer can.
    NOTE: each push decodes only the window of tokens since the last clean character boundary (usually one or
    two tokens), never the whole output.
    """

    __slots__ = ("_tok", "_skip_special", "_stops", "_include_stop", "_window", "_read", "_prefix_text", "_held",
                 "stop_string", "finished", "_num_unchecked")

    def __init__(self, tokenizer: Decoder, prompt_token_ids: Sequence[int] = (), skip_special_tokens: bool = True,
                 stop: Iterable[str] = (), include_stop_str: bool = False, min_tokens: int = 0) -> None:
        """Stop strings are looked for from the output's min_tokens-th token on (vLLM's min_tokens): the text of
        the tokens before it cannot stop the sample."""
        self._tok = tokenizer
        self._num_unchecked = max(0, min_tokens - 1)  # output tokens still to push whose text is not checked
        self._skip_special = skip_special_tokens
        self._include_stop = include_stop_str  # the matched stop string ends the text instead of being cut off
        self._stops = tuple(dict.fromkeys(stop))
        if "" in self._stops:
            raise ValueError("stop strings must not be empty")
        # _window: the token ids from prefix_offset on; _read: read_offset within it. The text of
        # _window[:_read] (= _prefix_text) was already handed on; later tokens' text is decoded after it.
        self._window = list(prompt_token_ids[-PROMPT_CONTEXT_TOKENS:])
        self._read = len(self._window)
        self._prefix_text = self._decode(self._window)
        if self._prefix_text.endswith(REPLACEMENT_CHAR):
            # The prompt ends inside a character (or in invalid bytes): output bytes could complete it, which
            # would change the context text itself. Decode the output on its own instead.
            self._window, self._read, self._prefix_text = [], 0, ""
        self._held = ""  # checked text not yet sent: it may be the start of a stop string
        self.stop_string: str | None = None
        self.finished = False

    def _decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=self._skip_special) if ids else ""

    def push(self, new_token_ids: Iterable[int]) -> DetokenizeResult:
        """Take this step's new output tokens; return the text that can be sent now."""
        if self.finished:
            return DetokenizeResult("", self.stop_string is not None, self.stop_string)
        parts, unchecked = [], ""
        # One token at a time: a push of several tokens may end inside a character, and the complete ones
        # before it should still go out now.
        for token_id in new_token_ids:
            self._window.append(token_id)
            text = self._decode(self._window)
            if len(text) > len(self._prefix_text) and not text.endswith(REPLACEMENT_CHAR):
                parts.append(text[len(self._prefix_text):])
                del self._window[:self._read]  # new prefix_offset = old read_offset
                self._read = len(self._window)
                self._prefix_text = self._decode(self._window)
            if self._num_unchecked:  # NOTE: before min_tokens: this text goes out as is, never held for stops
                self._num_unchecked -= 1
                unchecked += "".join(parts)
                parts = []
        result = self._check_stops("".join(parts), final=False)
        return DetokenizeResult(unchecked + result.text_delta, result.stopped, result.stop_string) if unchecked \
            else result

    def flush(self) -> DetokenizeResult:
        """At the end of the sequence (EOS, length, abort): everything still held back, U+FFFD included."""
        if self.finished:
            return DetokenizeResult("", self.stop_string is not None, self.stop_string)
        tail = self._decode(self._window)[len(self._prefix_text):]
        self._window, self._read, self._prefix_text = [], 0, ""
        result = DetokenizeResult(tail) if self._num_unchecked else self._check_stops(tail, final=True)
        self.finished = True
        return result

    def _check_stops(self, delta: str, final: bool) -> DetokenizeResult:
        if not self._stops:
            return DetokenizeResult(delta)
        # NOTE: invariant: no stop string occurs in the text so far, and _held is the longest tail of it that is
        # a proper prefix of a stop string. So any new match starts inside _held or later: searching
        # _held + delta finds every match, however the text was split across pushes.
        text = self._held + delta
        best: tuple[int, int, str] | None = None
        for stop in self._stops:
            start = text.find(stop)
            if start >= 0:
                # The match that completes first wins (then the one starting first): that is what token-by-token
                # streaming would see, so the result does not depend on how tokens were grouped into pushes.
                key = (start + len(stop), start, stop)
                if best is None or key < best:
                    best = key
        if best is not None:
            _, start, stop = best
            self._held = ""
            self.stop_string = stop
            self.finished = True
            return DetokenizeResult(text[:start + len(stop) if self._include_stop else start], True, stop)
        keep = 0 if final else self._stop_prefix_len(text)
        self._held = text[len(text) - keep:] if keep else ""
        return DetokenizeResult(text[:len(text) - keep])

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest tail of `text` that is a proper prefix of some stop string."""
        longest = 0
        for stop in self._stops:
            for n in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:n]):
                    longest = n
                    break
        return longest
