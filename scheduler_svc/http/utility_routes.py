"""vLLM's routes beside the API that clients and operators call: /tokenize, /detokenize, /version, /ping and /metrics
(also on --metrics' port), and what an unknown route's 404 says is served."""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from scheduler_svc.errors import EngineError
from scheduler_svc.frontend.api import invalid
from scheduler_svc.frontend.tokenizer import FinalMessageError
from scheduler_svc.http import convert, history
from scheduler_svc.http.schemas import ChatMessage

MAX_DETOKENIZE_IDS = 1 << 20  # NOTE: the body limit bounds it first (4 MiB of JSON is < 1M ids)


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or a chat the model's template renders (ChatOptions' fields, as a chat's)."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool | None = None  # NOTE: None: true for a prompt (as a completion), false for a chat
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict | None = None
    return_token_strs: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[int] = Field(max_length=MAX_DETOKENIZE_IDS)


def package_version() -> str:
    try:
        return version("pagedserve")
    except PackageNotFoundError:  # NOTE: run from a source tree that was never installed
        return "unknown"


def add_routes(app: FastAPI, frontend, error) -> None:
    """`error(EngineError)`: the OpenAI-shaped error response of app.py."""

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        """vLLM's (SageMaker's) liveness probe: 200 while requests can be served, as /health."""
        ok, why = frontend.serving()
        return Response(status_code=200) if ok else JSONResponse(convert.error_body(503, why), status_code=503)

    @app.get("/version")
    async def server_version() -> dict:
        return {"version": package_version()}

    @app.get("/metrics")
    async def metrics() -> Response:
        """The --metrics endpoint's text, here too (vLLM serves it on its API port): behind the API key, if any."""
        return Response(generate_latest(frontend.metrics_registry), media_type=CONTENT_TYPE_LATEST)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> Response:
        try:
            convert.check_text(body)
            convert.check_model(frontend, body.model)
            ids = await _token_ids(frontend, body)
        except EngineError as e:
            return error(e)
        strs = frontend.tokenizer.convert_ids_to_tokens(ids) if body.return_token_strs else None
        return JSONResponse({"count": len(ids), "max_model_len": frontend.max_model_len, "tokens": ids,
                             "token_strs": strs})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> Response:
        try:
            convert.check_model(frontend, body.model)
            bad = next((t for t in body.tokens if not 0 <= t < frontend.vocab_size), None)
            if bad is not None:
                raise invalid("tokens", f"tokens: {bad} is not a token id (the vocabulary has {frontend.vocab_size})")
        except EngineError as e:
            return error(e)
        return JSONResponse({"prompt": await frontend.pool.decode(list(body.tokens), False)})


async def _token_ids(frontend, body: TokenizeRequest) -> list[int]:
    """The ids a completion (prompt) or a chat (messages) would run on. Raises EngineError naming the field."""
    if (body.prompt is None) == (body.messages is None):
        raise invalid("prompt", "set exactly one of prompt and messages")
    limit = frontend.max_model_len * 64  # NOTE: report a long prompt's count rather than refuse it, within a bound
    if body.prompt is not None:
        ids = await frontend.pool.encode(body.prompt, limit, body.add_special_tokens is not False)
    else:
        options = convert.chat_options(body)
        messages = history.template_messages(body.messages, frontend.tokenizer.chat_template)
        try:
            ids = await frontend.pool.encode_chat(messages, body.chat_template_kwargs or {}, limit, options)
        except FinalMessageError as e:
            raise invalid("continue_final_message", str(e)) from None
    if isinstance(ids, int):
        raise invalid("prompt" if body.prompt is not None else "messages",
                      f"the input has {ids} tokens, more than {limit} are not counted")
    return ids
