"""A Responses API request as the chat request it means: its input items as chat messages (instructions first),
its tools, tool_choice and text.format in chat's shapes. The chat machinery (convert.chat_job, tools, structured)
then does the rest, so that both routes give the same answer to the same conversation. Errors name the Responses
API's fields."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from scheduler_svc.frontend.api import invalid
from scheduler_svc.http.responses_schemas import STATELESS, VLLM_EXTENSIONS, ResponsesRequest
from scheduler_svc.http.schemas import ChatCompletionRequest

ROLES = ("user", "assistant", "system", "developer")
TEXT_PARTS = {"input_text": "text", "output_text": "text", "refusal": "refusal"}  # part type -> its text's key
# Keys of input items that say where an item came from (an earlier response's output sent back), not what the
# model reads: accepted whatever their value.
_ITEM_KEYS = {"message": {"type", "role", "content", "id", "status", "phase"},
              "function_call": {"type", "call_id", "name", "arguments", "id", "status"},
              "function_call_output": {"type", "call_id", "output", "id", "status", "name"}}
_PART_KEYS = {"type", "text", "refusal", "annotations", "logprobs"}  # annotations, logprobs: of an output_text
_TOOL_KEYS = {"type", "name", "description", "parameters", "strict"}
_FORMAT_KEYS = {"type", "name", "schema", "strict", "description"}  # description: OpenAI's hint to its model only


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """Raises EngineError(INVALID_ARGUMENT) naming the Responses field at fault."""
    fields = {"model": body.model, "messages": messages(body), "max_completion_tokens": body.max_output_tokens,
              "temperature": body.temperature, "top_p": body.top_p, "tools": chat_tools(body.tools),
              "tool_choice": chat_tool_choice(body.tool_choice),
              # NOTE: without tools it asks for nothing (OpenAI takes it so; chat refuses it)
              "parallel_tool_calls": None if body.tools is None else body.parallel_tool_calls,
              "response_format": response_format(body.text),
              **{name: getattr(body, name) for name in VLLM_EXTENSIONS}}
    try:
        return ChatCompletionRequest(**fields)
    except ValidationError as e:  # NOTE: checked above, so a bug's trace more than a client's mistake
        raise invalid("input", f"input: {e.errors()[0].get('msg', 'invalid')}") from None


# -- input -----------------------------------------------------------------------------------------------------------
def messages(body: ResponsesRequest) -> list[dict]:
    """The chat messages of instructions and input. Function calls join the assistant message before them (one
    message with content and tool_calls, as chat has it); a function call's output is a tool message."""
    if body.input is None:
        raise invalid("input", f"input is required: {STATELESS}")
    items = [{"role": "user", "content": body.input}] if isinstance(body.input, str) else body.input
    if not items:
        raise invalid("input", "input is empty")
    out = [{"role": "system", "content": body.instructions}] if body.instructions is not None else []
    for i, item in enumerate(items):
        kind = item.get("type", "message")  # NOTE: an easy input message may leave its type out
        where = f"input[{i}]"
        if kind not in _ITEM_KEYS:
            raise invalid("input", _unsupported_item(where, kind))
        _known_keys(where, item, _ITEM_KEYS[kind])
        if kind == "message":
            out.append({"role": _role(where, item.get("role")), "content": _content(where, item.get("content"))})
        elif kind == "function_call":
            call = _call(where, item)
            if out and out[-1]["role"] == "assistant":
                out[-1].setdefault("tool_calls", []).append(call)
            else:
                out.append({"role": "assistant", "content": None, "tool_calls": [call]})
        else:
            out.append(_call_output(where, item))
    return out


def _unsupported_item(where: str, kind) -> str:
    if kind == "item_reference":
        return f"{where}: an item_reference names a stored item; {STATELESS}"
    return (f"{where}.type {str(kind)[:80]!r} is not supported: input items are messages, function_call and "
            "function_call_output (built-in tools and reasoning are not implemented)")


def _known_keys(where: str, obj: dict, known: set[str]) -> None:
    """Refuses a key not in `known` unless it is null (a client may echo an output item's unset fields)."""
    extra = sorted(k for k, v in obj.items() if k not in known and v is not None)
    if extra:
        raise invalid("input", f"{where}.{extra[0][:80]}: unknown field (known: {', '.join(sorted(known))})")


def _role(where: str, role) -> str:
    # NOTE: developer reaches the chat template as it does on /v1/chat/completions
    if role not in ROLES:
        raise invalid("input", f"{where}.role must be one of {', '.join(ROLES)}, got {str(role)[:40]!r}")
    return role


def _content(where: str, content) -> str:
    """A message's content as its text: a string, or its text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise invalid("input", f"{where}.content must be a string or a list of parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in TEXT_PARTS:
            raise invalid("input", f"{where}.content[{j}]: only text parts ({', '.join(TEXT_PARTS)}) are supported, "
                                   f"got type {str(kind)[:40]!r}")
        _known_keys(f"{where}.content[{j}]", part, _PART_KEYS)
        text = part.get(TEXT_PARTS[kind])
        if not isinstance(text, str):
            raise invalid("input", f"{where}.content[{j}].{TEXT_PARTS[kind]} must be a string")
        texts.append(text)
    return "".join(texts)


def _call(where: str, item: dict) -> dict:
    """A function_call item as a chat tool call (its call_id is the call's id)."""
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str):
            raise invalid("input", f"{where}.{key} must be a string")
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}


def _call_output(where: str, item: dict) -> dict:
    if not isinstance(item.get("call_id"), str):
        raise invalid("input", f"{where}.call_id must be a string")
    output = item.get("output")
    content = output if isinstance(output, str) else _content(f"{where}.output", output)
    message = {"role": "tool", "tool_call_id": item["call_id"], "content": content}
    if item.get("name") is not None:
        message["name"] = item["name"]
    return message


# -- tools, tool_choice, text ----------------------------------------------------------------------------------------
def chat_tools(tools: list[dict] | None) -> list[dict] | None:
    """Responses' flat function tools ({type, name, ...}) as chat's ({type, function: {name, ...}})."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function":
            raise invalid("tools", f"tools[{i}].type {str(tool.get('type'))[:80]!r} is not supported: only function "
                                   "tools are (built-in tools such as web_search, file_search and code_interpreter "
                                   "are not implemented)")
        extra = sorted(k for k, v in tool.items() if k not in _TOOL_KEYS and v is not None)
        if extra:
            known = ", ".join(sorted(_TOOL_KEYS))
            raise invalid("tools", f"tools[{i}].{extra[0][:80]}: not supported (known: {known})")
        out.append({"type": "function", "function": {k: v for k, v in tool.items()
                                                     if k in _TOOL_KEYS - {"type"} and v is not None}})
    return out


def chat_tool_choice(choice: str | dict | None) -> str | dict | None:
    """none, auto and required as they are; {type: function, name} as chat's {type: function, function: {name}}."""
    if not isinstance(choice, dict):
        return choice
    if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
        raise invalid("tool_choice", "tool_choice must be none, auto, required or {\"type\": \"function\", \"name\": "
                                     f"...}}, got {str(choice)[:80]} (built-in and allowed_tools choices are not "
                                     "implemented)")
    return {"type": "function", "function": {"name": choice["name"]}}


def response_format(text: dict[str, Any] | None) -> dict | None:
    """text.format as chat's response_format (structured output); None for plain text."""
    if text is None:
        return None
    extra = sorted(k for k, v in text.items() if k not in ("format", "verbosity") and v is not None)
    if extra:
        raise invalid("text", f"text.{extra[0][:80]}: unknown field (known: format, verbosity)")
    if text.get("verbosity") not in (None, "medium"):  # NOTE: medium is the default: it asks for nothing
        raise invalid("text", "text.verbosity is not supported: verbosity control is not implemented (accepted: "
                              "null, \"medium\")")
    fmt = text.get("format")
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in ("text", "json_object"):
        return None if kind == "text" else {"type": "json_object"}
    if kind != "json_schema":
        raise invalid("text", f"text.format.type must be text, json_schema or json_object, got {str(kind)[:40]!r}")
    extra = sorted(k for k, v in fmt.items() if k not in _FORMAT_KEYS and v is not None)
    if extra:
        raise invalid("text", f"text.format.{extra[0][:80]}: unknown field (known: {', '.join(sorted(_FORMAT_KEYS))})")
    if not isinstance(fmt.get("name"), str):
        raise invalid("text", "text.format.name must be a string")
    if not isinstance(fmt.get("schema"), dict):
        raise invalid("text", "text.format.schema must be a JSON schema (an object)")
    if not isinstance(fmt.get("strict", False), bool | None):
        raise invalid("text", "text.format.strict must be a boolean")
    # NOTE: strict or not, the output matches the schema (the mask enforces it)
    return {"type": "json_schema", "json_schema": {"name": fmt["name"], "schema": fmt["schema"]}}
