"""Every request field of the OpenAI-compatible API is implemented, accepted and deliberately ignored, or refused."""

from __future__ import annotations

import json
from dataclasses import dataclass

from pydantic import BaseModel

from scheduler_svc.frontend.api import invalid
from scheduler_svc.http.schemas import ChatCompletionRequest, CompletionRequest

COMPLETIONS, CHAT = "completions", "chat"
IMPLEMENTED, IGNORED, REFUSED = "implemented", "ignored", "refused"
MODELS: dict[str, type[BaseModel]] = {COMPLETIONS: CompletionRequest, CHAT: ChatCompletionRequest}


@dataclass(frozen=True, slots=True)
class Ignored:
    reason: str  # why the output cannot depend on it here


@dataclass(frozen=True, slots=True)
class Refused:
    reason: str  # what is not implemented
    neutral: tuple = ()  # values that ask for nothing, accepted (null always is)
    accepted: str = ""  # what is accepted, when not only the neutral values (a field checked where it is used)

    def accepts(self, value) -> bool:
        return value is None or any(_same(value, n) for n in self.neutral)

    def accepted_text(self, code: str = "") -> str:
        return self.accepted or ", ".join(f"{code}{v}{code}" for v in ["null", *map(json.dumps, self.neutral)])


def _same(value, neutral) -> bool:
    if isinstance(value, bool) or isinstance(neutral, bool):  # NOTE: JSON's false is not 0, nor true 1.0
        return value is neutral
    return value == neutral


# NOTE: a field whose value would change the output must never be ignored: it is implemented or refused.
_IGNORED_BOTH = {
    "user": Ignored("an end-user id for a provider's abuse monitoring; there is none here"),
    "session_id": Ignored("vLLM's session affinity hint for routing; routing here follows the prefix cache"),
    "mm_payload": Ignored("vLLM's shape of multimodal render output; there are no multimodal inputs"),
    "return_mm_kwargs": Ignored("vLLM's deprecated alias of mm_payload"),
}
_IGNORED_CHAT = {
    "metadata": Ignored("tags of stored completions; nothing is stored"),
    "store": Ignored("OpenAI's storage of completions for later retrieval; nothing is stored"),
    "safety_identifier": Ignored("an end-user id for a provider's abuse monitoring, like user"),
    "service_tier": Ignored("a processing tier (latency and price); there is one tier here"),
    "prompt_cache_key": Ignored("a routing hint for OpenAI's prompt cache; the prefix cache here matches tokens "
                                "by itself"),
    "prompt_cache_retention": Ignored("how long OpenAI keeps a cached prompt; the prefix cache keeps blocks while "
                                      "the pool has room"),
    "prompt_cache_options": Ignored("OpenAI's prompt cache settings; the prefix cache here is always on"),
    "prediction": Ignored("Predicted Outputs: a latency hint; the output does not depend on it"),
    "media_io_kwargs": Ignored("vLLM's settings of media loaders; non-text content parts are refused"),
    "mm_processor_kwargs": Ignored("vLLM's settings of a multimodal processor; there is none (text only)"),
}

_NO_BEAM = "beam search is not implemented"
_REFUSED_BOTH = {
    "use_beam_search": Refused(_NO_BEAM, (False,)),
    "length_penalty": Refused(f"a beam search setting: {_NO_BEAM}", (1.0,)),
    "watermarking": Refused("output watermarking is not implemented", (False,)),
    "spaces_between_special_tokens": Refused("special tokens are decoded as the tokenizer does", (True,)),
    "logprob_token_ids": Refused("logprobs of chosen token ids are not computed (top_logprobs are)"),
    "prompt_embeds": Refused("prompts are text or token ids, not embeddings"),
    "return_token_offsets": Refused("character offsets of tokens are not returned", (False,)),
    "routed_experts_prompt_start": Refused("routed-expert data (MoE) is not returned", (0,)),
    "kv_transfer_params": Refused("disaggregated serving (KV transfer) is not implemented"),
    "ec_transfer_params": Refused("disaggregated serving (encoder-cache transfer) is not implemented"),
    "vllm_xargs": Refused("there are no custom logits processors to pass arguments to", ({},)),
    "repetition_detection": Refused("n-gram repetition detection is not implemented"),
    "thinking_token_budget": Refused("reasoning budgets are not implemented (no reasoning parser)"),
    "stream_interval": Refused("every step's tokens are streamed as they come (1)", (1,)),
}
_REFUSED_COMPLETIONS = {
    "suffix": Refused("fill-in-the-middle (a text after the completion) is not implemented", ("",)),
    # NOTE: best_of is a declared field: convert.completion_job accepts it equal to n (every sample returned)
    "best_of": Refused("samples are not ranked", accepted="`null`, or equal to `n`"),
}
_REFUSED_CHAT = {
    "audio": Refused("audio output is not implemented"),
    "modalities": Refused("the output is text only", (["text"],)),
    "functions": Refused("the deprecated function calling: use tools", ([],)),
    "function_call": Refused("the deprecated function calling: use tool_choice", ("none",)),
    "moderation": Refused("moderation is not implemented"),
    "reasoning_effort": Refused("reasoning effort is not implemented (chat_template_kwargs reach the template)"),
    "verbosity": Refused("verbosity control is not implemented"),
    "web_search_options": Refused("web search is not implemented"),
    "include_reasoning": Refused("there is no reasoning parser: reasoning stays in the content", (True,)),
    "return_prompt_text": Refused("responses do not repeat the rendered prompt", (False,)),
    "chat_template": Refused("the model's own chat template is used; a request cannot bring one"),
}

IGNORED_FIELDS: dict[str, dict[str, Ignored]] = {COMPLETIONS: _IGNORED_BOTH, CHAT: {**_IGNORED_BOTH, **_IGNORED_CHAT}}
REFUSED_FIELDS: dict[str, dict[str, Refused]] = {COMPLETIONS: {**_REFUSED_BOTH, **_REFUSED_COMPLETIONS},
                                                 CHAT: {**_REFUSED_BOTH, **_REFUSED_CHAT}}

# Nested objects. Messages' fields beyond role and content reach the chat template as they are (the model's template
# renders them as it was trained to, or not at all); stream_options.
MESSAGE_TEMPLATE_FIELDS = ("name", "tool_calls", "tool_call_id", "reasoning", "reasoning_content", "refusal")
MESSAGE_REFUSED = {
    "audio": Refused("audio in a conversation is not implemented"),
    "function_call": Refused("the deprecated function calling: use tool_calls"),
    "tools": Refused("vLLM's tools of one message: give them as the request's tools"),
    "task": Refused("vLLM's message task is not implemented"),
    **{name: Refused("the Harmony message form (gpt-oss) is not implemented: give role and content")
       for name in ("author", "channel", "content_type", "recipient")},
}
TEXT_PART_IGNORED = {
    "cache_control": Ignored("a prompt-caching hint (Anthropic's) some clients put on text parts; the prefix cache "
                             "here needs none"),
}
STREAM_OPTIONS_IGNORED = {
    "include_obfuscation": Ignored("OpenAI's random padding of stream events against length side channels; none is "
                                   "sent"),
}
STREAM_OPTIONS_REFUSED: dict[str, Refused] = {}


def endpoint_of(body: BaseModel) -> str:
    return CHAT if isinstance(body, ChatCompletionRequest) else COMPLETIONS


def classify(endpoint: str, name: str) -> str | None:
    """IMPLEMENTED, IGNORED or REFUSED for a top-level field of `endpoint`'s requests; None: unknown (refused)."""
    if name in REFUSED_FIELDS[endpoint]:
        return REFUSED
    if name in IGNORED_FIELDS[endpoint]:
        return IGNORED
    return IMPLEMENTED if name in MODELS[endpoint].model_fields else None


def check(body: BaseModel) -> None:
    """Raises EngineError(INVALID_ARGUMENT) naming the first field that is unknown, or known but not implemented and
    set to something other than its neutral value. NOTE: the request models keep unknown fields (extra="allow") for
    this check, so that each refusal says which kind of field it is."""
    endpoint = endpoint_of(body)
    refused, ignored = REFUSED_FIELDS[endpoint], IGNORED_FIELDS[endpoint]
    for name, value in (body.model_extra or {}).items():
        if name in refused:
            _refuse_unless_neutral(name, name, refused[name], value)
        elif name not in ignored:
            raise invalid(name[:80], f"{name[:80]}: unknown field (docs/api.md lists every field this server "
                                     "accepts)")
    if body.stream_options is not None:
        _check_nested("stream_options", "stream_options", body.stream_options, STREAM_OPTIONS_REFUSED,
                      STREAM_OPTIONS_IGNORED)
    if endpoint == CHAT:
        _check_messages(body)


def _refuse_unless_neutral(param: str, where: str, rule: Refused, value) -> None:
    if not rule.accepts(value):
        raise invalid(param, f"{where} is not supported: {rule.reason} (accepted: {rule.accepted_text()})")


def _check_nested(param: str, where: str, model: BaseModel, refused: dict[str, Refused],
                  ignored: dict[str, Ignored], known: tuple[str, ...] = ()) -> None:
    for name, value in (model.model_extra or {}).items():
        path = f"{where}.{name[:80]}"
        if name in refused:
            _refuse_unless_neutral(param, path, refused[name], value)
        elif name not in ignored and name not in known:
            raise invalid(param, f"{path}: unknown field")


def _check_messages(body: ChatCompletionRequest) -> None:
    for i, m in enumerate(body.messages):
        _check_nested("messages", f"messages[{i}]", m, MESSAGE_REFUSED, {}, MESSAGE_TEMPLATE_FIELDS)
        if isinstance(m.content, list):
            for j, part in enumerate(m.content):
                if part.type == "text":  # NOTE: other types are refused by convert, naming the type
                    _check_nested("messages", f"messages[{i}].content[{j}]", part, {}, TEXT_PART_IGNORED)


def markdown() -> str:
    """docs/api.md's lists of ignored and refused fields (tests/http/test_fields.py keeps them equal)."""
    lines = ["| ignored field | endpoints | why its value cannot change the output here |", "| --- | --- | --- |"]
    for name, endpoints, rule in _rows(IGNORED_FIELDS):
        lines.append(f"| `{name}` | {endpoints} | {rule.reason} |")
    for name, rule in STREAM_OPTIONS_IGNORED.items():
        lines.append(f"| `stream_options.{name}` | both | {rule.reason} |")
    for name, rule in TEXT_PART_IGNORED.items():
        lines.append(f"| `messages[].content[].{name}` | chat | {rule.reason} |")
    lines += ["", "| refused unless neutral | endpoints | accepted values | why |", "| --- | --- | --- | --- |"]
    for name, endpoints, rule in _rows(REFUSED_FIELDS):
        lines.append(f"| `{name}` | {endpoints} | {rule.accepted_text('`')} | {rule.reason} |")
    for prefix, table in (("stream_options.", STREAM_OPTIONS_REFUSED), ("messages[].", MESSAGE_REFUSED)):
        for name, rule in table.items():
            lines.append(f"| `{prefix}{name}` | {'both' if prefix[0] == 's' else 'chat'} | "
                         f"{rule.accepted_text('`')} | {rule.reason} |")
    return "\n".join(lines)


def _rows(tables: dict[str, dict]):
    """(name, endpoints, rule) once per distinct rule, sorted by name."""
    seen: dict[tuple[str, int], tuple[object, list[str]]] = {}
    for endpoint, table in tables.items():
        for name, rule in table.items():
            seen.setdefault((name, id(rule)), (rule, []))[1].append(endpoint)
    for (name, _), (rule, endpoints) in sorted(seen.items(), key=lambda kv: (kv[0][0], kv[1][1])):
        yield name, "both" if len(endpoints) == 2 else endpoints[0], rule
