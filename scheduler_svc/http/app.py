"""The HTTP front: OpenAI's /v1/completions, /v1/chat/completions, /v1/models (and /v1/models/{id}) and /health here;
the Responses API, Anthropic's Messages and vLLM's utility routes in modules of their own."""

from __future__ import annotations

import time
from collections import defaultdict
from functools import partial

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from scheduler_svc import request_log
from scheduler_svc.auth import ApiKeyMiddleware, ApiKeys
from scheduler_svc.errors import EngineError, ErrorCode
from scheduler_svc.frontend import FrontEnd
from scheduler_svc.http import convert, fields, messages_api, responses_api, tools, utility_routes
from scheduler_svc.http.convert import Job, UsageCount, UsageReport
from scheduler_svc.http.error_shapes import error_body_for
from scheduler_svc.http.limits import BodyLimit
from scheduler_svc.http.schemas import ChatCompletionRequest, CompletionRequest
from scheduler_svc.http.serving import Dialect, Serving, gather_all, items, prompt_token_ids


def _check_openai(frontend: FrontEnd, body) -> None:
    fields.check(body)
    convert.check_model(frontend, body.model)


def create_app(frontend: FrontEnd, api_keys: ApiKeys | None = None, tool_call_parser: str = "none") -> FastAPI:
    """`tool_call_parser`: the model's tool-call format (--tool-call-parser), which tool_choice auto parses."""
    # NOTE: no /docs, /redoc or /openapi.json: they would be served without the API key, and they describe the
    # pydantic models, not the API (docs/api.md does)
    app = FastAPI(title="pagedserve", summary="OpenAI-compatible API of a pagedserve scheduler", docs_url=None,
                  redoc_url=None, openapi_url=None)
    app.add_middleware(BodyLimit, max_bytes=frontend.limits.max_message_size)
    if api_keys is not None:  # NOTE: added last, so it runs first; /health stays open
        app.add_middleware(ApiKeyMiddleware, keys=api_keys,
                           error_body=lambda why, path: error_body_for(path, 401, why, code="invalid_api_key"))
    started = int(time.time())
    serving = Serving(frontend, api_keys, tool_call_parser)
    openai = Dialect(check=partial(_check_openai, frontend), error=convert.engine_error)
    _add_error_handlers(app)
    # NOTE: the order routes are added in is the order a 404 lists them in (served_routes)
    _add_model_routes(app, frontend, started)
    _add_completion_routes(app, serving, openai, tool_call_parser)
    utility_routes.add_routes(app, frontend, lambda e: serving.error_response(openai, e, {}, ""))
    messages_api.add_routes(app, serving)  # Anthropic's /v1/messages
    responses_api.add_routes(app, serving)  # OpenAI's /v1/responses
    return app


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse(convert.error_body(status, message, param), status_code=status)


def _invalid_body(message: str, param: str | None = None) -> JSONResponse:
    request_log.rejected("http", EngineError(ErrorCode.INVALID_ARGUMENT, message, param))
    return _error(400, message, param)


def _add_error_handlers(app: FastAPI) -> None:
    """A bad body, FastAPI's and Starlette's own errors and a bug, each answered in the API's error shape."""

    @app.exception_handler(RequestValidationError)
    async def bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        if first.get("type") == "json_invalid":
            return _invalid_body(f"the request body is not valid JSON: {first.get('ctx', {}).get('error', '')}")
        loc = [x for x in first.get("loc", ()) if x != "body"]
        # NOTE: the top-level field is the param; the full location (union members included) goes in the message
        param = str(loc[0]) if loc else None
        where = ".".join(str(x) for x in loc) or "body"
        return _invalid_body(f"{where}: {first.get('msg', 'invalid value')}", param)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        """FastAPI's and Starlette's own errors (404 unknown path, 405 wrong method, a body it could not parse) in
        OpenAI's shape rather than {"detail": ...}."""
        message = _parse_failure(exc.__cause__) if exc.status_code == 400 else None
        if message is not None:
            return _invalid_body(message)
        message = str(exc.detail)
        if exc.status_code in (404, 405):  # as OpenAI says it: which route was asked for, and what is served
            message += f" ({request.method} {request.url.path[:200]}); served: {served_routes(app)}"
        return JSONResponse(error_body_for(request.url.path, exc.status_code, message),
                            status_code=exc.status_code, headers=exc.headers)

    @app.exception_handler(Exception)
    async def bug(request: Request, exc: Exception) -> JSONResponse:
        # NOTE: a bug: Starlette logs its traceback; the client gets its API's error shape, not a plain-text 500
        return JSONResponse(error_body_for(request.url.path, 500, "internal error"), status_code=500)


def _add_model_routes(app: FastAPI, frontend: FrontEnd, started: int) -> None:
    """/health, /v1/models and /v1/models/{id}; `started`: the models' `created` (when the app was made)."""

    @app.get("/health")
    async def health() -> Response:
        ok, why = frontend.serving()
        return JSONResponse({"status": "ok"}) if ok else _error(503, why)

    def model_object(name: str) -> dict:
        # NOTE: kv_cache_dtypes: the attached workers' cache element types (workers may differ), [] with none;
        # root: the model itself (--model), as vLLM names what an alias of --served-model-name serves
        dtypes = sorted({r.dtype for r in frontend.model_workers().values()})
        return {"id": name, "object": "model", "created": started, "owned_by": "pagedserve",
                "root": frontend.root_model_id, "max_model_len": frontend.max_model_len,
                "kv_cache_dtypes": dtypes}

    @app.get("/v1/models")
    async def models() -> dict:
        return {"object": "list", "data": [model_object(name) for name in frontend.model_names]}

    # NOTE: `:path`: a model id may hold slashes (a Hub repo id, a directory), sent raw or as %2F (the openai client)
    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> Response:
        if model_id in frontend.model_names:
            return JSONResponse(model_object(model_id))
        message = f"The model {model_id[:200]!r} does not exist: this server serves " \
                  f"{', '.join(map(repr, frontend.model_names))}"
        return JSONResponse(convert.error_body(404, message, "model", "model_not_found"), status_code=404)


def _add_completion_routes(app: FastAPI, serving: Serving, openai: Dialect, tool_call_parser: str) -> None:
    """/v1/completions and /v1/chat/completions."""

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await serving.serve(request, body, openai, convert.completion_job, _completion_events,
                                   _completion_collect)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        make_job = partial(convert.chat_job, tool_call_parser=tool_call_parser)
        return await serving.serve(request, body, openai, make_job, _chat_events, _chat_collect)


# -- /v1/completions ----------------------------------------------------------------------------------------
async def _completion_events(job: Job, streams, rid: str, meta: dict, body):
    head = {"id": f"cmpl-{rid}", "object": "text_completion", **meta}
    usage, offsets, report = UsageCount(), defaultdict(int), UsageReport(body.stream_options, streams)
    opened: set[int] = set()  # choices whose first chunk went out (return_token_ids: it has the prompt's ids)
    async for i, item in items(streams):
        index, reason = job.choice_index(i, item.index), convert.finish_reason(item)
        report.saw(item)
        if reason is not None:
            usage.add(i, item)
        elif not item.text and not item.logprobs and not (job.return_token_ids and item.token_ids):
            continue  # text held back (a partial character or a possible stop string): nothing to say yet
        choice = {"index": index, "text": item.text, "logprobs": None, "finish_reason": reason}
        if job.wants_logprobs:
            choice["logprobs"] = convert.completion_logprobs(job.names, item, offsets[index], job.num_logprobs)
        if job.return_token_ids:
            choice["token_ids"] = [] if item.echo else list(item.token_ids)
            if index not in opened:
                choice["prompt_token_ids"] = prompt_token_ids(streams, i)
        opened.add(index)
        offsets[index] += len(item.text)
        yield {**head, "choices": [choice], **report.chunk_usage()}
    if report.include_usage:
        yield {**head, "choices": [], "usage": usage.to_json()}


async def _completion_collect(job: Job, streams, rid: str, meta: dict) -> dict:
    g = await gather_all(job, streams, partial(convert.completion_logprobs, job.names, num_top=job.num_logprobs))
    choices = []
    for k in sorted(g.texts):
        choice = {"index": k, "text": g.texts[k], "finish_reason": g.reasons.get(k),
                  "logprobs": _join_completion_logprobs(g.logprobs[k]) if job.wants_logprobs else None}
        if job.return_token_ids:
            choice.update(prompt_token_ids=prompt_token_ids(streams, k // job.n), token_ids=g.token_ids[k])
        choices.append(choice)
    return {"id": f"cmpl-{rid}", "object": "text_completion", **meta, "choices": choices,
            "usage": g.usage.to_json()}


# -- /v1/chat/completions ------------------------------------------------------------------------------------
async def _chat_events(job: Job, streams, rid: str, meta: dict, body):
    head = {"id": f"chatcmpl-{rid}", "object": "chat.completion.chunk", **meta}
    usage, shapers, report = UsageCount(), defaultdict(job.shaper), UsageReport(body.stream_options, streams)

    def chunk(index: int, delta: dict, logprobs, reason: str | None, token_ids=None) -> dict:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": reason}
        if token_ids is not None:
            choice["token_ids"] = token_ids
        return {**head, "choices": [choice], **report.chunk_usage()}

    for index in range(job.n):  # each choice opens with the role, as OpenAI's stream does
        first = chunk(index, {"role": "assistant", "content": shapers[index].opening_content}, None, None)
        if job.return_token_ids and index == 0:
            first["prompt_token_ids"] = prompt_token_ids(streams, 0)  # NOTE: vLLM's place: the response
        yield first
    if job.echo_text:  # vLLM's chat echo: a content chunk of its own per choice, after the role's
        for index in range(job.n):
            yield chunk(index, {"content": job.echo_text}, None, None)
    async for i, item in items(streams):
        index = job.choice_index(i, item.index)
        report.saw(item)
        deltas, reason = shapers[index].push(item.text, convert.finish_reason(item))
        ids = list(item.token_ids) if job.return_token_ids else None
        if reason is not None:
            usage.add(i, item)
        elif not deltas and not item.logprobs and not ids:
            continue  # text held back (a possible stop string or tool call): nothing to say yet
        for delta in deltas[:-1]:
            yield chunk(index, delta, None, None, [] if ids is not None else None)
        logprobs = {"content": convert.chat_logprobs(job.names, item)} if job.wants_logprobs else None
        yield chunk(index, deltas[-1] if deltas else {}, logprobs, reason, ids)
    if report.include_usage:
        yield {**head, "choices": [], "usage": usage.to_json()}


async def _chat_collect(job: Job, streams, rid: str, meta: dict) -> dict:
    g = await gather_all(job, streams, lambda item, _: convert.chat_logprobs(job.names, item))
    choices = []
    for k in sorted(g.texts):
        message, reason = tools.message(job.shaper(), g.texts[k], g.reasons.get(k))
        if job.echo_text:  # vLLM's chat echo (beside tool calls too)
            message["content"] = job.echo_text + (message["content"] or "")
        choice = {"index": k, "message": message, "finish_reason": reason,
                  "logprobs": {"content": [e for part in g.logprobs[k] for e in part]} if job.wants_logprobs
                  else None}
        if job.return_token_ids:
            choice["token_ids"] = g.token_ids[k]
        choices.append(choice)
    answer = {"id": f"chatcmpl-{rid}", "object": "chat.completion", **meta, "choices": choices,
              "usage": g.usage.to_json()}
    if job.return_token_ids:
        answer["prompt_token_ids"] = prompt_token_ids(streams, 0)
    return answer


def _parse_failure(cause: BaseException | None) -> str | None:
    """Why FastAPI could not parse a body (it says only "There was an error parsing the body")."""
    if isinstance(cause, UnicodeDecodeError):
        return f"the request body is not valid UTF-8 (byte {cause.start}): JSON text must be"
    if isinstance(cause, RecursionError):
        return "the request body is nested too deeply to parse"
    return None  # NOTE: e.g. BodyLimit's refusal while FastAPI reads the body: its 413 is the answer


def _join_completion_logprobs(parts: list[dict]) -> dict:
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for part in parts:
        for key in out:
            out[key] += part[key]
    return out


def served_routes(app: FastAPI) -> str:
    """Every route `app` serves, as `METHOD /path`, for an unknown route's 404."""
    routes = []
    for route in app.routes:
        methods = sorted(getattr(route, "methods", None) or ())
        routes += [f"{m} {route.path}" for m in methods if m != "HEAD"]
    return ", ".join(routes)
