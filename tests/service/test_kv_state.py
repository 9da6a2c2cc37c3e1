"""GetKVState and `pagedserve kv-map`: scripted workers in process (exact block ids), then a real scheduler and
worker over the tiny model (a streaming request's table as it grows, prefix sharing, the CLI's frame)."""

from __future__ import annotations

import asyncio
import random
import re
import subprocess
import sys
import threading
import time

import grpc
import pytest

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc
from scheduler_svc.auth import ApiKeyInterceptor, ApiKeys
from scheduler_svc.engine import Engine, EngineConfig
from scheduler_svc.frontend import FrontEnd
from scheduler_svc.grpc.servicers import GenerationServicer, add_generation_servicer
from tests.support.service import KV_MEMORY
from tests.support.inproc import ScriptedWorker, generate, tokenizer, wait_for, with_server

PROMPT = list(range(100, 140))  # 40 tokens: 2 full blocks of 16 and 8 tokens
HANG_GUARD = 120  # seconds; never a measure of speed


async def kv_state(channel, worker_id: str = "") -> pb.KVState:
    return await generate_pb2_grpc.GenerationStub(channel).GetKVState(pb.GetKVStateRequest(worker_id=worker_id))


async def kv_error(channel, worker_id: str = "") -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await kv_state(channel, worker_id)
    return e.value.code(), e.value.details()


# -- in process, scripted workers: every step is answered by hand ------------------------------------------------
@with_server()
async def test_no_worker_is_unavailable_and_an_unknown_worker_not_found(engine, channel):
    assert await kv_error(channel) == (grpc.StatusCode.UNAVAILABLE, "no worker is attached yet")
    ScriptedWorker(channel)
    await wait_for(lambda: engine.workers)
    code, details = await kv_error(channel, "worker-9")
    assert code == grpc.StatusCode.NOT_FOUND
    assert details == "worker_id 'worker-9' is not attached (attached: worker-0)"
    state = await kv_state(channel, "worker-0")
    assert (state.worker_id, state.block_size, state.num_blocks, state.kv_allocation) == ("worker-0", 16, 64, "paged")
    assert state.ref_counts == bytes(64) and state.cached == bytes(64) and not state.sequences


@with_server(max_num_seqs=4)
async def test_two_requests_with_one_prompt_share_its_full_blocks_then_free_them(engine, channel):
    worker = ScriptedWorker(channel)
    await wait_for(lambda: engine.workers)
    a = generate(channel, "a", PROMPT, max_tokens=50)
    await wait_for(lambda: len(worker.plans) == 1)
    state = await kv_state(channel)  # step 0 in flight: a's prompt
    assert [(s.request_id, list(s.block_ids), s.num_tokens) for s in state.sequences] == [("a", [0, 1, 2], 40)]
    assert state.ref_counts[:4] == bytes([1, 1, 1, 0]) and state.cached[:4] == bytes([1, 1, 0, 0])
    assert (state.num_steps, state.num_waiting, state.prefix_query_tokens, state.prefix_hit_tokens) == (1, 0, 40, 0)
    worker.reply(worker.plans[0])
    await wait_for(lambda: len(worker.plans) == 2)  # step 1: a decodes
    b = generate(channel, "b", PROMPT, max_tokens=50)
    await wait_for(lambda: engine.workers["worker-0"].scheduler.num_waiting == 1)
    state = await kv_state(channel)
    assert [s.request_id for s in state.sequences] == ["a"] and state.num_waiting == 1
    worker.reply(worker.plans[1])
    await wait_for(lambda: len(worker.plans) == 3)  # step 2: a decodes, b is admitted on a prefix hit
    state = await kv_state(channel)
    assert [(s.request_id, list(s.block_ids), s.num_tokens) for s in state.sequences] == \
        [("a", [0, 1, 2], 42), ("b", [0, 1, 3], 40)]
    assert state.ref_counts[:5] == bytes([2, 2, 1, 1, 0]) and state.cached[:5] == bytes([1, 1, 0, 0, 0])
    assert (state.prefix_query_tokens, state.prefix_hit_tokens, state.num_steps) == (80, 32, 3)
    a.cancel()
    b.cancel()
    await wait_for(lambda: not engine.streams)
    state = await kv_state(channel)
    assert not state.sequences and state.ref_counts == bytes(64)
    assert state.cached[:4] == bytes([1, 1, 0, 0])  # freed, still findable by a prefix hit


def test_the_api_key_interceptor_covers_get_kv_state():
    async def main():
        from pagedserve_common.ports import free_port

        engine = Engine(EngineConfig(model_id="m", max_model_len=128, vocab_size=49152, no_worker_timeout=0))
        server = grpc.aio.server(interceptors=[ApiKeyInterceptor(ApiKeys.of(["k1"]))])
        add_generation_servicer(GenerationServicer(FrontEnd(engine, tokenizer())), server)
        address = f"127.0.0.1:{free_port()}"
        server.add_insecure_port(address)
        await server.start()
        try:
            async with grpc.aio.insecure_channel(address) as channel:
                stub = generate_pb2_grpc.GenerationStub(channel)
                for metadata, code in (((), grpc.StatusCode.UNAUTHENTICATED),
                                       ((("authorization", "Bearer k2"),), grpc.StatusCode.UNAUTHENTICATED),
                                       ((("authorization", "Bearer k1"),), grpc.StatusCode.UNAVAILABLE)):
                    with pytest.raises(grpc.aio.AioRpcError) as e:
                        await stub.GetKVState(pb.GetKVStateRequest(), metadata=metadata)
                    assert e.value.code() == code
        finally:
            await server.stop(0)
    asyncio.run(asyncio.wait_for(main(), 60))


# -- a real scheduler and worker over the tiny model ---------------------------------------------------------------
@pytest.fixture(scope="module")
def kv(service):
    """GetKVState over one channel (polls should not each connect anew)."""
    with service.channel() as ch:
        stub = generate_pb2_grpc.GenerationStub(ch)
        yield lambda worker_id="": stub.GetKVState(pb.GetKVStateRequest(worker_id=worker_id), timeout=30)


class Streaming:
    """One streamed request read on a thread; `count` is how many tokens have arrived so far."""

    def __init__(self, service, request_id: str, prompt: list[int], max_tokens: int) -> None:
        self.channel = service.channel()
        self.call = generate_pb2_grpc.GenerationStub(self.channel).Generate(pb.GenerateRequest(
            request_id=request_id, prompt_token_ids=prompt,
            sampling=pb.SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)), timeout=HANG_GUARD)
        self.count, self.done, self.error = 0, threading.Event(), None
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        try:
            for msg in self.call:
                self.count += len(msg.token_ids)
        except grpc.RpcError as e:
            self.error = e
        finally:
            self.done.set()

    def close(self) -> None:
        self.call.cancel()
        self.done.wait(HANG_GUARD)
        self.channel.close()


def poll(kv, until, what: str) -> pb.KVState:
    """GetKVState until `until(state)`; the deadline only guards against a hang."""
    deadline = time.monotonic() + HANG_GUARD
    while time.monotonic() < deadline:
        state = kv()
        if until(state):
            return state
        time.sleep(0.002)
    raise AssertionError(f"no snapshot showed {what} within {HANG_GUARD} s")


def sequence(state: pb.KVState, request_id: str):
    return next((s for s in state.sequences if s.request_id == request_id), None)


def random_prompt(seed: int, n: int = 40) -> list[int]:
    return [random.Random(seed).randrange(3, 49152) for _ in range(n)]


def test_a_streaming_requests_table_grows_with_its_tokens_then_is_freed_and_cached(service, kv):
    with service.channel() as ch:
        info = generate_pb2_grpc.GenerationStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=30)
    worker = info.workers[0]
    idle = poll(kv, lambda s: not s.sequences and not s.num_waiting, "an idle pool")
    assert (idle.worker_id, idle.block_size, idle.num_blocks) == (worker.worker_id, info.block_size, worker.num_blocks)
    assert (idle.num_blocks, idle.block_size) == (KV_MEMORY // (16 * 512), 16)
    assert len(idle.ref_counts) == len(idle.cached) == idle.num_blocks and idle.kv_allocation == "paged"
    prompt, new = random_prompt(1), 200
    with service.worker_paused():  # NOTE: so that a loaded machine cannot let it end before the first snapshot
        stream = Streaming(service, "long", prompt, new)
        poll(kv, lambda s: sequence(s, "long") is not None, "the request admitted")
    last = None
    try:
        while True:
            streamed = stream.count  # before the snapshot: the server had produced at least these
            state = kv()
            seq = sequence(state, "long")
            if seq is None:
                if last is not None or stream.done.is_set():
                    break  # finished
                continue
            assert [s.request_id for s in state.sequences] == ["long"]
            # The prompt is one step (<= 64 tokens), then one token per step: the table covers every token but
            # the one the step in flight (or the last step) sampled.
            steps = state.num_steps - idle.num_steps
            assert seq.num_tokens == len(prompt) + steps - 1
            assert streamed <= seq.num_tokens - len(prompt) + 1
            assert len(seq.block_ids) == -(-seq.num_tokens // 16)
            assert all(state.ref_counts[b] == 1 for b in seq.block_ids)
            assert sum(state.ref_counts) == len(seq.block_ids)
            if last is not None:  # append-only while it runs
                assert list(seq.block_ids[:len(last.block_ids)]) == list(last.block_ids)
            last = seq
            time.sleep(0.005)
        # NOTE: the request leaves the pool before the reader thread may have read its last tokens: a cancel now
        # would cut them off (seen on a loaded machine)
        stream.done.wait(HANG_GUARD)
    finally:
        stream.close()
    assert stream.error is None and stream.count == new and last is not None
    end = poll(kv, lambda s: not s.sequences, "the request's blocks freed")
    assert end.ref_counts == bytes(end.num_blocks)
    assert all(end.cached[b] == 1 for b in last.block_ids[:len(prompt) // 16])  # the full prompt blocks


def test_a_second_request_with_the_same_prompt_shares_the_full_prompt_blocks(service, kv):
    prompt = random_prompt(2)
    before = poll(kv, lambda s: not s.sequences, "an idle pool")
    # NOTE: a runs to max_model_len (512 tokens: 32 of the 40 blocks), b fits beside it (8 blocks, 2 shared).
    # The worker is paused while a's first step is in flight and b queues, so b is admitted in the step after
    # a's prefill, whatever the load: a cannot have ended by then.
    a = b = None
    try:
        with service.worker_paused():
            a = Streaming(service, "a", prompt, 512 - len(prompt))
            poll(kv, lambda s: sequence(s, "a") is not None, "a running")
            b = Streaming(service, "b", prompt, 80)
            poll(kv, lambda s: s.num_waiting == 1, "b queued")
        state = poll(kv, lambda s: sequence(s, "b") is not None, "b running")
        sa, sb = sequence(state, "a"), sequence(state, "b")
        assert sa is not None, "a ended before b was admitted"
        assert list(sb.block_ids[:2]) == list(sa.block_ids[:2])
        assert [state.ref_counts[x] for x in sa.block_ids[:2]] == [2, 2]
        assert all(state.ref_counts[x] == 1 for x in [*sa.block_ids[2:], *sb.block_ids[2:]])
        assert state.prefix_hit_tokens - before.prefix_hit_tokens >= 32
    finally:
        for x in (a, b):
            if x is not None:
                x.close()
    end = poll(kv, lambda s: not s.sequences, "both freed")
    assert end.ref_counts == bytes(end.num_blocks)


def kv_map(service, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagedserve_cli.main", "kv-map", "--server", service.address,
                           *args], capture_output=True, text=True, timeout=HANG_GUARD)


def test_kv_map_once_prints_the_figures_and_one_cell_per_block(service, kv):
    from pagedserve_cli.kv_render import GLYPHS

    poll(kv, lambda s: not s.sequences, "an idle pool")
    done = kv_map(service, "--once", "--width", "16")
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert "\x1b" not in out  # not a terminal: no colours
    for words in ("worker-0", "kv allocation paged", "block size 16 tokens · 40 blocks · float32 cache (512 B/token) · 1 cell = 1 block",
                  "used 0 (0 shared) · free 40", "running 0 · waiting 0", "internal fragmentation 0.0%",
                  "external fragmentation 0.0%: largest free run 40 of 40 free blocks", "prefix cache: hit",
                  "evictions", "preemptions"):
        assert words in out, words
    rows = [m.group(1) for line in out.splitlines()
            if (m := re.fullmatch(r"\s*\d+ (\S+)", line)) and set(m.group(1)) <= GLYPHS]
    assert [len(r) for r in rows] == [16, 16, 8] and set("".join(rows)) <= {"·", "░"}


def test_kv_map_names_an_unknown_worker(service):
    done = kv_map(service, "--once", "--worker", "worker-9")
    assert done.returncode == 1 and "NOT_FOUND" in done.stderr and "worker_id 'worker-9'" in done.stderr


@pytest.mark.parametrize("inherited", ["default", "ignored"])
@pytest.mark.parametrize("stop", ["SIGINT", "SIGTERM"])
def test_kv_map_live_redraws_in_a_terminal_until_stopped(service, kv, inherited, stop):
    """Live mode in a pseudo-terminal: it redraws, and Ctrl-C (or SIGTERM) ends it with status 0 and the cursor
    shown again. `ignored`: started with SIGINT ignored, as a non-interactive shell starts a background job (and
    as CI may start this suite); Python keeps that disposition, so kv-map must install its own handler."""
    import os
    import pty
    import select
    import signal

    from pagedserve_cli.kv_map_cmd import HIDE_CURSOR, SHOW_CURSOR

    master, slave = pty.openpty()
    argv = [sys.executable, "-m", "pagedserve_cli.main", "kv-map", "--server", service.address, "--interval", "0.05",
            "--width", "16"]
    if inherited == "ignored":  # as a shell does it: an ignored disposition survives exec
        argv = ["sh", "-c", 'trap "" INT; exec "$0" "$@"', *argv]
    proc = subprocess.Popen(argv, stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    out, deadline = b"", time.monotonic() + HANG_GUARD

    def read_until(done) -> None:
        """Reads the terminal until done() or the child closes it. NOTE: it keeps reading while it waits, so a
        child writing frames never blocks on a full terminal."""
        nonlocal out
        while not done() and time.monotonic() < deadline:
            if select.select([master], [], [], 0.5)[0]:
                try:
                    chunk = os.read(master, 65536)
                except OSError:  # EIO: every writer closed the terminal, as the child does when it exits
                    return
                if not chunk:
                    return
                out += chunk

    try:
        read_until(lambda: out.count(b"pagedserve kv-map") >= 2)  # two frames: it redraws
        assert out.startswith(HIDE_CURSOR.encode()) and out.count(b"\x1b[H") >= 2
        proc.send_signal(signal.SIGINT if stop == "SIGINT" else signal.SIGTERM)
        read_until(lambda: proc.poll() is not None)
        read_until(lambda: False)  # what it wrote before it exited
        assert proc.wait(HANG_GUARD) == 0
    finally:
        proc.kill()
        os.close(master)
    assert SHOW_CURSOR.encode() in out[-64:] and b"Traceback" not in out
