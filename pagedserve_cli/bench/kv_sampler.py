"""Samples a worker's KV pool (GetKVState) during a benchmark run, and what each sample says about KV usage."""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass

from pagedserve_cli.bench.clients import now

KV_SAMPLE_PERIOD_S = 0.25


@dataclass(slots=True)
class KVUsage:
    """One snapshot's KV usage, in token slots.

    reserved: slots of blocks some sequence holds (ref count > 0); filled: those holding a token's K and V (a block
    shared by several sequences counts once, at its fullest); free: slots of blocks at ref count 0 (cached or not);
    stranded: the free slots while the queue head waits for blocks (KVState.waiting_for_blocks), of no use to it
    then: under a static mode, holes shorter than its reservation (external fragmentation); under paging, fewer
    free blocks than its next chunk needs.
    """

    t: float
    num_running: int
    num_waiting: int
    reserved: int
    filled: int
    free: int
    stranded: int

    @property
    def waste(self) -> float:
        """This sample's share of tied-up slots without a token (summarize_usage takes it over all samples' sums)."""
        return waste_share(self.reserved, self.filled, self.stranded)


def waste_share(reserved: int, filled: int, stranded: int) -> float:
    """1 - filled / (reserved + stranded): KV memory tied up (held, or free but unusable) without a token."""
    tied = reserved + stranded
    return 1 - filled / tied if tied else 0.0


def usage_of(state, t: float) -> KVUsage:
    """KVUsage of a pagedserve.v1.KVState taken `t` seconds into the run."""
    from pagedserve_cli.kv_state import KVSnapshot, figures

    f = figures(KVSnapshot.from_pb(state))
    free = f["num_free_blocks"] * f["block_size"]
    stranded = free if f["waiting_for_blocks"] else 0
    return KVUsage(t, f["num_running"], f["num_waiting"], f["num_slots_allocated"], f["num_slots_filled"], free,
                   stranded)


class KVSampler:
    """Polls GetKVState every `period` seconds on its own channel; keeps every answer (the GIF is drawn from them)."""

    def __init__(self, server: str, t0: float, period: float = KV_SAMPLE_PERIOD_S) -> None:
        self.server, self.t0, self.period = server, t0, period
        self.states: list[tuple[float, object]] = []  # (seconds into the run, pagedserve.v1.KVState)

    async def snapshot(self, stub, timeout: float = 30.0):
        from pagedserve.v1 import generate_pb2

        return await stub.GetKVState(generate_pb2.GetKVStateRequest(), timeout=timeout)

    async def run(self, stop: asyncio.Event) -> None:
        import grpc

        from pagedserve.v1 import generate_pb2_grpc

        async with grpc.aio.insecure_channel(self.server) as channel:
            stub = generate_pb2_grpc.GenerationStub(channel)
            while True:
                try:
                    self.states.append((now() - self.t0, await self.snapshot(stub)))
                except grpc.aio.AioRpcError:
                    pass  # a missed sample leaves a gap, never a failed run
                if stop.is_set():
                    return  # NOTE: one last sample after the run: the final counters (prefill tokens)
                try:
                    await asyncio.wait_for(stop.wait(), self.period)
                except asyncio.TimeoutError:
                    pass

    def usages(self) -> list[KVUsage]:
        return [usage_of(s, t) for t, s in self.states]


@contextlib.asynccontextmanager
async def sampling(server: str | None, period: float = KV_SAMPLE_PERIOD_S):
    """Samples the server's KV pool every `period` seconds while the block runs, and once after; yields the
    KVSampler (None without a server: an OpenAI-compatible peer has no GetKVState)."""
    if server is None:
        yield None
        return
    sampler = KVSampler(server, now(), period)
    stop = asyncio.Event()
    task = asyncio.create_task(sampler.run(stop))
    try:
        yield sampler
    finally:
        stop.set()
        await task


def summarize_usage(usages: list[KVUsage]) -> dict:
    """Time-averaged figures over the samples where anything ran or waited (samples are evenly spaced).

    waste = 1 - filled / (reserved + stranded): the share of the KV memory that the run tied up (held by
    sequences, or free but unusable by the waiting ones) without holding a token.
    """
    busy = [u for u in usages if u.num_running or u.num_waiting]
    if not busy:
        return {"samples": 0, "waste": None, "internal": None, "external": None, "mean_running": None,
                "peak_running": 0}
    reserved, filled, stranded = (sum(getattr(u, k) for u in busy) for k in ("reserved", "filled", "stranded"))
    tied = reserved + stranded
    return {"samples": len(busy),
            "waste": waste_share(reserved, filled, stranded),
            "internal": (reserved - filled) / tied if tied else 0.0,  # reserved slots without a token
            "external": stranded / tied if tied else 0.0,
            "mean_running": sum(u.num_running for u in busy) / len(busy),
            "peak_running": max(u.num_running for u in busy),
            "mean_reserved_slots": reserved / len(busy), "mean_filled_slots": filled / len(busy)}
