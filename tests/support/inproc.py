"""An in-process scheduler server on loopback, with scripted workers that attach over the real Attach stream, and
its HTTP front (Front)."""

from __future__ import annotations

import asyncio
import functools

import grpc
import httpx
import pytest

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc, worker_pb2, worker_pb2_grpc
from scheduler_svc.auth import ApiKeyInterceptor, ApiKeys
from scheduler_svc.engine import Engine, EngineConfig
from scheduler_svc.grpc.servicers import GenerationServicer, WorkerControlServicer, add_generation_servicer
from scheduler_svc.frontend import FrontEnd, Tokenizer
from scheduler_svc.http.app import create_app
from scheduler_svc.http.connections import ConnectionLimits
from scheduler_svc.http.server import HttpServer
from pagedserve_common.ports import free_port
from tests.support.network import default_model_dir

TOKEN = 7  # what a ScriptedWorker samples, for every sequence
EOS = 2  # SmolLM2's <|im_end|>: the engine stops on it (eos_token_ids)
# A Hermes answer with text and two tool calls (a Speaker speaks it)
HERMES = ('I will look it up.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
          '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Lyon"}}\n</tool_call>')


@functools.cache
def tokenizer() -> Tokenizer:
    return Tokenizer.from_model_dir(default_model_dir())


def with_server(api_keys: list[str] | ApiKeys | None = None, **engine_kwargs):
    """Runs an async test against a real gRPC server in this process: test(engine, channel). With `api_keys`, the
    client API requires one (scheduler_svc.auth.ApiKeyInterceptor); an ApiKeys may name them (tenants)."""
    config = {"model_id": "m", "max_model_len": 128, "vocab_size": 49152, "max_num_seqs": 1,
              "max_queued_requests": 2, "no_worker_timeout": 0, **engine_kwargs}

    def wrap(test):
        def run():
            async def main():
                engine = Engine(EngineConfig(**config))
                keys = api_keys if isinstance(api_keys, ApiKeys) or not api_keys else ApiKeys.of(api_keys)
                interceptors = [ApiKeyInterceptor(keys)] if keys else None
                server, address = grpc.aio.server(interceptors=interceptors), f"127.0.0.1:{free_port()}"
                servicer = GenerationServicer(FrontEnd(engine, tokenizer()), keys or None)
                add_generation_servicer(servicer, server)
                worker_pb2_grpc.add_WorkerControlServicer_to_server(WorkerControlServicer(engine), server)
                server.add_insecure_port(address)
                await server.start()
                try:
                    async with grpc.aio.insecure_channel(address) as channel:
                        await asyncio.wait_for(test(engine, channel), 60)
                finally:
                    await server.stop(0)
            asyncio.run(main())
        run.__name__, run.__doc__ = test.__name__, test.__doc__  # NOTE: not functools.wraps: pytest would read
        return run                                                 # the wrapped signature as fixtures
    return wrap


class ScriptedWorker:
    """Registers over the real Attach stream. With `answer`, it answers every plan, sampling TOKEN for every
    sequence that finished its known tokens (reply); otherwise it stays silent. Every plan it receives is kept."""

    def __init__(self, channel, model_id: str = "m", answer: bool = False, num_blocks: int = 64,
                 name: str = "") -> None:
        self.queue: asyncio.Queue = asyncio.Queue()
        self.queue.put_nowait(worker_pb2.WorkerMessage(registration=worker_pb2.WorkerRegistration(
            model_id=model_id, max_model_len=128, device="cpu", num_blocks=num_blocks, name=name,
            kv_geometry=worker_pb2.KVGeometry(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float32",
                                              block_size=16))))
        self.answer = answer
        self.call = worker_pb2_grpc.WorkerControlStub(channel).Attach(self._messages())
        self.plans: list = []
        self.lengths: dict[int, list[int]] = {}  # seq_id -> [known tokens, computed]: who samples (reply)
        self.error: grpc.RpcError | None = None
        self.ended = False  # the scheduler ended the stream (OK status)
        self.reader = asyncio.get_running_loop().create_task(self._read())

    async def _messages(self):
        while (msg := await self.queue.get()) is not None:
            yield msg

    async def _read(self) -> None:
        try:
            async for plan in self.call:
                self.plans.append(plan)
                if self.answer:
                    self.reply(plan)
            self.ended = True
        except grpc.RpcError as e:
            self.error = e

    def reply(self, plan) -> None:
        """Samples TOKEN for each sequence that reaches the end of its known tokens, as a real worker does (the
        scheduler refuses an answer with any other sequence's token)."""
        result = worker_pb2.StepResult(step_id=plan.step_id)
        for seq_id in (*plan.finished_seq_ids, *plan.preempted_seq_ids):
            self.lengths.pop(seq_id, None)
        for n in plan.new_seqs:
            self.lengths[n.seq_id] = [len(n.token_ids), n.num_computed_tokens]
        for s in (*plan.new_seqs, *plan.running):
            length = self.lengths[s.seq_id]  # [known tokens, computed]
            length[1] += s.num_scheduled_tokens
            if length[1] >= length[0]:
                result.tokens.add(seq_id=s.seq_id, token_id=self.next_token(s.seq_id, length[0]))
                length[0] += 1
        self.queue.put_nowait(worker_pb2.WorkerMessage(result=result))

    def next_token(self, seq_id: int, num_tokens: int) -> int:
        """The token sampled for sequence `seq_id` after its first `num_tokens` (prompt and output)."""
        return TOKEN

    def fail_step(self, plan, kind=worker_pb2.StepError.STEP_FAILED, message: str = "boom") -> None:
        self.queue.put_nowait(worker_pb2.WorkerMessage(error=worker_pb2.StepError(
            step_id=plan.step_id, kind=kind, message=message)))

    def leave(self) -> None:
        self.queue.put_nowait(worker_pb2.WorkerMessage(leaving=worker_pb2.Leaving(reason="SIGTERM")))

    def close(self) -> None:
        self.call.cancel()

    def seq_ids(self) -> set[int]:
        return {n.seq_id for p in self.plans for n in p.new_seqs}


async def wait_for(cond) -> None:
    while not cond():
        await asyncio.sleep(0.01)


def generate(channel, request_id: str = "", ids=(5, 6, 7), max_tokens: int = 4, **sampling):
    return generate_pb2_grpc.GenerationStub(channel).Generate(pb.GenerateRequest(
        request_id=request_id, prompt_token_ids=ids,
        sampling=pb.SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sampling)))


async def status_of(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        while (await call.read()) is not grpc.aio.EOF:
            pass
        raise AssertionError("the call ended without an error")
    return e.value.code(), e.value.details()


async def tokens_of(call) -> list[list[int]]:
    """Every streamed token of a call, one list per sample; raises if it ends with an error."""
    out: dict[int, list[int]] = {}
    async for msg in call:
        out.setdefault(msg.index, []).extend(msg.token_ids)
    return [out[i] for i in sorted(out)]


class Front:
    """The HTTP front of `engine` on a free loopback port, as the scheduler runs it (same event loop)."""

    def __init__(self, engine, tok: Tokenizer | None = None, **app_kwargs) -> None:
        """`tok`: the model's tokenizer and chat template (the default model's); `app_kwargs` go to create_app."""
        app = create_app(FrontEnd(engine, tok or tokenizer()), **app_kwargs)
        self.http = HttpServer(app, f"127.0.0.1:{free_port()}",
                               ConnectionLimits(max_connections=64, header_timeout=10.0, body_timeout=30.0))
        self.client = httpx.AsyncClient(base_url=f"http://{self.http.address}", timeout=30)

    async def __aenter__(self) -> httpx.AsyncClient:
        await self.http.start()
        return self.client

    async def __aexit__(self, *exc) -> None:
        await self.client.aclose()
        await self.http.stop()


class Speaker(ScriptedWorker):
    """Answers every plan; each sequence's output is `answer`'s tokens, then EOS."""

    def __init__(self, channel, answer: str) -> None:
        super().__init__(channel, answer=True)
        self.script = [*tokenizer().encode(answer, add_special_tokens=False), EOS]
        self.num_prompt_tokens: dict[int, int] = {}

    def reply(self, plan) -> None:
        for n in plan.new_seqs:
            self.num_prompt_tokens.setdefault(n.seq_id, n.num_prompt_tokens)
        super().reply(plan)

    def next_token(self, seq_id: int, num_tokens: int) -> int:
        return self.script[min(num_tokens - self.num_prompt_tokens[seq_id], len(self.script) - 1)]
