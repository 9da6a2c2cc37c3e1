"""Defaults that several places mean: the model, the addresses of the services and the KV block size."""

from __future__ import annotations

DEFAULT_MODEL = "smollm2-135m-instruct"  # a known name (worker_svc.model_store) or a local HF model directory
DEFAULT_LISTEN = "127.0.0.1:50051"  # the scheduler's client API (gRPC); what clients dial by default
DEFAULT_WORKER_LISTEN = "127.0.0.1:50052"  # where workers dial in
METRICS_PORT = 9464  # Prometheus
DEFAULT_METRICS = f"127.0.0.1:{METRICS_PORT}"
DEFAULT_HTTP = "127.0.0.1:8000"  # the OpenAI-compatible HTTP API of `pagedserve up` (`scheduler`: off)
DEFAULT_BLOCK_SIZE = 16  # tokens per KV block


def metrics_url(server: str) -> str:
    """The Prometheus URL of the scheduler serving the client API at `server` (HOST:PORT) on the default port."""
    return f"http://{server.rsplit(':', 1)[0]}:{METRICS_PORT}/metrics"

# The tenant a request counts for (its fair share, prefix cache, request ids), as a gateway or operator API key (or
# any caller of a server without keys) names it: an HTTP header, or gRPC metadata (the scheduler's front end reads
# it; `pagedserve bench --tenant` sends it). A tenant key's requests are its name's, whatever this says.
TENANT_HEADER = "x-pagedserve-tenant"
MAX_TENANT_CHARS = 128
