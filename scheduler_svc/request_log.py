"""The request log: one line per admitted request at its end (finished, aborted or failed), one per refused one."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import structlog

from scheduler_svc.errors import EngineError, ErrorCode

if TYPE_CHECKING:
    from scheduler_svc.frontend.stream import RequestStream

log = structlog.get_logger("pagedserve.scheduler")


def finished(stream: RequestStream, worker: str | None) -> None:
    """Every sample ended. finish_reason is one per sample, comma-separated when n > 1 (e.g. "length,stop")."""
    reasons = ",".join(s.finish_reason.name.lower() if s.finish_reason is not None else "none"
                       for s in stream.samples)
    _end(stream, "request finished", worker, finish_reason=reasons)


def aborted(stream: RequestStream, worker: str | None) -> None:
    """The client went away: cancelled, its deadline passed, or it disconnected."""
    _end(stream, "request aborted", worker, status="CANCELLED")


def failed(stream: RequestStream, worker: str | None, code: ErrorCode, message: str) -> None:
    """The request ended with an error status after it was admitted (its workers failed, none was attached,
    the server shut down)."""
    _end(stream, "request failed", worker, level="warning", failed=True, status=code.value, message=message)


def _end(stream: RequestStream, event: str, worker: str | None, level: str = "info", failed: bool = False,
         **outcome) -> None:
    if stream.end_logged:  # NOTE: exactly one end line per request, whichever path ends it
        return
    stream.end_logged = True
    stream.metrics.protocol.ended(stream, failed)  # NOTE: here, as every request's end comes here once
    if stream.trace is not None:  # NOTE: here, so that a request's spans end exactly once, as its end line
        stream.trace.end(stream, event.removeprefix("request "), (outcome["status"], outcome["message"])
                         if "message" in outcome else None)
    req, now = stream.request, time.monotonic()
    ttft = None if stream.first_token_time is None else round(stream.first_token_time - stream.arrival, 4)
    fields = dict(request_id=req.client_request_id, worker=worker, prompt_tokens=len(req.prompt_token_ids),
                  output_tokens=sum(s.num_tokens for s in stream.samples), **outcome, ttft_s=ttft,
                  e2e_s=round(now - stream.arrival, 4))
    if req.tenant:  # NOTE: request ids are per tenant: the tenant tells two "r1" apart
        fields["tenant"] = req.tenant
    if req.num_preemptions:
        fields["preemptions"] = req.num_preemptions
    if req.num_migrations:
        fields["migrations"] = req.num_migrations
    getattr(log, level)(event, **fields)


def rejected(api: str, e: EngineError, request_id: str = "") -> None:
    """A request refused before it was admitted: a bad field, a full queue, draining, a duplicate id.
    `api` is "grpc" or "http"; `request_id` is the client's, when it sent one."""
    refused(api, e.code.value, str(e), e.field, request_id)


def refused(api: str, status: str, message: str, field: str | None = None, request_id: str = "") -> None:
    """`rejected` for refusals outside the engine's codes: UNAUTHENTICATED, an HTTP body over its limit."""
    fields = {"status": status, "message": message, "api": api}
    if field:
        fields["field"] = field
    if request_id:
        fields["request_id"] = request_id
    log.info("request rejected", **fields)
