"""StepLoop._plan_written: a step is published once the next plan is written, never later than the wait's bound."""

from __future__ import annotations

import asyncio
import time

import pytest

from pagedserve_common.kv_geometry import KVGeometry
from pagedserve_common.registration import WorkerRegistration
from scheduler_svc import step_loop as step_loop_mod
from scheduler_svc.fleet import Lost, WorkerHandle
from scheduler_svc.step_loop import StepLoop
from tests.support.scheduler import make


def handle() -> WorkerHandle:
    return WorkerHandle("worker-0", WorkerRegistration("m", 256, "cpu", KVGeometry(1, 1, 8, "float32", 16), 16),
                        make())


@pytest.mark.parametrize("release", [
    lambda w: w.plan_sent.set(),  # the Attach stream wrote the plan
    lambda w: w.fail(Lost("stream", "its stream broke (UNAVAILABLE)")),  # or will never write it
], ids=["written", "stream_broke"])
def test_publishing_waits_for_the_plans_write_or_the_streams_end(monkeypatch, release):
    monkeypatch.setattr(step_loop_mod, "PLAN_WRITE_WAIT_SECONDS", 60.0)  # only the release ends this wait

    async def scenario():
        w = handle()
        w.plan_sent.clear()
        waiter = asyncio.ensure_future(StepLoop._plan_written(w))
        await asyncio.sleep(0.01)
        assert not waiter.done()
        release(w)
        await asyncio.wait_for(waiter, 30.0)  # NOTE: a wide margin: busy machines are slow
    asyncio.run(scenario())


def test_a_plan_never_written_holds_publishing_only_for_the_bound(monkeypatch):
    monkeypatch.setattr(step_loop_mod, "PLAN_WRITE_WAIT_SECONDS", 0.05)

    async def scenario():
        w = handle()
        w.plan_sent.clear()
        t0 = time.monotonic()
        await asyncio.wait_for(StepLoop._plan_written(w), 30.0)
        assert time.monotonic() - t0 >= 0.05
    asyncio.run(scenario())
