"""What every generating route shares, whatever its API's shape (OpenAI's completions and chat, the Responses API,
Anthropic's Messages): open one stream per input, stream or collect the answer, free every block when the client
goes away, and say errors in the API's own shape. A route brings a Dialect (how its errors and events are written)
and three functions: its request as a Job, its events, its whole answer."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from pagedserve_common.defaults import TENANT_HEADER
from scheduler_svc import request_log
from scheduler_svc.auth import ApiKeys
from scheduler_svc.errors import EngineError
from scheduler_svc.frontend import FrontEnd, RequestStream, StreamItem
from scheduler_svc.frontend.api import tenant_of
from scheduler_svc.http import convert
from scheduler_svc.http.convert import Job, UsageCount
from scheduler_svc.http.prompt_logprobs import PromptLogprobsField
from scheduler_svc.identity import NO_KEYS, Identity


def sse(data: dict | str, event: str | None = None) -> str:
    """One server-sent event; `event` names its type (the Responses and Messages APIs name every event)."""
    head = f"event: {event}\n" if event else ""
    return f"{head}data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


@dataclass(frozen=True, slots=True)
class Dialect:
    """How one API says what every route says. `check(body)` runs first (fields it refuses, the model's name);
    `error(e, params)` is (HTTP status, body) of an EngineError; `event(chunk)` writes one item of a route's event
    stream (a dict, or an (event name, dict) pair); `done` ends a stream (OpenAI's `data: [DONE]`; "" for none)."""

    check: Callable[[object], None]
    error: Callable[[EngineError, dict], tuple[int, dict]]
    event: Callable[[object], str] = sse
    done: str = sse("[DONE]")

    def stream_error(self, e: EngineError, params: dict) -> str:
        return self.event(self.error(e, params)[1])


def named_event(item: tuple[str, dict]) -> str:
    """Dialect.event of the APIs whose events are (type, data) pairs: the type is also the data's `type`."""
    name, data = item
    return sse(data, name)


class EventStream(StreamingResponse):
    """Server-sent events that stop as soon as the client disconnects, not at the next write: the generator is
    cancelled at once, and its `finally` frees the request's blocks even while it waits in the queue."""

    media_type = "text/event-stream"

    async def __call__(self, scope, receive, send) -> None:
        writer = asyncio.ensure_future(self.stream_response(send))
        watcher = asyncio.ensure_future(self.listen_for_disconnect(receive))
        try:
            await asyncio.wait({writer, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            writer.cancel()
            watcher.cancel()
        if writer.done() and not writer.cancelled() and not isinstance(writer.exception(), OSError | None):
            raise writer.exception()


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def items(streams: list[RequestStream]) -> AsyncIterator[tuple[int, StreamItem]]:
    """(prompt index, item) from every stream as they come; raises the first EngineError."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, stream: RequestStream) -> None:
        try:
            async for item in stream:
                queue.put_nowait((i, item))
            queue.put_nowait((i, None))
        except EngineError as e:
            queue.put_nowait((i, e))

    tasks = [asyncio.ensure_future(pump(i, s)) for i, s in enumerate(streams)]
    try:
        num_open = len(streams)
        while num_open:
            i, item = await queue.get()
            if item is None:
                num_open -= 1
            elif isinstance(item, EngineError):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


@dataclass(slots=True)
class Gathered:
    """A whole non-streamed answer, per choice index: its text, finish reason, logprobs (one part per item) and
    output token ids; and the request's usage."""

    texts: dict = field(default_factory=lambda: defaultdict(str))
    reasons: dict = field(default_factory=dict)
    logprobs: dict = field(default_factory=lambda: defaultdict(list))
    token_ids: dict = field(default_factory=lambda: defaultdict(list))
    usage: UsageCount = field(default_factory=UsageCount)


async def gather_all(job: Job, streams: list[RequestStream], logprobs_of: Callable) -> Gathered:
    """A whole non-streamed answer (`logprobs_of(item, offset of its text)` per item, when asked for)."""
    g = Gathered()
    texts, reasons, logprobs, usage = g.texts, g.reasons, g.logprobs, g.usage
    async for i, item in items(streams):
        index = job.choice_index(i, item.index)
        if job.wants_logprobs:
            logprobs[index].append(logprobs_of(item, len(texts[index])))
        if not item.echo:  # NOTE: an echo item's ids are the prompt's
            g.token_ids[index] += item.token_ids
        texts[index] += item.text
        if item.finish_reason is not None:
            reasons[index] = convert.finish_reason(item)
            usage.add(i, item)
    return g


class Serving:
    """The front end, the API keys and the model's tool-call format (--tool-call-parser), as the routes of every API
    use them."""

    def __init__(self, frontend: FrontEnd, api_keys: ApiKeys | None, tool_call_parser: str = "none") -> None:
        self.frontend = frontend
        self.api_keys = api_keys
        self.tool_call_parser = tool_call_parser

    def identity(self, request: Request) -> Identity:
        """What the request's API key (bearer or x-api-key) grants; without keys, NO_KEYS (every caller trusted)."""
        return self.api_keys.identity_of_http(request.headers.items()) if self.api_keys else NO_KEYS

    async def open_streams(self, job: Job, request: Request) -> list[RequestStream]:
        streams: list[RequestStream] = []
        trace_headers = None if self.frontend.tracing is None else request.headers  # traceparent, tracestate
        try:
            for inp in job.inputs:
                streams.append(await self.frontend.generate(inp, trace_headers))
        except (EngineError, asyncio.CancelledError):
            self.close(streams)
            raise
        return streams

    def _prompt_logprobs(self, job: Job, streams: list[RequestStream]) -> PromptLogprobsField:
        return PromptLogprobsField(job.names or self.frontend, streams, job.n, job.prompt_logprobs)

    def close(self, streams: list[RequestStream]) -> None:
        for s in streams:
            if not s.done:  # the client went away or another input failed: free its blocks now
                self.frontend.abort(s.request.request_id)

    def error_response(self, dialect: Dialect, e: EngineError, params: dict[str, str], request_id: str) -> Response:
        request_log.rejected("http", e, request_id)
        status, body = dialect.error(e, params)
        return JSONResponse(body, status_code=status)

    async def serve(self, request: Request, body, dialect: Dialect, make_job: Callable, events: Callable,
                    collect: Callable) -> Response:
        """`make_job(body, request id, frontend)` -> Job; `events(job, streams, rid, meta, body)` yields what
        `dialect.event` writes; `collect(job, streams, rid, meta)` -> the whole answer (a dict)."""
        rid = uuid.uuid4().hex
        try:
            convert.check_text(body)  # NOTE: first: an error message may quote a field (the model's name)
            dialect.check(body)
            rid = convert.request_id(body, self.frontend.limits) or rid
            job = make_job(body, rid, self.frontend)
            identity = self.identity(request)
            tenant = tenant_of(request.headers.getlist(TENANT_HEADER), identity)
            for inp in job.inputs:
                inp.tenant, inp.max_priority = tenant, identity.max_priority
        except EngineError as e:
            return self.error_response(dialect, e, {}, rid)
        try:
            streams = await self.open_streams(job, request)
        except EngineError as e:
            return self.error_response(dialect, e, job.params, rid)
        meta = {"created": int(time.time()), "model": body.model or self.frontend.model_id}
        if body.stream:
            chunks = events(job, streams, rid, meta, body)
            if job.prompt_logprobs is not None:  # vLLM's field, on whatever route asked for it
                chunks = self._prompt_logprobs(job, streams).add_to_chunks(chunks)
            return EventStream(self._events(dialect, chunks, job, streams), headers={"Cache-Control": "no-cache"})
        work = asyncio.ensure_future(self._collect(dialect, collect, job, streams, rid, meta))
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not work.done():  # the client disconnected: its blocks go back now
                work.cancel()
                self.close(streams)
        if not work.done() or work.cancelled():
            return Response(status_code=499)
        status, content = work.result()
        return JSONResponse(content, status_code=status)

    async def _collect(self, dialect: Dialect, collect: Callable, job: Job, streams, rid: str,
                       meta: dict) -> tuple[int, dict]:
        try:
            answer = await collect(job, streams, rid, meta)
            if job.prompt_logprobs is not None:  # vLLM's field, on whatever route asked for it
                answer = self._prompt_logprobs(job, streams).add_to_answer(answer)
            return 200, answer
        except EngineError as e:
            return dialect.error(e, job.params)
        finally:
            self.close(streams)

    async def _events(self, dialect: Dialect, chunks: AsyncIterator, job: Job, streams) -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield dialect.event(chunk)
        except EngineError as e:
            yield dialect.stream_error(e, job.params)
        finally:
            self.close(streams)
        if dialect.done:
            yield dialect.done


def prompt_token_ids(streams: list[RequestStream], prompt_index: int) -> list[int]:
    """vLLM's return_token_ids: the ids prompt `prompt_index` ran on (after the chat template, when a chat)."""
    return list(streams[prompt_index].request.prompt_token_ids)
