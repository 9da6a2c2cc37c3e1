"""FrontEnd: turns one generation as a client API asks for it into an engine request and its stream."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import jinja2

from scheduler_svc.core.request import SamplingConfig
from scheduler_svc.errors import EngineError, ErrorCode
from scheduler_svc.frontend.stream import RequestStream
from scheduler_svc.frontend.tokenizer import Tokenizer

if TYPE_CHECKING:
    from scheduler_svc.engine import Engine

INPUTS = ("prompt", "prompt_token_ids", "messages")


@dataclass(slots=True)
class GenerateInput:
    """One generation before tokenizing, whichever API it came from. Exactly one of the inputs is set (not None)."""

    prompt: str | None = None
    prompt_token_ids: list[int] | None = None
    messages: list[dict] | None = None  # [{"role": ..., "content": ...}], rendered with the chat template
    sampling: SamplingConfig = field(default_factory=SamplingConfig)
    stop: tuple[str, ...] = ()
    request_id: str = ""
    cache_salt: str = ""
    chat_template_kwargs: dict = field(default_factory=dict)  # e.g. enable_thinking; reach the template as is
    fill_context: bool = False  # max_tokens unset (OpenAI chat): generate up to the context's end


def invalid(field_name: str, message: str) -> EngineError:
    return EngineError(ErrorCode.INVALID_ARGUMENT, message, field_name)


class FrontEnd:
    """What the gRPC servicer and the HTTP app call: one validation, one tokenization, one stream type."""

    def __init__(self, engine: Engine, tokenizer: Tokenizer) -> None:
        self.engine = engine
        self.tokenizer = tokenizer

    @property
    def model_id(self) -> str:
        return self.engine.config.model_id

    @property
    def max_model_len(self) -> int:
        return self.engine.config.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.engine.config.vocab_size

    @property
    def max_n(self) -> int:
        return self.engine.config.max_num_seqs

    def serving(self) -> tuple[bool, str]:
        """(True, "") when requests can be served now, else (False, why): no worker, or draining."""
        if self.engine.draining:
            return False, "the server is draining: no new requests"
        if not self.engine.workers:
            return False, "no worker is attached"
        return True, ""

    def prompt_token_ids(self, inp: GenerateInput) -> tuple[str, list[int]]:
        """(the input's field name, its token ids). Raises EngineError(INVALID_ARGUMENT) naming the field."""
        given = [name for name in INPUTS if getattr(inp, name) is not None]
        if len(given) != 1:
            raise invalid(given[1] if given else "prompt", "set exactly one of prompt, prompt_token_ids and "
                          f"messages (got {' and '.join(given) if given else 'none'})")
        kind = given[0]
        if kind == "prompt_token_ids":
            ids = list(inp.prompt_token_ids)
        elif kind == "prompt":
            ids = self.tokenizer.encode(inp.prompt)
        else:
            ids = self._chat_ids(inp)
        if not ids:
            raise invalid(kind, f"{kind} is empty")
        limit = self.max_model_len - 1
        if len(ids) > limit:
            unit = "" if kind == "prompt_token_ids" else " after tokenizing"
            raise invalid(kind, f"{kind} has {len(ids)} tokens{unit}; max_model_len {self.max_model_len} leaves "
                                f"room for at most {limit}")
        return kind, ids

    def _chat_ids(self, inp: GenerateInput) -> list[int]:
        if not inp.messages:
            raise invalid("messages", "messages is empty")
        for i, m in enumerate(inp.messages):
            if not isinstance(m.get("role"), str) or not m["role"]:
                raise invalid("messages", f"messages[{i}].role must be a non-empty string")
        try:
            return self.tokenizer.encode_chat(inp.messages, add_generation_prompt=True, **inp.chat_template_kwargs)
        except (jinja2.TemplateError, ValueError, TypeError) as e:
            # NOTE: templates reject bad conversations with raise_exception (e.g. roles that do not alternate)
            raise invalid("messages", f"messages: the chat template refused them: {e}") from None

    def generate(self, inp: GenerateInput) -> RequestStream:
        """Tokenizes, validates and admits `inp`; iterate the returned stream for its StreamItems.
        Raises EngineError (INVALID_ARGUMENT names the field)."""
        kind, ids = self.prompt_token_ids(inp)
        sampling = inp.sampling
        if sampling.top_k < -1:
            raise invalid("top_k", f"top_k must be >= 1, or 0 or -1 to keep all tokens; got {sampling.top_k}")
        if sampling.top_k == -1:  # vLLM's spelling of "off"
            sampling = dataclasses.replace(sampling, top_k=0)
        if inp.fill_context:
            max_tokens = max(1, self.engine.max_output_tokens(len(ids), max(1, sampling.n)))
            sampling = dataclasses.replace(sampling, max_tokens=max_tokens)
        stop = tuple(s for s in inp.stop if s)
        metrics, tokenizer = self.engine.metrics, self.tokenizer
        try:
            return self.engine.submit(inp.request_id, ids, sampling, inp.cache_salt,
                                      open_stream=lambda req: RequestStream(req, tokenizer, stop, metrics))
        except EngineError as e:
            if e.field == "prompt_token_ids" and kind != "prompt_token_ids":
                e.field = kind  # the ids came from this field
            raise

    def abort(self, request_id: str) -> None:
        """The client went away (cancel, deadline, disconnect): its blocks go back to the pool at the next step."""
        self.engine.abort(request_id)

    def token_text(self, token_id: int) -> str:
        """One token's own text (special tokens included), for logprobs."""
        return self.tokenizer.decode([token_id], skip_special_tokens=False)
