"""OpenTelemetry traces of client requests (--otlp-endpoint): nothing here imports opentelemetry before start()."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import TYPE_CHECKING
from urllib.parse import urlparse

import structlog

from pagedserve_common.startup import USAGE, StartupError

if TYPE_CHECKING:
    from scheduler_svc.tracing.spans import Tracing

log = structlog.get_logger("pagedserve.scheduler")

FLAG = "--otlp-endpoint"
TRACE_HEADERS = ("traceparent", "tracestate")  # W3C Trace Context, from HTTP headers and gRPC metadata
PROTOCOL_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL")
ENDPOINT_VARIABLES = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
PACKAGES = "opentelemetry-sdk opentelemetry-exporter-otlp-proto-grpc"


def grpc_trace_headers(metadata: Iterable[tuple[str, str]] | None) -> dict[str, str]:
    """The trace context headers of a call's invocation metadata (gRPC keys are lower case)."""
    return {k: v for k, v in metadata or () if k in TRACE_HEADERS}


def start(endpoint: str | None, model_id: str) -> Tracing | None:
    """The scheduler's tracing, exporting over OTLP/gRPC to `endpoint`; None (and no import) when it is not set.
    Raises StartupError naming the flag: a URL that is not http(s)://HOST:PORT, an OTLP protocol other than grpc
    asked for by the environment, the OpenTelemetry packages missing."""
    if not endpoint:
        if given := [name for name in ENDPOINT_VARIABLES if os.environ.get(name)]:
            # NOTE: off by default even where an operator injects OTEL_* into every pod: say so, once
            log.warning("traces are off: --otlp-endpoint is not set, so the OTLP endpoint variable is not used",
                        variables=given)
        return None
    url = urlparse(endpoint)
    if url.scheme not in ("http", "https") or not url.hostname or url.path not in ("", "/"):
        raise StartupError(f"{FLAG} {endpoint}: expected http://HOST:PORT (plaintext) or https://HOST:PORT (TLS), "
                           "the collector's OTLP/gRPC port (4317 by default)", USAGE)
    for name in PROTOCOL_VARIABLES:
        if (protocol := os.environ.get(name)) and protocol.strip() != "grpc":
            raise StartupError(f"{FLAG} exports over OTLP/gRPC only; environment variable {name} asks for "
                               f"{protocol!r} (unset it or set it to grpc)", USAGE)
    try:
        from scheduler_svc.tracing.spans import Tracing, otlp_provider
    except ImportError as e:
        raise StartupError(f"{FLAG} needs the OpenTelemetry SDK and its OTLP/gRPC exporter ({e.name or e} is not "
                           f"installed): pip install {PACKAGES}") from None
    return Tracing(otlp_provider(endpoint), model_id)

