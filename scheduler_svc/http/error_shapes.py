"""Which API's error shape a path gets: Anthropic's on /v1/messages (its SDK parses `{"type": "error", ...}`),
OpenAI's everywhere else. NOTE: kept free of the routes' modules, so that the middleware (the API key's 401, the
body limit's 413) and the app's own handlers (404, 405, 500) pick the same shape without importing them."""

from __future__ import annotations

from scheduler_svc.http.convert import error_body as openai_error_body

ANTHROPIC_PATH = "/v1/messages"
ANTHROPIC_ERROR_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
                         404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
                         413: "request_too_large", 429: "rate_limit_error", 500: "api_error",
                         503: "overloaded_error"}


def is_anthropic(path: str) -> bool:
    """Whether `path` is the Messages API's (/v1/messages and what lies under it)."""
    return path == ANTHROPIC_PATH or path.startswith(ANTHROPIC_PATH + "/")


def anthropic_error_body(status: int, message: str) -> dict:
    """Anthropic's error shape. NOTE: it names no field: the message does."""
    message = message.encode("utf-8", "backslashreplace").decode("utf-8")  # NOTE: as convert.error_body
    return {"type": "error", "error": {"type": ANTHROPIC_ERROR_TYPES.get(status, "api_error"), "message": message}}


def error_body_for(path: str, status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """The error body of `status` in the shape of the API `path` belongs to."""
    if is_anthropic(path):
        return anthropic_error_body(status, message)
    return openai_error_body(status, message, param, code)
