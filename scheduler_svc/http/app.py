"""The OpenAI-compatible routes: /v1/completions, /v1/chat/completions, /v1/models (and /v1/models/{id}), /health."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable
from functools import partial

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedserve_common.defaults import TENANT_HEADER
from scheduler_svc.auth import ApiKeyMiddleware, ApiKeys
from scheduler_svc import request_log
from scheduler_svc.errors import EngineError, ErrorCode
from scheduler_svc.frontend import FrontEnd, RequestStream, StreamItem
from scheduler_svc.frontend.api import tenant_of
from scheduler_svc.http import convert, fields, tools
from scheduler_svc.http.convert import Job, UsageCount
from scheduler_svc.http.limits import BodyLimit
from scheduler_svc.http.schemas import ChatCompletionRequest, CompletionRequest


def _sse(data: dict | str) -> str:
    return f"data: {data if isinstance(data, str) else json.dumps(data, ensure_ascii=False)}\n\n"


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


async def _items(streams: list[RequestStream]) -> AsyncIterator[tuple[int, StreamItem]]:
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


async def _gather(job: Job, streams: list[RequestStream], logprobs_of: Callable) -> tuple[dict, dict, dict, UsageCount]:
    """A whole non-streamed answer per choice index: its text, finish reason and logprobs (one
    `logprobs_of(item, offset of its text)` per item, when asked for), and the request's usage."""
    texts, reasons, logprobs, usage = defaultdict(str), {}, defaultdict(list), UsageCount()
    async for i, item in _items(streams):
        index = job.choice_index(i, item.index)
        if job.wants_logprobs:
            logprobs[index].append(logprobs_of(item, len(texts[index])))
        texts[index] += item.text
        if item.finish_reason is not None:
            reasons[index] = convert.finish_reason(item)
            usage.add(i, item)
    return texts, reasons, logprobs, usage


def create_app(frontend: FrontEnd, api_keys: ApiKeys | None = None, tool_call_parser: str = "none") -> FastAPI:
    """`tool_call_parser`: the model's tool-call format (--tool-call-parser), which tool_choice auto parses."""
    # NOTE: no /docs, /redoc or /openapi.json: they would be served without the API key, and they describe the
    # pydantic models, not the API (the README does)
    app = FastAPI(title="pagedserve", summary="OpenAI-compatible API of a pagedserve scheduler", docs_url=None,
                  redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, max_bytes=frontend.limits.max_message_size)
    if api_keys is not None:  # NOTE: added last, so it runs first; /health stays open
        app.add_middleware(ApiKeyMiddleware, keys=api_keys,
                           error_body=lambda why: convert.error_body(401, why, code="invalid_api_key"))
    started = int(time.time())

    def error(status: int, message: str, param: str | None = None) -> JSONResponse:
        return JSONResponse(convert.error_body(status, message, param), status_code=status)

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return invalid_body(f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}")
        loc = [x for x in first.get("loc", ()) if x != "body"]
        # NOTE: the top-level field is the param; the full location (union members included) goes in the message
        param = str(loc[0]) if loc else None
        where = ".".join(str(x) for x in loc) or "body"
        return invalid_body(f"{where}: {first.get('msg', 'invalid value')}", param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """FastAPI's and Starlette's own errors (404 unknown path, 405 wrong method, a body it could not parse) in
        OpenAI's shape rather than {"detail": ...}."""
        message = _parse_failure(exc.__cause__) if exc.status_code == 400 else None
        if message is not None:
            return invalid_body(message)
        message = str(exc.detail)
        if exc.status_code in (404, 405):  # as OpenAI says it: which route was asked for
            message += f" ({request.method} {request.url.path[:200]})"
        return JSONResponse(convert.error_body(exc.status_code, message), status_code=exc.status_code,
                            headers=exc.headers)

    @app.exception_handler(Exception)
    async def bug(request: Request, exc: Exception) -> JSONResponse:
        # NOTE: a bug: Starlette logs its traceback; the client gets OpenAI's shape, not a plain-text 500
        return error(500, "internal error")

    def invalid_body(message: str, param: str | None = None) -> JSONResponse:
        request_log.rejected("http", EngineError(ErrorCode.INVALID_ARGUMENT, message, param))
        return error(400, message, param)

    @app.get("/health")
    async def health() -> Response:
        ok, why = frontend.serving()
        return JSONResponse({"status": "ok"}) if ok else error(503, why)

    def model_object() -> dict:
        # NOTE: kv_cache_dtypes: the attached workers' cache element types (workers may differ), [] with none
        dtypes = sorted({w.registration.dtype for w in frontend.engine.workers.values()})
        return {"id": frontend.model_id, "object": "model", "created": started, "owned_by": "pagedserve",
                "max_model_len": frontend.max_model_len, "kv_cache_dtypes": dtypes}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_object()]}

    # NOTE: `:path`: a model id may hold slashes (a Hub repo id, a directory), sent raw or as %2F (the openai client)
    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        if model_id == frontend.model_id:
            return JSONResponse(model_object())
        message = f"The model {model_id[:200]!r} does not exist: this server serves {frontend.model_id!r}"
        return JSONResponse(convert.error_body(404, message, "model", "model_not_found"), status_code=404)

    async def open_streams(job: Job, request: Request) -> list[RequestStream]:
        streams: list[RequestStream] = []
        trace_headers = None if frontend.tracing is None else request.headers  # NOTE: traceparent, tracestate
        try:
            for inp in job.inputs:
                streams.append(await frontend.generate(inp, trace_headers))
        except (EngineError, asyncio.CancelledError):
            close(streams)
            raise
        return streams

    def close(streams: list[RequestStream]) -> None:
        for s in streams:
            if not s.done:  # the client went away or another prompt failed: free its blocks now
                frontend.abort(s.request.request_id)

    async def serve(request: Request, body, make_job: Callable, events: Callable, collect: Callable) -> Response:
        rid = uuid.uuid4().hex
        try:
            convert.check_text(body)  # NOTE: first: an error message may quote a field (the model's name)
            fields.check(body)
            rid = convert.request_id(body, frontend.limits) or rid
            convert.check_model(frontend, body.model)
            job = make_job(body, rid, frontend)
            key_name = api_keys.name_of(request.headers.getlist("authorization")) if api_keys else ""
            tenant = tenant_of(request.headers.getlist(TENANT_HEADER), key_name)
            for inp in job.inputs:
                inp.tenant = tenant
        except EngineError as e:
            return _error_response(e, {}, rid)
        try:
            streams = await open_streams(job, request)
        except EngineError as e:
            return _error_response(e, job.params, rid)
        meta = {"created": int(time.time()), "model": body.model or frontend.model_id}
        include_usage = bool(body.stream_options and body.stream_options.include_usage)
        if body.stream:
            return EventStream(_events(events(job, streams, rid, meta, include_usage), job, streams),
                               headers={"Cache-Control": "no-cache"})
        work = asyncio.ensure_future(_collect(collect, job, streams, rid, meta))
        watcher = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            watcher.cancel()
            if not work.done():  # the client disconnected: its blocks go back now
                work.cancel()
                close(streams)
        if not work.done() or work.cancelled():
            return Response(status_code=499)
        status, content = work.result()
        return JSONResponse(content, status_code=status)

    async def _collect(collect: Callable, job: Job, streams, rid: str, meta: dict) -> tuple[int, dict]:
        try:
            return 200, await collect(job, streams, rid, meta)
        except EngineError as e:
            return convert.engine_error(e, job.params)
        finally:
            close(streams)

    async def _events(chunks: AsyncIterator[dict], job: Job, streams) -> AsyncIterator[str]:
        try:
            async for chunk in chunks:
                yield _sse(chunk)
        except EngineError as e:
            yield _sse(convert.engine_error(e, job.params)[1])
        finally:
            close(streams)
        yield _sse("[DONE]")

    # -- /v1/completions ----------------------------------------------------------------------------------
    async def completion_events(job: Job, streams, rid: str, meta: dict, include_usage: bool):
        head = {"id": f"cmpl-{rid}", "object": "text_completion", **meta}
        usage, offsets = UsageCount(), defaultdict(int)
        async for i, item in _items(streams):
            index, reason = job.choice_index(i, item.index), convert.finish_reason(item)
            if reason is not None:
                usage.add(i, item)
            elif not item.text and not item.logprobs:
                continue  # text held back (a partial character or a possible stop string): nothing to say yet
            choice = {"index": index, "text": item.text, "logprobs": None, "finish_reason": reason}
            if job.wants_logprobs:
                choice["logprobs"] = convert.completion_logprobs(frontend, item, offsets[index])
            offsets[index] += len(item.text)
            yield {**head, "choices": [choice], **({"usage": None} if include_usage else {})}
        if include_usage:
            yield {**head, "choices": [], "usage": usage.to_json()}

    async def completion_collect(job: Job, streams, rid: str, meta: dict) -> dict:
        texts, reasons, logprobs, usage = await _gather(job, streams, partial(convert.completion_logprobs, frontend))
        choices = [{"index": k, "text": texts[k], "finish_reason": reasons.get(k),
                    "logprobs": _join_completion_logprobs(logprobs[k]) if job.wants_logprobs else None}
                   for k in sorted(texts)]
        return {"id": f"cmpl-{rid}", "object": "text_completion", **meta, "choices": choices,
                "usage": usage.to_json()}

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serve(request, body, convert.completion_job, completion_events, completion_collect)

    # -- /v1/chat/completions -----------------------------------------------------------------------------
    async def chat_events(job: Job, streams, rid: str, meta: dict, include_usage: bool):
        head = {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", **meta}
        extra = {"usage": None} if include_usage else {}
        usage, shapers = UsageCount(), defaultdict(job.shaper)

        def chunk(index: int, delta: dict, logprobs, reason: str | None) -> dict:
            return {**head, "choices": [{"index": index, "delta": delta, "logprobs": logprobs,
                                         "finish_reason": reason}], **extra}

        for index in range(job.n):  # each choice opens with the role, as OpenAI's stream does
            yield chunk(index, {"role": "assistant", "content": shapers[index].opening_content}, None, None)
        async for i, item in _items(streams):
            index = job.choice_index(i, item.index)
            deltas, reason = shapers[index].push(item.text, convert.finish_reason(item))
            if reason is not None:
                usage.add(i, item)
            elif not deltas and not item.logprobs:
                continue  # text held back (a possible stop string or tool call): nothing to say yet
            for delta in deltas[:-1]:
                yield chunk(index, delta, None, None)
            logprobs = {"content": convert.chat_logprobs(frontend, item)} if job.wants_logprobs else None
            yield chunk(index, deltas[-1] if deltas else {}, logprobs, reason)
        if include_usage:
            yield {**head, "choices": [], "usage": usage.to_json()}

    async def chat_collect(job: Job, streams, rid: str, meta: dict) -> dict:
        texts, reasons, logprobs, usage = await _gather(job, streams,
                                                        lambda item, _: convert.chat_logprobs(frontend, item))
        choices = []
        for k in sorted(texts):
            message, reason = tools.message(job.shaper(), texts[k], reasons.get(k))
            choices.append({"index": k, "message": message, "finish_reason": reason,
                            "logprobs": {"content": [e for part in logprobs[k] for e in part]} if job.wants_logprobs
                            else None})
        return {"id": f"chatcmpl-{rid}", "object": "chat.completion", **meta, "choices": choices,
                "usage": usage.to_json()}

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await serve(request, body, partial(convert.chat_job, tool_call_parser=tool_call_parser), chat_events,
                           chat_collect)

    return app


def _parse_failure(cause: BaseException | None) -> str | None:
    """Why FastAPI could not parse a body (it says only "There was an error parsing the body")."""
    if isinstance(cause, UnicodeDecodeError):
        return f"the request body is not valid UTF-8 (byte {cause.start}): JSON text must be"
    if isinstance(cause, RecursionError):
        return "the request body is nested too deeply to parse"
    return None  # NOTE: e.g. BodyLimit's refusal while FastAPI reads the body: its 413 is the answer


def _error_response(e: EngineError, params: dict[str, str], request_id: str) -> JSONResponse:
    request_log.rejected("http", e, request_id)
    status, body = convert.engine_error(e, params)
    return JSONResponse(body, status_code=status)


def _join_completion_logprobs(parts: list[dict]) -> dict:
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for key in out:
            out[key] += part[key]
    return out
