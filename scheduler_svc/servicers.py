"""gRPC servicers of the scheduler service: they parse, call the engine, answer."""

from __future__ import annotations

import asyncio

import grpc

from pagedserve.v1 import generate_pb2_grpc, worker_pb2_grpc
from scheduler_svc import convert
from scheduler_svc.engine import Engine
from scheduler_svc.errors import EngineError


async def _abort(context, e: EngineError) -> None:
    await context.abort(getattr(grpc.StatusCode, e.code.value), str(e))


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def Generate(self, request, context):
        kind = request.WhichOneof("input")
        if kind is None:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "one of prompt or prompt_token_ids must be set")
        ids = (list(request.prompt_token_ids.ids) if kind == "prompt_token_ids"
               else self.engine.tokenizer.encode(request.prompt))
        if not ids:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"{kind} is empty")
        sampling, stop = convert.sampling_from_pb(request.sampling)
        try:
            stream = self.engine.submit(request.request_id, ids, sampling, stop, request.cache_salt)
        except EngineError as e:
            await _abort(context, e)
        rid, done = stream.request.request_id, False
        try:
            async for item in stream:
                yield convert.item_to_pb(rid, item)
            done = True
        except EngineError as e:
            done = True
            await _abort(context, e)
        finally:
            if not done:  # the client cancelled or its deadline passed: free its blocks
                self.engine.abort(rid)

    async def GetModelInfo(self, request, context):
        cfg = self.engine.config
        return convert.model_info_to_pb(cfg.model_id, cfg.max_model_len, self.engine.workers)


class WorkerControlServicer(worker_pb2_grpc.WorkerControlServicer):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def Attach(self, request_iterator, context):
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("kind") != "registration":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message must be a registration")
        try:
            handle = self.engine.attach_worker(convert.registration_from_pb(first.registration))
        except EngineError as e:
            await _abort(context, e)

        async def read_messages() -> None:
            reason = "its stream ended"
            try:
                async for msg in request_iterator:
                    kind = msg.WhichOneof("kind")
                    if kind == "result":
                        handle.inbox.put_nowait(msg.result)
                    elif kind == "error":
                        handle.inbox.put_nowait(convert.step_error_from_pb(msg.error))
                    elif kind == "leaving":
                        self.engine.worker_leaving(handle, msg.leaving.reason)
            except grpc.RpcError as e:  # NOTE: keepalive found the peer dead, or the connection broke
                reason = f"its stream broke ({e.code().name})"
            finally:
                self.engine.lose_worker(handle, "stream", reason)

        reader = asyncio.get_running_loop().create_task(read_messages())
        try:
            while (plan := await handle.outbox.get()) is not None:
                yield plan
        finally:
            reader.cancel()
            self.engine.lose_worker(handle, "stream", "its stream ended")
