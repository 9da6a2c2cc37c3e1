"""gRPC servicers of the scheduler service: they parse, call the front end (clients) or the engine (workers), answer."""

from __future__ import annotations

import asyncio

import grpc
import structlog

from pagedserve.v1 import generate_pb2_grpc, worker_pb2_grpc
from pagedserve_common import wire
from scheduler_svc import request_log
from scheduler_svc.engine import Engine
from scheduler_svc.errors import EngineError, ErrorCode
from scheduler_svc.frontend.api import FrontEnd
from scheduler_svc.grpc import convert
from scheduler_svc.fleet import Lost, bad_result

log = structlog.get_logger("pagedserve.scheduler")


async def _abort(context, e: EngineError) -> None:
    await context.abort(getattr(grpc.StatusCode, e.code.value), str(e))


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    def __init__(self, frontend: FrontEnd) -> None:
        self.frontend = frontend

    async def Generate(self, request, context):
        try:
            stream = await self.frontend.generate(convert.input_from_pb(request, self.frontend.limits))
        except EngineError as e:
            request_log.rejected("grpc", e, request.request_id)
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
                self.frontend.abort(rid)

    async def GetModelInfo(self, request, context):
        f = self.frontend
        return convert.model_info_to_pb(f.model_id, f.max_model_len, f.vocab_size, f.max_n, f.engine.workers)

    async def GetKVState(self, request, context):
        try:
            return convert.kv_state_to_pb(self.frontend.kv_state(request.worker_id))
        except EngineError as e:
            await _abort(context, e)


class WorkerControlServicer(worker_pb2_grpc.WorkerControlServicer):
    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    async def Attach(self, request_iterator, context):
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("kind") != "registration":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message must be a registration")
        try:
            try:
                reg = wire.registration_from_pb(first.registration)
            except ValueError as e:
                raise EngineError(ErrorCode.INVALID_ARGUMENT, f"registration: {e}") from None
            handle = self.engine.attach_worker(reg)
        except EngineError as e:
            log.warning("worker refused", name=first.registration.name, status=e.code.value, message=str(e))
            await _abort(context, e)

        async def read_messages() -> None:
            reason = "its stream ended"
            try:
                async for msg in request_iterator:
                    kind = msg.WhichOneof("kind")
                    if kind == "result":
                        try:
                            handle.inbox.put_nowait(wire.result_from_pb(msg.result))
                        except ValueError as e:  # NOTE: as any wrong answer (Engine._receive): lost, uncharged
                            handle.inbox.put_nowait(bad_result(msg.result.step_id, str(e)))
                    elif kind == "error":
                        handle.inbox.put_nowait(wire.step_error_from_pb(msg.error))
                    elif kind == "leaving":
                        self.engine.worker_leaving(handle, msg.leaving.reason)
            except grpc.RpcError as e:  # NOTE: keepalive found the peer dead, or the connection broke
                reason = f"its stream broke ({e.code().name})"
            finally:
                handle.fail(Lost("stream", reason))

        reader = asyncio.get_running_loop().create_task(read_messages())
        try:
            while (plan := await handle.outbox.get()) is not None:
                yield wire.plan_to_pb(plan)
        finally:
            reader.cancel()
            handle.fail(Lost("stream", "its stream ended"))
