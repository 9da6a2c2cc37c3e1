"""The request body of OpenAI's Responses API (POST /v1/responses) and the rule for each of its fields: implemented
(declared here, translated into a chat request by scheduler_svc.http.responses_api), accepted because it cannot
change the output (Ignored, with why), or refused by name unless it asks for nothing (Refused). The server is
stateless: nothing is stored, so whatever needs a stored response, conversation or prompt is refused."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict

from scheduler_svc.frontend.api import invalid
from scheduler_svc.http.fields import Ignored, Refused

STATELESS = "responses are not stored (stateless): send the whole conversation as input"


class ResponsesRequest(BaseModel):
    """The fields implemented. NOTE: extra="allow" keeps every other field for check(), which refuses it by name
    unless it is on the lists below."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    input: str | list[dict[str, Any]] | None = None  # NOTE: optional here so that check() names previous_response_id
    instructions: str | None = None  # a system message before the input
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    stream: bool | None = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None  # {"format": ..., "verbosity": ...}: format is structured output
    # vLLM's extensions, as its Responses API takes them; each means what it means on /v1/chat/completions
    request_id: str | None = None
    cache_salt: str | None = None
    priority: int | None = None
    seed: int | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False


# the vLLM extensions, copied as they are into the chat request
VLLM_EXTENSIONS = ("request_id", "cache_salt", "priority", "seed", "top_k", "min_p", "repetition_penalty",
                   "ignore_eos")

# NOTE: a field whose value would change the output must never be ignored: it is implemented or refused.
IGNORED: dict[str, Ignored] = {
    "metadata": Ignored("tags of a stored response; nothing is stored (echoed back in the response)"),
    "user": Ignored("an end-user id for a provider's abuse monitoring; there is none here"),
    "safety_identifier": Ignored("an end-user id for a provider's abuse monitoring, like user"),
    "service_tier": Ignored("a processing tier (latency and price); there is one tier here"),
    "prompt_cache_key": Ignored("a routing hint for OpenAI's prompt cache; the prefix cache here matches tokens by "
                                "itself"),
    "prompt_cache_retention": Ignored("how long OpenAI keeps a cached prompt; the prefix cache keeps blocks while "
                                      "the pool has room"),
    "max_tool_calls": Ignored("a bound on calls of built-in tools, which are refused; function calls are returned, "
                              "never run here"),
    "stream_options": Ignored("its one option, include_obfuscation, pads events against length side channels; "
                              "none is sent"),
}
REFUSED: dict[str, Refused] = {
    "store": Refused("responses are not stored: stateless", (False,)),
    "previous_response_id": Refused(STATELESS),
    "conversation": Refused(f"conversations are not stored: {STATELESS}"),
    "background": Refused(f"a background response is polled for later: {STATELESS}", (False,)),
    "prompt": Refused("stored prompt templates are not implemented: send instructions and input"),
    "truncation": Refused("the input is not truncated: one too long for the model is refused", ("disabled",)),
    "top_logprobs": Refused("logprobs are not returned here (/v1/chat/completions returns them)", (0,)),
    "context_management": Refused("context compaction is not implemented", ([],)),
    "moderation": Refused("moderation is not implemented"),
}
# include's values that ask for nothing here: items of built-in tools (refused) and reasoning (none is produced)
NOTHING_TO_INCLUDE = ("file_search_call.results", "web_search_call.results", "web_search_call.action.sources",
                      "code_interpreter_call.outputs", "computer_call_output.output.image_url",
                      "message.input_image.image_url", "reasoning.encrypted_content")


def _check_include(value) -> None:
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise invalid("include", "include must be a list of strings")
    for v in value:
        if v not in NOTHING_TO_INCLUDE:
            raise invalid("include", f"include {v[:80]!r} is not supported: logprobs are not returned here "
                                     f"(accepted: {', '.join(NOTHING_TO_INCLUDE)})")


def _check_reasoning(value) -> None:
    """Accepted when it asks for no reasoning: every key null, or effort "none" (there is no reasoning parser)."""
    if value is None:
        return
    if not isinstance(value, dict):
        raise invalid("reasoning", "reasoning must be an object")
    for key, v in value.items():
        if v is not None and not (key == "effort" and v == "none"):
            raise invalid("reasoning", f"reasoning.{key[:80]} is not supported: reasoning effort and summaries are "
                                       "not implemented (accepted: null, or effort \"none\")")


CHECKED: dict[str, Callable[[Any], None]] = {"include": _check_include, "reasoning": _check_reasoning}


def check(body: ResponsesRequest) -> None:
    """Raises EngineError(INVALID_ARGUMENT) naming the first field that is unknown, or known but not implemented and
    set to something other than a value that asks for nothing."""
    for name, value in (body.model_extra or {}).items():
        if name in REFUSED:
            rule = REFUSED[name]
            if not rule.accepts(value):
                raise invalid(name, f"{name} is not supported: {rule.reason} (accepted: {rule.accepted_text()})")
        elif name in CHECKED:
            CHECKED[name](value)
        elif name not in IGNORED:
            raise invalid(name[:80], f"{name[:80]}: unknown field (this server's Responses API refuses a field it "
                                     "does not know rather than ignore what might change the output)")
