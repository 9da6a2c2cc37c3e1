"""Anthropic's Messages API: POST /v1/messages (streamed or not) and POST /v1/messages/count_tokens.

A request is translated into the chat request it means (tool_use blocks as an assistant's tool_calls, tool_result
blocks as "tool" messages) and served by the chat machinery (convert.chat_job, serving.serve): the same prompt, the
same tool plans, tenants, limits and disconnects. Only the shapes are Anthropic's: content blocks, stop reasons,
events, errors."""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from functools import partial

from fastapi import Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ValidationError

from scheduler_svc import json_text
from scheduler_svc.core.request import FinishReason
from scheduler_svc.errors import EngineError
from scheduler_svc.frontend import FrontEnd
from scheduler_svc.frontend.api import invalid
from scheduler_svc.http import convert, messages_schemas, tools
from scheduler_svc.http.convert import Job
from scheduler_svc.http.error_shapes import ANTHROPIC_PATH, anthropic_error_body
from scheduler_svc.http.messages_schemas import Block, Conversation, CountTokensRequest, MessagesRequest
from scheduler_svc.http.schemas import ChatCompletionRequest
from scheduler_svc.http.serving import Dialect, Serving, items, named_event

PATH = ANTHROPIC_PATH
# NOTE: the chat route's finish reasons (after the tool shaper) in Anthropic's words; abort (the scheduler's Abort)
# has none: its stop_reason is null
STOP_REASONS = {"stop": "end_turn", "length": "max_tokens", "tool_calls": "tool_use"}
_TOOL_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
_NOT_TEXT = "is not implemented: the model reads text only (text, tool_use and tool_result blocks)"
BLOCK_REFUSALS = {"image": f"an image {_NOT_TEXT}", "document": f"a document {_NOT_TEXT}",
                  "search_result": f"a search result {_NOT_TEXT}",
                  "thinking": "extended thinking is not implemented (an earlier turn's thinking cannot be rendered)",
                  "redacted_thinking": "extended thinking is not implemented"}


# -- errors (their shape: error_shapes) -----------------------------------------------------------------------
def engine_error(e: EngineError, params: dict[str, str]) -> tuple[int, dict]:
    """Dialect.error: (HTTP status, body). NOTE: Anthropic's errors name no field: the message does, in this API's
    words where the chat request's differ (stop: the front end's bounds on stop strings)."""
    status, message = convert.HTTP_STATUS.get(e.code, 500), str(e)
    if e.field == "stop" and message.startswith("stop"):
        message = "stop_sequences" + message[len("stop"):]
    return status, anthropic_error_body(status, message)


def _event(data: dict) -> str:
    """Dialect.event: every event's name is its data's type (an error mid-stream too: `event: error`)."""
    return named_event((data["type"], data))


# -- the request, as a chat request -------------------------------------------------------------------------
def _text_of(param: str, where: str, blocks: str | list[Block] | None) -> str:
    """A string, or text blocks joined (as the chat route joins text parts: with nothing between)."""
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    for j, b in enumerate(blocks):
        _refuse_type(param, f"{where}[{j}]", b, ("text",))
    return "".join(b.text for b in blocks)


def _refuse_type(param: str, where: str, block: Block, allowed: tuple[str, ...]) -> None:
    if block.type not in allowed:
        why = BLOCK_REFUSALS.get(block.type) or f"only {' and '.join(allowed)} blocks are taken here"
        raise invalid(param, f"{where}: a block of type {block.type[:80]!r} is not supported: {why}")
    if block.type == "text" and block.text is None:
        raise invalid(param, f"{where}.text is required")


def _user(i: int, content: str | list[Block]) -> list[dict]:
    """A user message: each run of text blocks one user message, each tool_result a tool message (in order)."""
    if isinstance(content, str):
        return [{"role": "user", "content": content}]
    out: list[dict] = []
    for j, b in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        _refuse_type("messages", where, b, ("text", "tool_result"))
        if b.type == "text":
            if out and out[-1]["role"] == "user":
                out[-1]["content"] += b.text
            else:
                out.append({"role": "user", "content": b.text})
            continue
        if not b.tool_use_id:
            raise invalid("messages", f"{where}.tool_use_id is required (the id of the tool_use it answers)")
        result = {"role": "tool", "tool_call_id": b.tool_use_id,
                  "content": _text_of("messages", f"{where}.content", b.content)}
        if b.is_error is not None:  # NOTE: reaches the chat template as it is (as the chat route's message fields)
            result["is_error"] = b.is_error
        out.append(result)
    return out


def _assistant(i: int, content: str | list[Block]) -> dict:
    """An assistant message: text blocks joined, tool_use blocks as tool_calls (history renders them)."""
    if isinstance(content, str):
        return {"role": "assistant", "content": content}
    texts, calls = [], []
    for j, b in enumerate(content):
        where = f"messages[{i}].content[{j}]"
        _refuse_type("messages", where, b, ("text", "tool_use"))
        if b.type == "text":
            texts.append(b.text)
        elif not b.id or not b.name:
            raise invalid("messages", f"{where}: a tool_use block needs its id and name")
        else:
            calls.append({"id": b.id, "type": "function",
                          "function": {"name": b.name, "arguments": json.dumps(b.input or {}, ensure_ascii=False)}})
    message = {"role": "assistant", "content": "".join(texts) if texts or not calls else None}
    return {**message, "tool_calls": calls} if calls else message


def chat_messages(body: Conversation) -> list[dict]:
    out = [{"role": "system", "content": _text_of("system", "system", body.system)}] if body.system else []
    for i, m in enumerate(body.messages):
        if not m.content and isinstance(m.content, list):
            raise invalid("messages", f"messages[{i}].content is empty: give a string or at least one block")
        out += _user(i, m.content) if m.role == "user" else [_assistant(i, m.content)]
    return out


def chat_tools(body: Conversation, tool_call_parser: str, counting: bool) -> dict:
    """The chat request's tools, tool_choice and parallel_tool_calls. `counting` (count_tokens): the prompt only,
    which every tool choice renders the same (the tools reach the template), so none needs a tool-call parser."""
    choice = body.tool_choice
    if not body.tools:
        if body.tools is not None:
            raise invalid("tools", "tools is empty: give at least one tool, or leave tools out")
        if choice is not None and choice.type != "none":
            raise invalid("tool_choice", f"tool_choice {choice.type!r} needs tools")
        return {}
    names = _tool_names(body.tools)
    out: dict = {"tools": [{"type": "function", "function": {"name": name, "description": t.description or "",
                                                             "parameters": t.input_schema}}
                           for name, t in zip(names, body.tools)]}
    kind = "auto" if choice is None else choice.type  # NOTE: Anthropic's default with tools
    if kind == "tool" and choice.name not in names:
        raise invalid("tool_choice", f"tool_choice names the tool {str(choice.name)[:80]!r}, which is not among "
                                     f"tools ({', '.join(names)})")
    if kind == "auto" and tool_call_parser == "none" and not counting:
        raise invalid("tool_choice", "tool_choice auto (the default with tools) needs the model's tool-call "
                                     "format: start the scheduler with --tool-call-parser (hermes or llama3_json), "
                                     "or send tool_choice {\"type\": \"any\"}, {\"type\": \"tool\", \"name\": ...} "
                                     "or {\"type\": \"none\"}")
    named = {"type": "function", "function": {"name": choice.name}} if kind == "tool" else None
    out["tool_choice"] = "none" if counting else named or {"auto": "auto", "any": "required"}.get(kind, "none")
    if choice is not None and choice.disable_parallel_tool_use is not None:
        out["parallel_tool_calls"] = not choice.disable_parallel_tool_use
    return out


def _tool_names(tool_list: list) -> list[str]:
    names: list[str] = []
    for i, tool in enumerate(tool_list):
        where = f"tools[{i}]"
        if len(names) == tools.MAX_TOOLS:
            raise invalid("tools", f"tools has {len(tool_list)} tools; the limit is {tools.MAX_TOOLS}")
        if tool.type not in (None, "custom"):
            raise invalid("tools", f"{where}: the server tool {tool.type[:80]!r} is not implemented (Anthropic runs "
                                   "those): give a client tool (name, description, input_schema)")
        if tool.name is None or not _TOOL_NAME.fullmatch(tool.name):
            raise invalid("tools", f"{where}.name must be 1 to 64 letters, digits, _ or -, got {tool.name!r:.80}")
        if tool.input_schema is None or tool.input_schema.get("type", "object") != "object":
            raise invalid("tools", f"{where}.input_schema must be a JSON schema of an object (the tool's input)")
        if tool.name in names:
            raise invalid("tools", f"{where}.name: {tool.name!r} is the name of an earlier tool too")
        names.append(tool.name)
    return names


def prefilled(body: Conversation) -> bool:
    """Whether the conversation ends with an assistant's message, whose text the answer continues (Anthropic's
    prefill). NOTE: a prefill of tool_use blocks is refused: a call is whole or absent, never continued."""
    last = body.messages[-1]
    if last.role != "assistant":
        return False
    if not isinstance(last.content, str) and any(b.type != "text" for b in last.content):
        raise invalid("messages", f"messages[{len(body.messages) - 1}]: a last assistant message (a prefill) "
                                  "continues its text: it holds text blocks only")
    return True


def chat_request(body: Conversation, tool_call_parser: str) -> ChatCompletionRequest:
    """The chat request `body` means (a CountTokensRequest: its prompt only)."""
    counting = not isinstance(body, MessagesRequest)
    fields = {"model": body.model, "messages": chat_messages(body), **chat_tools(body, tool_call_parser, counting)}
    if prefilled(body):  # the answer continues the last assistant message, as Anthropic's does (a prefill)
        fields.update(add_generation_prompt=False, continue_final_message=True)
    if not counting:
        # NOTE: the stop string stays in the text, so that the events can say which one it was (they cut it off)
        fields.update(max_tokens=body.max_tokens, temperature=body.temperature, top_p=body.top_p, top_k=body.top_k,
                      stop=body.stop_sequences, stream=body.stream, include_stop_str_in_output=True)
    return ChatCompletionRequest(**fields)


def make_job(body: Conversation, request_id: str, frontend: FrontEnd, tool_call_parser: str) -> Job:
    """serving.serve's make_job: the chat route's Job of the translated request."""
    return convert.chat_job(chat_request(body, tool_call_parser), request_id, frontend, tool_call_parser)


# -- the answer, as Anthropic's events -----------------------------------------------------------------------
@dataclass(slots=True)
class Blocks:
    """One answer's content blocks as Anthropic's events, from the tool shaper's deltas (the chat route's content
    and tool_calls): a text block for each run of text, a tool_use block for each call, its input streamed as JSON
    text (input_json_delta)."""

    count: int = 0
    open_type: str | None = None

    def push(self, delta: dict) -> list[dict]:
        events = []
        if delta.get("content"):
            if self.open_type != "text":
                events += self._start({"type": "text", "text": ""})
            events.append(self._delta({"type": "text_delta", "text": delta["content"]}))
        for call in delta.get("tool_calls", ()):
            fn = call["function"]
            if "id" in call:  # the first delta of a call names it
                events += self._start({"type": "tool_use", "id": "toolu_" + call["id"].removeprefix("call_"),
                                       "name": fn["name"], "input": {}})
            if fn["arguments"]:
                events.append(self._delta({"type": "input_json_delta", "partial_json": fn["arguments"]}))
        return events

    def close(self) -> list[dict]:
        if self.open_type is None:
            return []
        self.open_type = None
        return [{"type": "content_block_stop", "index": self.count - 1}]

    def _start(self, block: dict) -> list[dict]:
        events = self.close()
        self.count, self.open_type = self.count + 1, block["type"]
        return [*events, {"type": "content_block_start", "index": self.count - 1, "content_block": block}]

    def _delta(self, delta: dict) -> dict:
        return {"type": "content_block_delta", "index": self.count - 1, "delta": delta}


def _cut_stop(item, stops: tuple[str, ...]) -> tuple[str, str | None]:
    """(the item's text without the stop sequence that ended it, that stop sequence or None). NOTE: with
    include_stop_str_in_output the last item's text ends with the whole stop string (the front end holds back
    what may begin one); when several end it, the longest is the one the front end matched (it starts first)."""
    if item.finish_reason != FinishReason.STOP_STRING:
        return item.text, None
    matched = max((s for s in stops if s and item.text.endswith(s)), key=len, default=None)
    return (item.text[:len(item.text) - len(matched)], matched) if matched else (item.text, None)


def _usage(input_tokens: int, cached: int, output_tokens: int) -> dict:
    """NOTE: Anthropic's input_tokens leaves out the cached ones (cache_read_input_tokens): the prompt is their
    sum (and count_tokens'). Nothing is written to a cache on request here: cache_creation_input_tokens is 0."""
    return {"input_tokens": input_tokens - cached, "output_tokens": output_tokens,
            "cache_creation_input_tokens": 0, "cache_read_input_tokens": cached}


async def events(job: Job, streams, rid: str, meta: dict, body=None):
    """serving.serve's events: one prompt and one sample (Anthropic has no n), as Anthropic's event stream."""
    stops = job.inputs[0].stop
    yield {"type": "message_start", "message": {
        "id": f"msg_{rid}", "type": "message", "role": "assistant", "model": meta["model"], "content": [],
        "stop_reason": None, "stop_sequence": None,
        "usage": _usage(len(streams[0].request.prompt_token_ids), 0, 0)}}
    yield {"type": "ping"}  # NOTE: as Anthropic's streams do, early: before the first token, which may queue
    blocks, shaper, end = Blocks(), job.shaper(), {}
    async for _, item in items(streams):
        text, stop_sequence = _cut_stop(item, stops)
        deltas, reason = shaper.push(text, convert.finish_reason(item))
        for delta in deltas:
            for event in blocks.push(delta):
                yield event
        if reason is not None:
            stop_reason = "stop_sequence" if reason == "stop" and stop_sequence else STOP_REASONS.get(reason)
            end = {"type": "message_delta", "delta": {
                "stop_reason": stop_reason, "stop_sequence": stop_sequence if stop_reason == "stop_sequence" else None},
                "usage": _usage(item.prompt_tokens, item.cached_prompt_tokens, item.completion_tokens)}
    for event in blocks.close():
        yield event
    yield end
    yield {"type": "message_stop"}


async def collect(job: Job, streams, rid: str, meta: dict) -> dict:
    """serving.serve's collect: the events folded into the whole message (as the SDK folds a stream), so that
    the two never differ."""
    message, inputs = {}, {}
    async for event in events(job, streams, rid, meta):
        kind = event["type"]
        if kind == "message_start":
            message = event["message"]
        elif kind == "content_block_start":
            message["content"].append(dict(event["content_block"]))
        elif kind == "content_block_delta":
            delta, at = event["delta"], event["index"]
            if delta["type"] == "text_delta":
                message["content"][at]["text"] += delta["text"]
            else:
                inputs[at] = inputs.get(at, "") + delta["partial_json"]
        elif kind == "content_block_stop" and event["index"] in inputs:
            message["content"][event["index"]]["input"] = _input(inputs[event["index"]])
        elif kind == "message_delta":
            message.update(event["delta"], usage=event["usage"])
    return message


def _input(text: str) -> dict:
    """A tool_use block's input from its JSON text. NOTE: a named tool's arguments cut off by max_tokens are no
    JSON (stop_reason max_tokens): {} here; the stream's events carry what there was."""
    try:
        value = json_text.loads(text)
    except ValueError:  # NOTE: json_text.TooDeep among them
        return {}
    return value if isinstance(value, dict) else {}


# -- the routes --------------------------------------------------------------------------------------------
def _check(frontend: FrontEnd, body: Conversation) -> None:
    messages_schemas.check(body)
    convert.check_model(frontend, body.model)


def _validation_error(e: ValidationError) -> EngineError:
    """The first thing pydantic found wrong, as app.py's handler says it (that one speaks OpenAI's shape)."""
    first = e.errors()[0] if e.errors() else {}
    if first.get("type") == "json_invalid":
        return invalid("body", f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}")
    loc = [str(x) for x in first.get("loc", ())]
    return invalid(loc[0] if loc else "body", f"{'.'.join(loc) or 'body'}: {first.get('msg', 'invalid value')}")


def add_routes(app, serving: Serving) -> None:
    """Registers this API's routes on `app` (scheduler_svc.http.app.create_app), using `serving`."""
    frontend = serving.frontend
    dialect = Dialect(check=partial(_check, frontend), error=engine_error, event=_event, done="")
    job_of = partial(make_job, tool_call_parser=serving.tool_call_parser)

    async def parse(request: Request, model: type[BaseModel]) -> BaseModel | Response:
        """NOTE: parsed here, not by FastAPI: its validation errors would be answered in OpenAI's shape."""
        try:
            return model.model_validate_json(await request.body())
        except ValidationError as e:
            return serving.error_response(dialect, _validation_error(e), {}, "")

    @app.post(PATH)
    async def messages(request: Request) -> Response:
        body = await parse(request, MessagesRequest)
        if isinstance(body, Response):
            return body
        return await serving.serve(request, body, dialect, job_of, events, collect)

    @app.post(PATH + "/count_tokens")
    async def count_tokens(request: Request) -> Response:
        body = await parse(request, CountTokensRequest)
        if isinstance(body, Response):
            return body
        rid = uuid.uuid4().hex
        try:
            convert.check_text(body)
            dialect.check(body)
            _, ids = await frontend.prompt_token_ids(job_of(body, rid, frontend).inputs[0])
        except EngineError as e:
            return serving.error_response(dialect, e, {}, rid)
        return JSONResponse({"input_tokens": len(ids)})
