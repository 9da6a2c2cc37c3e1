"""gRPC servicers of the scheduler service: they parse, call the front end (clients) or the engine (workers), answer."""

from __future__ import annotations

import asyncio

import grpc
import structlog

from pagedserve.v1 import generate_pb2, generate_pb2_grpc, worker_pb2_grpc
from pagedserve_common import wire
from pagedserve_common.config import UP_NONCE_METADATA
from scheduler_svc import request_log
from scheduler_svc.auth import ApiKeys
from scheduler_svc.engine import Engine
from scheduler_svc.errors import EngineError, ErrorCode
from scheduler_svc.frontend.api import FrontEnd
from scheduler_svc.grpc import convert
from scheduler_svc.fleet import Lost, bad_result
from scheduler_svc.tracing import grpc_trace_headers
from scheduler_svc.worker_auth import WorkerTokens, other_up

log = structlog.get_logger("pagedserve.scheduler")


def peer_of(context, original_peer=None) -> dict[str, str]:
    """{'peer': the caller's address, 'subject': its client certificate's subject (mutual TLS only)};
    `original_peer`: a ConnectionGate's, for a relayed connection."""
    origin = {"peer": original_peer(context.peer()) if original_peer else context.peer()}
    auth = context.auth_context() or {}
    if subject := (auth.get("x509_subject") or auth.get("x509_common_name") or [b""])[0]:
        origin["subject"] = subject.decode(errors="replace") if isinstance(subject, bytes) else str(subject)
    return origin


async def _abort(context, e: EngineError) -> None:
    await context.abort(getattr(grpc.StatusCode, e.code.value), str(e))


async def _refuse_undecodable(request, context) -> None:
    if isinstance(request, convert.Undecodable):
        e = EngineError(ErrorCode.INVALID_ARGUMENT, request.message, request.field)
        request_log.rejected("grpc", e, request.request_id)
        await _abort(context, e)


# (method, request type, response type, handler kind) of pagedserve.v1.Generation
GENERATION_METHODS = (
    ("Generate", generate_pb2.GenerateRequest, generate_pb2.GenerateResponse, grpc.unary_stream_rpc_method_handler),
    ("GetModelInfo", generate_pb2.GetModelInfoRequest, generate_pb2.GetModelInfoResponse,
     grpc.unary_unary_rpc_method_handler),
    ("GetKVState", generate_pb2.GetKVStateRequest, generate_pb2.KVState, grpc.unary_unary_rpc_method_handler),
)


def add_generation_servicer(servicer: GenerationServicer, server) -> None:
    """generate_pb2_grpc.add_GenerationServicer_to_server, with requests parsed by convert.lenient: a message that
    does not parse (a string that is not UTF-8) reaches the servicer as an Undecodable, refused INVALID_ARGUMENT
    naming the field, instead of failing in grpc's deserializer (UNKNOWN, and a traceback in the log)."""
    handlers = {name: make(getattr(servicer, name), request_deserializer=convert.lenient(request_type),
                           response_serializer=response_type.SerializeToString)
                for name, request_type, response_type, make in GENERATION_METHODS}
    service = generate_pb2.DESCRIPTOR.services_by_name["Generation"].full_name
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(service, handlers),))
    server.add_registered_method_handlers(service, handlers)


class GenerationServicer(generate_pb2_grpc.GenerationServicer):
    """Served with add_generation_servicer: a request may be a convert.Undecodable."""

    def __init__(self, frontend: FrontEnd, api_keys: ApiKeys | None = None) -> None:
        self.frontend = frontend
        self.api_keys = api_keys  # NOTE: checked by ApiKeyInterceptor; here for the key's name (the tenant)

    async def Generate(self, request, context):
        await _refuse_undecodable(request, context)
        try:
            inp = convert.input_from_pb(request, self.frontend.limits, self.frontend.sampling_defaults)
            metadata = context.invocation_metadata()
            identity = convert.identity_of(metadata, self.api_keys)
            inp.tenant, inp.max_priority = convert.tenant_of(metadata, identity), identity.max_priority
            stream = await self.frontend.generate(inp, None
                                                  if self.frontend.tracing is None else
                                                  grpc_trace_headers(context.invocation_metadata()))
        except EngineError as e:
            request_log.rejected("grpc", e, request.request_id)
            await _abort(context, e)
        # NOTE: the engine knows the request by its tenant-scoped id; the client, by the id it sent (or was given)
        key, rid, done = stream.request.request_id, stream.request.client_request_id, False
        try:
            async for item in stream:
                yield convert.item_to_pb(rid, item)
            done = True
        except EngineError as e:
            done = True
            await _abort(context, e)
        finally:
            if not done:  # the client cancelled or its deadline passed: free its blocks
                self.frontend.abort(key)

    async def GetModelInfo(self, request, context):
        await _refuse_undecodable(request, context)
        f = self.frontend
        return convert.model_info_to_pb(f.model_id, f.max_model_len, f.vocab_size, f.max_n, f.model_workers())

    async def GetKVState(self, request, context):
        await _refuse_undecodable(request, context)
        try:
            metadata = context.invocation_metadata()
            identity = convert.identity_of(metadata, self.api_keys)
            # NOTE: a caller sees its own tenant's sequences (ids, token counts), an operator every tenant's
            tenant = None if identity.sees_all else convert.tenant_of(metadata, identity)
            return convert.kv_state_to_pb(self.frontend.kv_state(request.worker_id, tenant))
        except EngineError as e:
            await _abort(context, e)


class WorkerControlServicer(worker_pb2_grpc.WorkerControlServicer):
    """With `tokens`, a worker attaches only with a valid `authorization: Bearer TOKEN`; with `up_nonce` (this
    scheduler was started by `pagedserve up`), not when it presents another up's nonce (worker_auth)."""

    def __init__(self, engine: Engine, tokens: WorkerTokens | None = None, up_nonce: str | None = None) -> None:
        self.engine = engine
        self.tokens = tokens
        self.up_nonce = up_nonce
        self.original_peer = None  # the port's ConnectionGate's, when it has one

    async def _authenticate(self, context) -> dict[str, str]:
        """Who is attaching, for the log (peer, the certificate's subject, the token's id); aborts, before anything
        the peer sent is read, with UNAUTHENTICATED when a token is required and not valid, and with
        FAILED_PRECONDITION (which the worker exits on: retrying cannot help) when another `up` started it."""
        origin = peer_of(context, self.original_peer)
        metadata = context.invocation_metadata() or ()
        if self.tokens is not None:
            token, why = self.tokens.check([v for k, v in metadata if k == "authorization"])
            if why is not None:
                log.warning("worker refused", status="UNAUTHENTICATED", message=why, **origin)
                await context.abort(grpc.StatusCode.UNAUTHENTICATED, why)
            origin["token_id"] = token
        if (why := other_up(self.up_nonce, [v for k, v in metadata if k == UP_NONCE_METADATA])) is not None:
            log.warning("worker refused", status="FAILED_PRECONDITION", message=why, **origin)
            await context.abort(grpc.StatusCode.FAILED_PRECONDITION, why)
        return origin

    async def Attach(self, request_iterator, context):
        origin = await self._authenticate(context)
        first = await anext(aiter(request_iterator), None)
        if first is None or first.WhichOneof("kind") != "registration":
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "the first message must be a registration")
        try:
            try:
                reg = wire.registration_from_pb(first.registration)
            except ValueError as e:
                raise EngineError(ErrorCode.INVALID_ARGUMENT, f"registration: {e}") from None
            handle = self.engine.attach_worker(reg, origin)
        except EngineError as e:
            log.warning("worker refused", name=first.registration.name, status=e.code.value, message=str(e),
                        **origin)
            await _abort(context, e)

        async def read_messages() -> None:
            reason = "its stream ended"
            try:
                async for msg in request_iterator:
                    kind = msg.WhichOneof("kind")
                    if kind == "result":
                        try:
                            handle.inbox.put_nowait(wire.result_from_pb(msg.result))
                        except ValueError as e:  # NOTE: as any wrong answer (StepLoop._receive): lost, uncharged
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
                handle.plan_sent.set()  # NOTE: the generator resumes once gRPC has written the message
        finally:
            reader.cancel()
            handle.fail(Lost("stream", "its stream ended"))
