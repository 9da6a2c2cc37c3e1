"""Request bodies of Anthropic's Messages API (POST /v1/messages and /v1/messages/count_tokens), and what this server
does with every field: implemented, accepted and ignored (with why its value cannot change the output), or refused
by name (with what is not implemented). scheduler_svc.http.messages_api translates them into a chat request."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from scheduler_svc.frontend.api import invalid
from scheduler_svc.http.fields import Ignored, Refused


# NOTE: extra="allow" everywhere, as in schemas.py: check() refuses each undeclared field by name unless it is listed
# below as ignored (or refused unless neutral), so that a refusal says which kind of field it is.
class Block(BaseModel):
    """One content block, whatever its type: messages_api takes text, tool_use (an assistant's) and tool_result (a
    user's) and refuses the other types by name; check_block refuses a field that is not its type's."""

    model_config = ConfigDict(extra="allow")

    type: str
    text: str | None = None  # text
    id: str | None = None  # tool_use
    name: str | None = None  # tool_use
    input: dict[str, Any] | None = None  # tool_use: the call's arguments
    tool_use_id: str | None = None  # tool_result: the call it answers
    content: str | list[Block] | None = None  # tool_result: its text (text blocks)
    is_error: bool | None = None  # tool_result: reaches the chat template as the tool message's is_error


class Message(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(BaseModel):
    """A client tool. NOTE: every field optional, so that a server tool (a `type` such as web_search_20250305, no
    input_schema) is refused by its type, not by pydantic as a tool missing input_schema."""

    model_config = ConfigDict(extra="allow")

    type: str | None = None  # "custom" or absent: a client tool
    name: str | None = None
    description: str | None = None
    input_schema: dict[str, Any] | None = None


class ToolChoice(BaseModel):
    model_config = ConfigDict(extra="allow")

    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # type tool: the tool to call
    disable_parallel_tool_use: bool | None = None  # at most one call (auto, any, tool)


class Conversation(BaseModel):
    """What both routes render: the prompt (count_tokens counts it)."""

    model_config = ConfigDict(extra="allow")

    model: str
    messages: list[Message] = Field(min_length=1)
    system: str | list[Block] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None

    @property
    def request_id(self) -> None:
        """NOTE: Anthropic's API has no request id (serving.serve reads vLLM's): the id is always a new one."""
        return None


class CountTokensRequest(Conversation):
    """POST /v1/messages/count_tokens: the conversation only (nothing is generated)."""


class MessagesRequest(Conversation):
    max_tokens: int  # NOTE: required, as by Anthropic: there is no default length
    stop_sequences: list[str] | None = None
    stream: bool = False
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None


CACHE_CONTROL = Ignored("a prompt-caching breakpoint; the prefix cache here matches tokens by itself")
# NOTE: a field whose value would change the output is never ignored: it is implemented or refused
IGNORED = {  # on both routes
    "cache_control": CACHE_CONTROL,
    "speed": Ignored("an inference speed mode (standard or fast); the output is the same, at this server's speed"),
    "user_profile_id": Ignored("an Anthropic account's user profile; there are no accounts here (API keys name "
                               "tenants)"),
    "workspace_id": Ignored("an Anthropic workspace; there are none here (API keys name tenants)"),
}
IGNORED_GENERATING = {  # on /v1/messages only
    "metadata": Ignored("an end-user id (metadata.user_id) for Anthropic's abuse detection; there is none here"),
    "service_tier": Ignored("a capacity tier (auto or standard_only); there is one tier here"),
    "inference_geo": Ignored("the region inference runs in; this server runs where it is"),
    "diagnostics": Ignored("asks Anthropic's prompt cache why it missed (previous_message_id); none are returned, "
                           "and the output does not depend on them"),
}
_SERVER_SIDE = "Anthropic's server-side features are not implemented"
REFUSED = {
    "thinking": Refused("extended thinking is not implemented (the model's answer is its text)",
                        ({"type": "disabled"},)),
    "container": Refused(f"code execution containers: {_SERVER_SIDE}"),
    "mcp_servers": Refused(f"MCP servers: {_SERVER_SIDE}; give client tools", ([],)),
    "context_management": Refused(f"context editing: {_SERVER_SIDE}"),
    "output_format": Refused("structured outputs are not implemented on this route (the chat route's "
                             "response_format is)"),
    "output_config": Refused("output settings (effort, structured output formats) are not implemented", ({},)),
}
# Not on count_tokens: they shape the answer, not the prompt
_GENERATION_ONLY = ("max_tokens", "stop_sequences", "stream", "temperature", "top_p", "top_k", *IGNORED_GENERATING)
_CITATIONS = Refused("citations point into documents, which are not implemented", ([],))
BLOCK_FIELDS = {"text": ("text",), "tool_use": ("id", "name", "input"),
                "tool_result": ("tool_use_id", "content", "is_error")}
BLOCK_IGNORED = {"cache_control": CACHE_CONTROL}
BLOCK_REFUSED = {"citations": _CITATIONS}
TOOL_IGNORED = {"cache_control": CACHE_CONTROL}
TOOL_REFUSED = {"strict": Refused("strict tool use is not implemented (tool choice any or tool constrains a call's "
                                  "input to its schema without it)", (False,))}


def check(body: Conversation) -> None:
    """Raises EngineError(INVALID_ARGUMENT) naming the first field that is unknown, or known but not implemented
    and set to something other than its neutral value: at the top, in tools and tool_choice, and in every
    message's and the system's blocks (of their own types: messages_api refuses other types)."""
    generating = isinstance(body, MessagesRequest)
    ignored = {**IGNORED, **IGNORED_GENERATING} if generating else IGNORED
    for name, value in (body.model_extra or {}).items():
        if name in REFUSED:
            _refuse_unless_neutral(name, name, REFUSED[name], value)
        elif name not in ignored:
            if not generating and name in _GENERATION_ONLY:
                raise invalid(name, f"{name}: not a field of count_tokens, which counts the prompt only")
            known = ", ".join(sorted({*type(body).model_fields, *ignored, *REFUSED}))
            raise invalid(name[:80], f"{name[:80]}: unknown field (known: {known})")
    for i, tool in enumerate(body.tools or ()):
        _check_extra("tools", f"tools[{i}]", tool, TOOL_REFUSED, TOOL_IGNORED)
    if body.tool_choice is not None:
        _check_extra("tool_choice", "tool_choice", body.tool_choice, {}, {})
    if isinstance(body.system, list):
        for j, block in enumerate(body.system):
            check_block("system", f"system[{j}]", block)
    for i, m in enumerate(body.messages):
        _check_extra("messages", f"messages[{i}]", m, {}, {})
        for j, block in enumerate(m.content if isinstance(m.content, list) else ()):
            check_block("messages", f"messages[{i}].content[{j}]", block)


def check_block(param: str, where: str, block: Block) -> None:
    """A block of a type taken here (text, tool_use, tool_result) has only its type's fields (a tool_result's text
    blocks included). Blocks of other types pass: messages_api refuses them naming the type."""
    own = BLOCK_FIELDS.get(block.type)
    if own is None:
        return
    declared = set(type(block).model_fields) - {"type"}
    for name in sorted((declared & block.model_fields_set) - set(own)):
        raise invalid(param, f"{where}.{name}: not a field of a {block.type} block")
    _check_extra(param, where, block, BLOCK_REFUSED, BLOCK_IGNORED)
    if block.type == "tool_result" and isinstance(block.content, list):
        for k, part in enumerate(block.content):
            check_block(param, f"{where}.content[{k}]", part)


def _check_extra(param: str, where: str, model: BaseModel, refused: dict[str, Refused],
                 ignored: dict[str, Ignored]) -> None:
    for name, value in (model.model_extra or {}).items():
        path = f"{where}.{name[:80]}"
        if name in refused:
            _refuse_unless_neutral(param, path, refused[name], value)
        elif name not in ignored:
            raise invalid(param, f"{path}: unknown field")


def _refuse_unless_neutral(param: str, where: str, rule: Refused, value) -> None:
    if not rule.accepts(value):
        raise invalid(param, f"{where} is not supported: {rule.reason} (accepted: {rule.accepted_text()})")
