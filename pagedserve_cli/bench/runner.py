"""Runs a workload against a client: Poisson (or all-at-once) arrivals, a concurrency cap, progress, metrics."""

from __future__ import annotations

import asyncio
import random
import sys
from dataclasses import dataclass, field

from pagedserve_cli.bench.clients import RequestRecord, now
from pagedserve_cli.bench.workloads import BenchRequest

METRICS_PERIOD_S = 0.5
# NOTE: the few vLLM counters the report reads from a peer (ours exports them too, under the same names)
VLLM_COUNTERS = frozenset({"vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
                           "vllm:num_preemptions_total", "vllm:prompt_tokens_total", "vllm:generation_tokens_total"})


@dataclass(slots=True)
class RunResult:
    """Every request's record and the metrics samples, times in seconds since the run started."""

    records: list[RequestRecord]
    metrics: list[tuple[float, dict[str, float]]] = field(default_factory=list)


def arrival_offsets(n: int, rate: float | None, seed: int) -> list[float]:
    """When each request is sent, in seconds from the start: Poisson arrivals at `rate`/s, or all at 0."""
    if not rate or rate == float("inf"):
        return [0.0] * n
    rng = random.Random(seed + 1)  # its own stream, so the rate never changes the workload
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def parse_prometheus(text: str) -> dict[str, float]:
    """pagedserve_* samples and VLLM_COUNTERS, summed over their labels (several workers or engines add up);
    buckets left out."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if (s.name.startswith("pagedserve_") and not s.name.endswith(("_bucket", "_created"))) \
                    or s.name in VLLM_COUNTERS:
                out[s.name] = out.get(s.name, 0.0) + s.value
    return out


class MetricsPoller:
    """Polls a Prometheus endpoint every 0.5 s; silently does nothing when it can't be reached."""

    def __init__(self, url: str | None, t0: float) -> None:
        self.url, self.t0 = url, t0
        self.samples: list[tuple[float, dict[str, float]]] = []
        self._http = None

    async def poll(self) -> bool:
        import httpx

        try:
            resp = await self._http.get(self.url)
            resp.raise_for_status()
            self.samples.append((now() - self.t0, parse_prometheus(resp.text)))
            return True
        except (httpx.HTTPError, ValueError):
            return False

    async def run(self, stop: asyncio.Event) -> None:
        if not self.url:
            return
        import httpx

        # NOTE: wide: a scrape of a loaded 2-core machine can take seconds, and a lost first or last sample
        # loses the run's server figures (a refused connection still fails at once)
        async with httpx.AsyncClient(timeout=30.0) as self._http:
            if not await self.poll():  # unreachable: the run goes on without server metrics
                return
            while not stop.is_set():
                try:
                    await asyncio.wait_for(stop.wait(), METRICS_PERIOD_S)
                except asyncio.TimeoutError:
                    await self.poll()
            await self.poll()  # after the last request, so counter deltas cover the whole run


async def run_workload(client, requests: list[BenchRequest], rate: float | None = None,
                       max_concurrency: int | None = None, seed: int = 0, metrics_url: str | None = None,
                       progress: bool = True) -> RunResult:
    """Sends every request (streaming) through `client` and waits for all; failures are recorded, never raised."""
    from tqdm import tqdm

    t0 = now()
    stop = asyncio.Event()
    poller = MetricsPoller(metrics_url, t0)
    poll_task = asyncio.create_task(poller.run(stop))
    # The first poll goes out before the load does: it is the counters' baseline.
    while metrics_url and not poller.samples and not poll_task.done():
        await asyncio.sleep(0.01)
    limit = asyncio.Semaphore(max_concurrency) if max_concurrency else None
    bar = tqdm(total=len(requests), file=sys.stderr, desc="bench", unit="req", disable=not progress,
               dynamic_ncols=True, mininterval=0.5)
    start = now()

    async def one(i: int, req: BenchRequest, at: float) -> RequestRecord:
        delay = start + at - now()
        if delay > 0:
            await asyncio.sleep(delay)
        try:
            if limit is None:
                return await client.generate(i, req)
            async with limit:
                return await client.generate(i, req)
        except Exception as e:  # a client bug must cost one request, not the run
            rec = RequestRecord(i, req.prompt_len or 0, req.max_tokens, send_time=now(),
                                error=f"{type(e).__name__}: {e}")
            return rec.finish()
        finally:
            bar.update(1)

    offsets = arrival_offsets(len(requests), rate, seed)
    records = await asyncio.gather(*(one(i, r, at) for i, (r, at) in enumerate(zip(requests, offsets))))
    bar.close()
    stop.set()
    await poll_task
    for rec in records:  # run-relative times, so results.json reads at a glance
        rec.send_time -= t0
        rec.first_token_time = None if rec.first_token_time is None else rec.first_token_time - t0
        rec.end_time = None if rec.end_time is None else rec.end_time - t0
        rec.chunk_times = [t - t0 for t in rec.chunk_times]
    return RunResult(list(records), poller.samples)
