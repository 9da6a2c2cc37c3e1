"""Helpers for tests against a real scheduler and worker (tests/service/conftest.py's Service): whether it is idle,
and that it ends idle and still serves."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc
from pagedserve_cli.bench.local_server import wait_idle

if TYPE_CHECKING:
    from tests.service.conftest import Service

RPC_TIMEOUT = 300  # NOTE: generous; a request that hangs ends DEADLINE_EXCEEDED and fails the test


def idle(service) -> bool:
    return (service.metric("pagedserve_requests_running") == 0 and service.metric("pagedserve_requests_waiting") == 0
            and service.metric("pagedserve_kv_blocks_used") == 0)


def assert_idle_and_serving(service: Service) -> None:
    """Nothing runs or waits and every KV block is free or cached-free (polled), then a normal request works."""
    reading = wait_idle(service.metric, timeout=120)
    assert not any(reading.values()), f"still busy or holding blocks: {reading}"
    with service.channel() as ch:
        out = list(generate_pb2_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
            prompt="The capital of France is", sampling=pb.SamplingParams(max_tokens=4, temperature=0)),
            timeout=RPC_TIMEOUT))
    assert sum(len(m.token_ids) for m in out) == 4 and out[-1].finish_reason == pb.FINISH_REASON_LENGTH


@contextmanager
def no_error_logged(service: Service) -> Iterator[None]:
    """Asserts that the scheduler logs no traceback and no error while the block runs (run a request that completes
    inside it, after the bad ones: a line logged after an answer went out is then in the log too)."""
    start = os.path.getsize(service.log)
    yield
    text = service.log_since(start)
    assert "Traceback" not in text and '"level": "error"' not in text, text[-3000:]
