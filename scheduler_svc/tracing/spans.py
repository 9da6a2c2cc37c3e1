"""A request's trace: moments noted as it runs, its spans (request; queued, prefill, decode, migrated) written once
at its end, with OpenTelemetry's GenAI attribute names. Imported only with --otlp-endpoint (scheduler_svc.tracing)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.trace import SpanKind, Status, StatusCode
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from scheduler_svc.core.request import FinishReason
from scheduler_svc.errors import EngineError

if TYPE_CHECKING:
    from scheduler_svc.core.step import ScheduledStep
    from scheduler_svc.fleet import WorkerHandle
    from scheduler_svc.frontend.inputs import GenerateInput
    from scheduler_svc.frontend.stream import RequestStream

SERVICE = "pagedserve-scheduler"  # service.name unless OTEL_SERVICE_NAME or OTEL_RESOURCE_ATTRIBUTES names one
FINISH_REASONS = {FinishReason.LENGTH: "length", FinishReason.STOP: "stop", FinishReason.STOP_STRING: "stop",
                  FinishReason.ABORT: "abort"}  # the OpenAI API's words, as the HTTP front answers them


def otlp_provider(endpoint: str) -> TracerProvider:
    """A provider batching spans to the OTLP/gRPC collector at `endpoint`. NOTE: the SDK and the exporter read their
    OTEL_* variables here (sampler, batch sizes, headers, timeout, compression, TLS files, resource attributes)."""
    resource = Resource.create()
    if str(resource.attributes.get(SERVICE_NAME, "")).startswith("unknown_service"):
        resource = resource.merge(Resource({SERVICE_NAME: SERVICE}))
    provider = TracerProvider(resource=resource)
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
    return provider


class Tracing:
    """The scheduler's tracer: FrontEnd.generate starts a RequestTrace per engine request; the engine notes its
    steps (step()), moves and end on it. NOTE: spans are made at the request's end, from noted moments, so a request
    costs no span work while it runs, and its spans end exactly once (request_log's one end line)."""

    def __init__(self, provider: TracerProvider, model_id: str) -> None:
        self.provider = provider
        self.model_id = model_id
        self.tracer = provider.get_tracer("pagedserve.scheduler")
        self.propagator = TraceContextTextMapPropagator()

    def start(self, inp: GenerateInput, headers: Mapping[str, str] | None) -> RequestTrace:
        """At a request's arrival: `headers` (HTTP headers or gRPC metadata) may carry the caller's traceparent."""
        parent = self.propagator.extract(headers) if headers else None
        return RequestTrace(self, parent, "chat" if inp.messages is not None else "text_completion", inp,
                            time.time_ns() - time.monotonic_ns(), time.monotonic())

    def step(self, w: WorkerHandle, step: ScheduledStep, streams: Mapping[str, RequestStream]) -> None:
        """A step goes to worker `w`: the first step of a request (or of its move) and its preemptions."""
        now, plan = time.monotonic(), step.plan
        for request_id in step.request_ids():
            stream = streams.get(request_id)
            if stream is not None and stream.trace is not None:
                stream.trace.scheduled(now, w.worker_id)
        if plan.preempted_seq_ids:  # NOTE: rare; the victims wait at the front of the queue
            victims = set(plan.preempted_seq_ids)
            for seq in w.scheduler.waiting:
                stream = streams.get(seq.request_id) if seq.seq_id in victims else None
                if stream is not None and stream.trace is not None:
                    stream.trace.preemptions.append((now, w.worker_id))

    def shutdown(self) -> None:
        """Exports what is still queued (bounded by OTEL_BSP_EXPORT_TIMEOUT) and stops the exporter."""
        self.provider.shutdown()


@dataclass(slots=True)
class Move:
    """A request leaving `from_worker` (lost, or leaving) for another; `to_worker` once it is scheduled there."""

    at: float
    from_worker: str
    kind: str  # fleet.Lost.kind (stream, deadline, failed_step, bad_result, leave_timeout) or leaving
    reason: str
    num_tokens: int  # known tokens (prompt and streamed output) the new worker recomputes
    to_worker: str | None = None
    resumed: float | None = None  # its first step on to_worker


@dataclass(slots=True, eq=False)
class RequestTrace:
    """One engine request's noted moments (monotonic seconds) until end() writes its spans."""

    tracing: Tracing
    parent: Context | None  # the caller's span, from its traceparent
    operation: str  # gen_ai.operation.name
    inp: GenerateInput
    offset_ns: int  # wall clock minus monotonic, in ns
    start: float
    first_scheduled: float | None = None
    worker: str | None = None
    moves: list[Move] = field(default_factory=list)
    preemptions: list[tuple[float, str]] = field(default_factory=list)  # (when, worker)
    ended: bool = False

    def scheduled(self, now: float, worker_id: str) -> None:
        if self.first_scheduled is None:
            self.first_scheduled = now
        if self.moves and self.moves[-1].resumed is None:
            self.moves[-1].to_worker, self.moves[-1].resumed = worker_id, now
        self.worker = worker_id

    def moved(self, from_worker: str, kind: str, reason: str, num_tokens: int) -> None:
        self.moves.append(Move(time.monotonic(), from_worker, kind, reason, num_tokens))

    def _ns(self, t: float) -> int:
        return self.offset_ns + round(t * 1e9)

    def refused(self, e: BaseException) -> None:
        """Refused before admission (a bad field, a full queue, draining) or cancelled while tokenizing."""
        span = self._request_span(self._request_attributes(self.inp.sampling))
        if isinstance(e, EngineError):
            span.set_attribute("error.type", e.code.value)
            span.set_status(Status(StatusCode.ERROR, str(e)))
        else:
            span.set_attribute("pagedserve.outcome", "aborted")
        span.end()
        self.ended = True

    def end(self, stream: RequestStream, outcome: str, error: tuple[str, str] | None = None) -> None:
        """The request ended (request_log: finished, aborted or failed): its spans, once."""
        if self.ended:
            return
        self.ended = True
        now, req = time.monotonic(), stream.request
        attrs = self._request_attributes(req.sampling)
        samples = stream.samples
        attrs.update({
            "gen_ai.request.id": req.client_request_id,
            "gen_ai.usage.input_tokens": len(req.prompt_token_ids),
            "gen_ai.usage.output_tokens": sum(s.num_tokens for s in samples),
            "gen_ai.response.finish_reasons": [FINISH_REASONS[s.finish_reason] for s in samples
                                               if s.finish_reason is not None],
            "gen_ai.response.model": self.tracing.model_id,
            "pagedserve.usage.cached_input_tokens": req.num_cached_prompt_tokens,
            "pagedserve.outcome": outcome,
            "pagedserve.num_preemptions": len(self.preemptions),
            "pagedserve.num_migrations": len(self.moves),
            "gen_ai.latency.e2e": now - stream.arrival,
        })
        if self.worker is not None:
            attrs["pagedserve.worker"] = self.worker
        if self.first_scheduled is not None:
            attrs["gen_ai.latency.time_in_queue"] = self.first_scheduled - stream.arrival
        first_token = stream.first_token_time
        if first_token is not None:
            attrs["gen_ai.latency.time_to_first_token"] = first_token - stream.arrival
        span = self._request_span(attrs)
        if error is not None:
            span.set_attribute("error.type", error[0])
            span.set_status(Status(StatusCode.ERROR, error[1]))
        for at, worker in self.preemptions:
            span.add_event("preempted", {"pagedserve.worker": worker}, self._ns(at))
        parent = trace.set_span_in_context(span)
        self._child(parent, "queued", stream.arrival, self.first_scheduled or now)
        if self.first_scheduled is not None:
            self._child(parent, "prefill", self.first_scheduled, first_token or now)
        if first_token is not None:
            self._child(parent, "decode", first_token, now, {"gen_ai.usage.output_tokens": attrs[
                "gen_ai.usage.output_tokens"]})
        for m in self.moves:
            moved = {"pagedserve.migration.from_worker": m.from_worker, "pagedserve.migration.reason": m.kind,
                     "pagedserve.migration.message": m.reason, "pagedserve.migration.recomputed_tokens": m.num_tokens}
            if m.to_worker is not None:
                moved["pagedserve.migration.to_worker"] = m.to_worker
            self._child(parent, "migrated", m.at, m.resumed or now, moved)
        span.end(self._ns(now))

    def _request_attributes(self, sp) -> dict:
        attrs = {"gen_ai.operation.name": self.operation, "gen_ai.request.model": self.tracing.model_id,
                 "gen_ai.request.max_tokens": sp.max_tokens, "gen_ai.request.temperature": sp.temperature,
                 "gen_ai.request.top_p": sp.top_p, "gen_ai.request.top_k": sp.top_k,
                 "gen_ai.request.choice.count": sp.n, "gen_ai.request.n": sp.n}
        if sp.seed is not None:
            attrs["gen_ai.request.seed"] = sp.seed
        if sp.presence_penalty:
            attrs["gen_ai.request.presence_penalty"] = sp.presence_penalty
        if sp.frequency_penalty:
            attrs["gen_ai.request.frequency_penalty"] = sp.frequency_penalty
        if self.inp.stop:
            attrs["gen_ai.request.stop_sequences"] = list(self.inp.stop)
        if self.inp.request_id:
            attrs["gen_ai.request.id"] = self.inp.request_id
        return attrs

    def _request_span(self, attrs: dict):
        return self.tracing.tracer.start_span(f"{self.operation} {self.tracing.model_id}", self.parent,
                                              SpanKind.SERVER, attrs, start_time=self._ns(self.start))

    def _child(self, parent: Context, name: str, start: float, end: float, attrs: dict | None = None) -> None:
        self.tracing.tracer.start_span(name, parent, SpanKind.INTERNAL, attrs,
                                       start_time=self._ns(start)).end(self._ns(max(start, end)))
