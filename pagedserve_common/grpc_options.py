"""gRPC's channel and server settings, for both services: the worker link's two ends (the scheduler's worker port,
scheduler_svc.ports; the worker's channel to it, worker_svc.client) and the message bounds the other ports and the
CLI's clients set. NOTE: option tuples only (grpc's names and values): no grpc import, so pagedserve_common stays
free of it."""

from __future__ import annotations

Options = tuple[tuple[str, int], ...]

# NOTE: keepalive on the worker link finds a dead peer (a killed host, a stopped process, a cut cable) in about
# KEEPALIVE_TIME_MS + KEEPALIVE_TIMEOUT_MS even while no step is in flight. Both ends ping that often, so the
# server must accept pings at least that often (MIN_PING_INTERVAL_MS, and no strikes).
KEEPALIVE_TIME_MS = 10_000
KEEPALIVE_TIMEOUT_MS = 5_000
MIN_PING_INTERVAL_MS = 5_000  # the server: the closest pings without data it takes from a client
MAX_WORKER_MESSAGE_BYTES = 64 << 20  # a StepPlan or a StepResult, either way on the worker link

# NOTE: gRPC sets SO_REUSEPORT by default: a second scheduler on a taken port would start and share it silently
NO_PORT_SHARING: Options = (("grpc.so_reuseport", 0),)


def receive_limit(num_bytes: int) -> Options:
    """The largest message a channel or server takes (gRPC's default: 4 MiB); beyond, RESOURCE_EXHAUSTED."""
    return (("grpc.max_receive_message_length", num_bytes),)


def message_limits(num_bytes: int) -> Options:
    """The largest message either way."""
    return (*receive_limit(num_bytes), ("grpc.max_send_message_length", num_bytes))


_KEEPALIVE: Options = (("grpc.keepalive_time_ms", KEEPALIVE_TIME_MS),
                       ("grpc.keepalive_timeout_ms", KEEPALIVE_TIMEOUT_MS),
                       ("grpc.keepalive_permit_without_calls", 1))

# The scheduler's worker port: pings from workers (MIN_PING_INTERVAL_MS apart at most) are never strikes.
WORKER_SERVER_OPTIONS: Options = (
    *NO_PORT_SHARING,
    *_KEEPALIVE,
    ("grpc.http2.min_ping_interval_without_data_ms", MIN_PING_INTERVAL_MS),
    ("grpc.http2.max_ping_strikes", 0),
    *message_limits(MAX_WORKER_MESSAGE_BYTES),
)
# A worker's channel to that port: it pings with no call in flight, without limit.
WORKER_CHANNEL_OPTIONS: Options = (
    *_KEEPALIVE,
    ("grpc.http2.max_pings_without_data", 0),
    *message_limits(MAX_WORKER_MESSAGE_BYTES),
)
