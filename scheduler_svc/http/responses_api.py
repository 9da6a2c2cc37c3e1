"""OpenAI's Responses API, stateless: POST /v1/responses. A request is translated into the chat request it means
(responses_input) and served by the chat machinery through Serving (tenants, limits, disconnects, blocks freed);
the answer, shaped by the same Shaper as chat's (content, tool calls), comes back as Responses output items: a
`message` with `output_text`, `function_call`s. Streamed, it is the Responses event stream (`event: TYPE`, each
numbered by `sequence_number`)."""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from functools import partial

from fastapi import Request
from fastapi.responses import Response

from pagedserve_common.sampling import SamplingParams
from scheduler_svc.errors import EngineError
from scheduler_svc.frontend import FrontEnd
from scheduler_svc.http import convert, responses_schemas
from scheduler_svc.http.convert import Job, UsageCount
from scheduler_svc.http.responses_input import chat_request
from scheduler_svc.http.responses_schemas import ResponsesRequest
from scheduler_svc.http.serving import Dialect, Serving, gather_all, items, named_event

# a choice's finish reason (convert.finish_reason, Shaper.reason) -> the response's status
STATUS = {"stop": "completed", "tool_calls": "completed", "length": "incomplete", "abort": "failed"}
LAST_EVENT = {"completed": "response.completed", "incomplete": "response.incomplete", "failed": "response.failed"}
# NOTE: abort: the scheduler dropped the request before its end (no client of this route sees it otherwise)
ABORTED = {"code": "server_error", "message": "the request was aborted before it finished"}
# the chat request's field names -> the Responses API's, so that an error names the field the client sent
RENAMED = {"messages": "input", "prompt": "input", "response_format": "text",
           "max_completion_tokens": "max_output_tokens", "max_tokens": "max_output_tokens"}


def add_routes(app, serving: Serving) -> None:
    """Registers POST /v1/responses on `app` (scheduler_svc.http.app.create_app), using `serving`."""
    # NOTE: done "": the Responses stream ends with its last event, not with `data: [DONE]`; events() says its own
    # errors (an `error` event numbered in the stream's order), so Dialect.stream_error is not reached
    dialect = Dialect(check=partial(_check, serving.frontend), error=convert.engine_error, event=named_event,
                      done="")
    make_job = partial(_job, tool_call_parser=serving.tool_call_parser)

    @app.post("/v1/responses")
    async def responses(body: ResponsesRequest, request: Request) -> Response:
        return await serving.serve(request, body, dialect, make_job, events, partial(collect, body))


def _check(frontend: FrontEnd, body: ResponsesRequest) -> None:
    responses_schemas.check(body)
    convert.check_model(frontend, body.model)


def _job(body: ResponsesRequest, request_id: str, frontend: FrontEnd, tool_call_parser: str) -> Job:
    """The chat job of the request, its errors naming the Responses API's fields."""
    try:
        job = convert.chat_job(chat_request(body), request_id, frontend, tool_call_parser)
    except EngineError as e:
        e.field = RENAMED.get(e.field, e.field)
        raise
    job.params = {"messages": "input", **{k: RENAMED.get(v, v) for k, v in job.params.items()}}
    return job


# -- the response ----------------------------------------------------------------------------------------------------
def settings(body: ResponsesRequest) -> dict:
    """What a response repeats of its request (the openai client's Response requires tools, tool_choice and
    parallel_tool_calls), the defaults written out."""
    default, extra = SamplingParams(), body.model_extra or {}
    text = dict(body.text or {})
    if text.get("format") is None:
        text["format"] = {"type": "text"}
    return {"instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": default.temperature if body.temperature is None else body.temperature,
            "top_p": default.top_p if body.top_p is None else body.top_p,
            "tools": body.tools or [], "tool_choice": body.tool_choice or "auto",
            "parallel_tool_calls": body.parallel_tool_calls is not False, "text": text,
            "metadata": extra.get("metadata") or {}, "user": extra.get("user"), "previous_response_id": None,
            "reasoning": {"effort": None, "summary": None}, "store": False, "background": False,
            "truncation": "disabled"}


def usage_json(usage: UsageCount) -> dict:
    return {"input_tokens": usage.prompt_tokens, "input_tokens_details": {"cached_tokens": usage.cached_tokens},
            "output_tokens": usage.completion_tokens, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": usage.prompt_tokens + usage.completion_tokens}


@dataclass(slots=True)
class Head:
    """What every snapshot of one response repeats: its id, creation time, model and the request's settings."""

    id: str
    created_at: int
    model: str
    settings: dict

    @classmethod
    def of(cls, body: ResponsesRequest, request_id: str, meta: dict) -> Head:
        return cls(f"resp_{request_id}", meta["created"], meta["model"], settings(body))

    def snapshot(self, status: str, output: list[dict], usage: UsageCount | None = None) -> dict:
        return {"id": self.id, "object": "response", "created_at": self.created_at, "status": status,
                "error": ABORTED if status == "failed" else None,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "model": self.model, "output": output, "usage": None if usage is None else usage_json(usage),
                **self.settings}


@dataclass(slots=True)
class Item:
    """The output item being built: a message's text, or a function call's arguments, so far."""

    kind: str  # "message" or "function_call"
    id: str
    text: str = ""  # the message's text, or the call's arguments
    call_id: str = ""
    name: str = ""

    def part(self) -> dict:
        return {"type": "output_text", "text": self.text, "annotations": []}

    def to_json(self, status: str) -> dict:
        if self.kind == "message":
            return {"type": "message", "id": self.id, "status": status, "role": "assistant",
                    "content": [] if status == "in_progress" else [self.part()]}
        return {"type": "function_call", "id": self.id, "call_id": self.call_id, "name": self.name,
                "arguments": self.text, "status": status}


@dataclass(slots=True)
class Output:
    """One response's output items, built from its Shaper's deltas ({"content"}, {"tool_calls"}); each step returns
    the events that say it, (type, data) pairs numbered in order. The same for a stream and a whole answer, so
    that both have the same items."""

    items: list[dict] = field(default_factory=list)  # the items done
    current: Item | None = None  # the item being built; its output_index is len(items)
    sequence_number: int = 0

    def event(self, kind: str, **data) -> tuple[str, dict]:
        self.sequence_number += 1
        return kind, {"type": kind, "sequence_number": self.sequence_number - 1, **data}

    def push(self, deltas: list[dict]) -> list[tuple[str, dict]]:
        events = []
        for delta in deltas:
            if delta.get("content"):
                if self.current is None or self.current.kind != "message":
                    events += self._open(Item("message", f"msg_{uuid.uuid4().hex}"))
                events.append(self._grow("response.output_text.delta", delta["content"], content_index=0,
                                         logprobs=[]))
            for call in delta.get("tool_calls", ()):
                if "id" in call:  # a call's first delta (Shaper's): its id and name
                    events += self._open(Item("function_call", f"fc_{uuid.uuid4().hex}", call_id=call["id"],
                                              name=call["function"]["name"]))
                if call["function"]["arguments"]:
                    events.append(self._grow("response.function_call_arguments.delta",
                                             call["function"]["arguments"]))
        return events

    def finish(self, status: str) -> list[tuple[str, dict]]:
        """Closes the last item; an answer with no item at all is an empty message (its text "")."""
        events = [] if self.current or self.items else self._open(Item("message", f"msg_{uuid.uuid4().hex}"))
        return events + self._close("completed" if status == "completed" else "incomplete")

    def error(self, e: EngineError, params: dict[str, str]) -> tuple[str, dict]:
        """The `error` event of an engine error mid-stream."""
        error = convert.engine_error(e, params)[1]["error"]
        return self.event("error", code=error["code"] or error["type"], message=error["message"],
                          param=error["param"])

    def _open(self, item: Item) -> list[tuple[str, dict]]:
        events = self._close("completed")
        self.current, where = item, {"output_index": len(self.items)}
        events.append(self.event("response.output_item.added", item=item.to_json("in_progress"), **where))
        if item.kind == "message":
            events.append(self.event("response.content_part.added", item_id=item.id, content_index=0,
                                     part=item.part(), **where))
        return events

    def _grow(self, kind: str, text: str, **data) -> tuple[str, dict]:
        self.current.text += text
        return self.event(kind, item_id=self.current.id, output_index=len(self.items), delta=text, **data)

    def _close(self, status: str) -> list[tuple[str, dict]]:
        item, where = self.current, {"output_index": len(self.items)}
        if item is None:
            return []
        if item.kind == "message":
            at = {"item_id": item.id, "content_index": 0, **where}
            events = [self.event("response.output_text.done", text=item.text, logprobs=[], **at),
                      self.event("response.content_part.done", part=item.part(), **at)]
        else:
            events = [self.event("response.function_call_arguments.done", item_id=item.id, arguments=item.text,
                                 **where)]
        events.append(self.event("response.output_item.done", item=item.to_json(status), **where))
        self.items.append(item.to_json(status))
        self.current = None
        return events


async def events(job: Job, streams, rid: str, meta: dict, body: ResponsesRequest):
    """The Responses event stream of one request (Serving.serve's `events`)."""
    head, out = Head.of(body, rid, meta), Output()
    yield out.event("response.created", response=head.snapshot("in_progress", []))
    yield out.event("response.in_progress", response=head.snapshot("in_progress", []))
    shaper, usage, reason = job.shaper(), UsageCount(), None
    try:
        async for i, item in items(streams):
            deltas, finished = shaper.push(item.text, convert.finish_reason(item))
            for event in out.push(deltas):
                yield event
            if finished is not None:
                usage.add(i, item)
                reason = finished
    except EngineError as e:
        yield out.error(e, job.params)
        return
    status = STATUS[reason]
    for event in out.finish(status):
        yield event
    yield out.event(LAST_EVENT[status], response=head.snapshot(status, out.items, usage))


async def collect(body: ResponsesRequest, job: Job, streams, rid: str, meta: dict) -> dict:
    """The whole response (Serving.serve's `collect`, `body` bound by the route)."""
    g = await gather_all(job, streams, lambda item, offset: None)
    deltas, reason = job.shaper().push(g.texts[0], g.reasons.get(0))
    out, status = Output(), STATUS[reason]
    out.push(deltas)
    out.finish(status)
    return Head.of(body, rid, meta).snapshot(status, out.items, g.usage)
