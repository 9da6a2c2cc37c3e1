"""Chat messages as the chat template reads them: text parts joined, tool calls' arguments as objects."""

from __future__ import annotations

import json

from scheduler_svc import json_text
from scheduler_svc.frontend.api import invalid
from scheduler_svc.frontend.tool_parsers import HermesParser


def template_messages(messages: list, template: str | None) -> list[dict]:
    """The request's messages (schemas.ChatMessage) as dicts for `template` (the model's chat template source).
    NOTE: content stays in every message, None included (templates test `message.content is none`, and one
    missing reads as undefined). A template that never reads tool_calls would drop them (or fail on a None
    content): there, each message's calls are written into its text as Hermes `<tool_call>` blocks and None
    content is "", so the model still sees what it called."""
    knows_tool_calls = bool(template) and "tool_calls" in template
    out = []
    for i, m in enumerate(messages):
        msg = m.model_dump(exclude_none=True)
        msg["content"] = _text(i, m.content)
        if "tool_calls" in msg:
            msg["tool_calls"] = _tool_calls(i, msg["tool_calls"])
            if not knows_tool_calls:
                msg["content"] = (msg["content"] or "") + "".join(_as_text(c) for c in msg["tool_calls"])
        if msg["content"] is None and not knows_tool_calls:
            msg["content"] = ""
        out.append(msg)
    return out


def _text(i: int, content) -> str | None:
    if not isinstance(content, list):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type != "text" or part.text is None:
            raise invalid("messages", f"messages[{i}].content[{j}]: only text parts are supported, got "
                                      f"type {part.type!r}")
        texts.append(part.text)
    return "".join(texts)


def _tool_calls(i: int, calls) -> list[dict]:
    """OpenAI's tool_calls of an assistant message, with each call's arguments (a JSON string) parsed into the
    object chat templates expect (`arguments | tojson`, `arguments.items()`); arguments that are no JSON object
    stay as given."""
    if not isinstance(calls, list):
        raise invalid("messages", f"messages[{i}].tool_calls must be a list")
    out = []
    for j, call in enumerate(calls):
        fn = call.get("function") if isinstance(call, dict) else None
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
            raise invalid("messages", f"messages[{i}].tool_calls[{j}] must be {{\"id\": ..., \"type\": \"function\", "
                                      f"\"function\": {{\"name\": ..., \"arguments\": ...}}}}")
        args = fn.get("arguments", {})
        if isinstance(args, str):
            try:
                parsed = json_text.loads(args)
            except json_text.TooDeep as e:
                raise invalid("messages", f"messages[{i}].tool_calls[{j}].function.arguments: {e}") from None
            except ValueError:
                parsed = None
            args = parsed if isinstance(parsed, dict) else args
        out.append({**call, "type": call.get("type", "function"), "function": {**fn, "arguments": args}})
    return out


def _as_text(call: dict) -> str:
    fn = call["function"]
    body = json.dumps({"name": fn["name"], "arguments": fn["arguments"]}, ensure_ascii=False)
    return f"{HermesParser.OPEN}\n{body}\n{HermesParser.CLOSE}"
