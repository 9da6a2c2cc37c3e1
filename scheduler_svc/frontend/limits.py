"""Input bounds of the client APIs, checked before any tokenizing: each names its field and its bound."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagedserve_common.config import (MAX_MESSAGE_SIZE, MAX_SEQS_PER_REQUEST, MAX_STOP_CHARS, MAX_STOP_STRINGS,
                                      MAX_STRUCTURED_OUTPUT_BYTES, PROMPT_CHARS_PER_TOKEN)
from scheduler_svc.errors import EngineError, ErrorCode

if TYPE_CHECKING:
    from scheduler_svc.frontend.inputs import GenerateInput


@dataclass(slots=True, frozen=True)
class Limits:
    """Every bound a request meets before it is queued (the engine adds vocabulary, max_tokens and n).

    Those with a flag are the ones a deployment may need to move; the others are far above any real use."""

    max_prompt_chars: int  # --max-prompt-chars: a text prompt, or the characters of all chat messages together
    max_message_size: int = MAX_MESSAGE_SIZE  # --max-message-size: one gRPC request message or one HTTP body
    max_stop_strings: int = MAX_STOP_STRINGS  # --max-stop-strings
    max_seqs_per_request: int = MAX_SEQS_PER_REQUEST  # --max-seqs-per-request: prompts x n
    max_structured_output_bytes: int = MAX_STRUCTURED_OUTPUT_BYTES  # --max-structured-output-bytes
    max_stop_chars: int = MAX_STOP_CHARS  # each stop string
    max_stop_token_ids: int = 1024
    max_request_id_chars: int = 256
    max_cache_salt_chars: int = 256
    max_messages: int = 4096  # chat messages in one request
    max_logit_bias: int = 1024  # logit_bias entries
    max_bad_words_token_ids: int = 16  # banned token sequences the client sends (bad_words count as stop strings)
    max_bad_word_tokens: int = 64  # ids in one of them
    # allowed_token_ids as sent, repeats included (past the largest vocabularies: the front end then bounds the
    # distinct ids by the model's own, each below its vocabulary size)
    max_allowed_token_ids: int = 1 << 18

    @classmethod
    def for_model(cls, max_model_len: int, max_prompt_chars: int | None = None, **overrides) -> Limits:
        return cls(max_prompt_chars=max_prompt_chars or max_model_len * PROMPT_CHARS_PER_TOKEN, **overrides)

    def check_counts(self, num_stop: int, num_stop_token_ids: int, num_messages: int, num_logit_bias: int = 0,
                     num_bad_words: int = 0, num_bad_words_token_ids: int = 0, num_allowed_token_ids: int = 0) -> None:
        """The list lengths alone, before an API converts its lists (a 4 MiB message holds ~2 million empty ones)."""
        _at_most("stop", num_stop, self.max_stop_strings, "strings", "--max-stop-strings")
        _at_most("stop_token_ids", num_stop_token_ids, self.max_stop_token_ids, "token ids")
        _at_most("messages", num_messages, self.max_messages, "messages")
        _at_most("logit_bias", num_logit_bias, self.max_logit_bias, "entries")
        _at_most("bad_words", num_bad_words, self.max_stop_strings, "strings", "--max-stop-strings")
        _at_most("bad_words_token_ids", num_bad_words_token_ids, self.max_bad_words_token_ids, "sequences")
        _at_most("allowed_token_ids", num_allowed_token_ids, self.max_allowed_token_ids, "token ids")

    def check_bad_word_lengths(self, lengths: Iterable[int]) -> None:
        """The length of each bad_words_token_ids sequence (after check_counts bounded their number)."""
        for i, n in enumerate(lengths):
            _at_most(f"bad_words_token_ids[{i}]", n, self.max_bad_word_tokens, "token ids", field="bad_words_token_ids")

    def check_seqs(self, num_prompts: int, n: int) -> None:
        """A request's sequences, before its prompts are tokenized: n samples of each of its prompts (several only
        in a /v1/completions batch). Names n when n alone is over, else prompt."""
        bound, flag = self.max_seqs_per_request, "--max-seqs-per-request"
        if n > bound:
            raise EngineError(ErrorCode.INVALID_ARGUMENT, f"n is {n}; the limit is {bound} sequences per request "
                                                          f"({flag})", "n")
        if num_prompts * n > bound:
            raise EngineError(ErrorCode.INVALID_ARGUMENT, f"prompt has {num_prompts} prompts and n is {n}: "
                                                          f"{num_prompts * n} sequences; the limit is {bound} per "
                                                          f"request ({flag})", "prompt")

    def check(self, inp: GenerateInput) -> None:
        """Raises EngineError(INVALID_ARGUMENT) naming the first field beyond its bound. O(size of the input)."""
        _at_most("request_id", len(inp.request_id), self.max_request_id_chars, "characters")
        _at_most("cache_salt", len(inp.cache_salt), self.max_cache_salt_chars, "characters")
        sp = inp.sampling
        self.check_counts(len(inp.stop), len(sp.stop_token_ids), len(inp.messages or ()), len(sp.logit_bias),
                          len(inp.bad_words), len(sp.bad_words_token_ids), len(sp.allowed_token_ids))
        self.check_bad_word_lengths(len(ids) for ids in sp.bad_words_token_ids)
        for i, s in enumerate(inp.stop):
            _at_most(f"stop[{i}]", len(s), self.max_stop_chars, "characters", field="stop")
        if (so := inp.sampling.structured_output) is not None:
            size = len(so.spec.encode("utf-8", "surrogatepass")) + sum(len(c.encode("utf-8", "surrogatepass"))
                                                                       for c in so.choices)
            _at_most("structured_output", size, self.max_structured_output_bytes, "bytes",
                     "--max-structured-output-bytes")
        for i, s in enumerate(inp.bad_words):
            _at_most(f"bad_words[{i}]", len(s), self.max_stop_chars, "characters", field="bad_words")
        if inp.prompt is not None:
            _at_most("prompt", len(inp.prompt), self.max_prompt_chars, "characters", "--max-prompt-chars")
        if inp.messages is not None:
            chars = sum(len(m.get("role") or "") + _content_chars(m.get("content")) for m in inp.messages)
            _at_most("messages", chars, self.max_prompt_chars, "characters of role and content together",
                     "--max-prompt-chars")


def _content_chars(content) -> int:
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):  # OpenAI's text parts
        return sum(len(p.get("text") or "") for p in content if isinstance(p, dict))
    return 0


def _at_most(name: str, value: int, bound: int, unit: str, flag: str = "", field: str | None = None) -> None:
    if value > bound:
        where = f" ({flag})" if flag else ""
        raise EngineError(ErrorCode.INVALID_ARGUMENT, f"{name} has {value} {unit}; the limit is {bound}{where}",
                          field or name)
