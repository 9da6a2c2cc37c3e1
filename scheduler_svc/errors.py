"""Errors the scheduler service returns to clients, named after the gRPC status codes they map onto."""

from __future__ import annotations

import enum


class ErrorCode(enum.Enum):
    INVALID_ARGUMENT = "INVALID_ARGUMENT"
    NOT_FOUND = "NOT_FOUND"
    ALREADY_EXISTS = "ALREADY_EXISTS"
    RESOURCE_EXHAUSTED = "RESOURCE_EXHAUSTED"
    UNAVAILABLE = "UNAVAILABLE"
    FAILED_PRECONDITION = "FAILED_PRECONDITION"
    PERMISSION_DENIED = "PERMISSION_DENIED"  # a valid API key asking for what it may not (another tenant)
    # NOTE: only for bugs (an exception in the step loop), and for a request that took down --max-migrations workers
    INTERNAL = "INTERNAL"


DRAINING = "the server is draining: no new requests"  # UNAVAILABLE, from the front end and the engine alike


class EngineError(Exception):
    """A request the engine refuses or can no longer serve; servicers map `code` onto the gRPC status."""

    def __init__(self, code: ErrorCode, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.field = field  # the request field at fault (its generate.proto name), for INVALID_ARGUMENT
