"""Traces (--otlp-endpoint): one span per request with queued, prefill, decode and migrated children and GenAI
attributes, a child of the caller's W3C traceparent on both APIs; exported over OTLP/gRPC by a real scheduler
process; off by default, without importing opentelemetry."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from concurrent import futures

import grpc
import httpx
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc
from pagedserve_common.ports import free_port
from scheduler_svc.tracing.spans import Tracing
from tests.support.service import started_service, wait_until
from tests.support import inproc_scheduler

TRACE_ID = "4bf92f3577b34da6a3ce929d0e0e4736"
PARENT_ID = "00f067aa0ba902b7"
TRACEPARENT = f"00-{TRACE_ID}-{PARENT_ID}-01"
TIMEOUT = 300


def traced(model_dir: str, body, num_workers: int = 1) -> tuple[object, list]:
    """(what body returned, every span finished) of a scheduler in this process exporting to memory."""
    exporter, provider = InMemorySpanExporter(), TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    out = inproc_scheduler.run(model_dir, body, traces=Tracing(provider, model_dir), num_workers=num_workers)
    return out, list(exporter.get_finished_spans())


def request_span(spans: list, request_id: str):
    found = [s for s in spans if s.kind is SpanKind.SERVER and s.attributes.get("gen_ai.request.id") == request_id]
    assert len(found) == 1, f"{len(found)} request spans for {request_id}"  # NOTE: exactly one per request
    return found[0]


def children(spans: list, parent) -> dict[str, list]:
    out: dict[str, list] = {}
    for s in spans:
        if s.parent is not None and s.parent.span_id == parent.context.span_id:
            out.setdefault(s.name, []).append(s)
    return out


def grpc_generate(address: str, request: pb.GenerateRequest, metadata=()) -> list:
    with grpc.insecure_channel(address) as ch:
        return list(generate_pb2_grpc.GenerationStub(ch).Generate(request, metadata=metadata, timeout=TIMEOUT))


@pytest.fixture(scope="module")
def served(tiny_served_model):
    """Spans of requests on both APIs: a traced gRPC one with stop strings, a traced HTTP chat with n = 2, an
    untraced one, one cancelled mid-stream and one refused."""
    model = tiny_served_model

    def body(server):
        grpc_out = grpc_generate(server.listen, pb.GenerateRequest(
            request_id="grpc-1", prompt="The capital of France is",
            sampling=pb.SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, stop=["e", "a", " "])),
            metadata=(("traceparent", TRACEPARENT),))
        http = httpx.post(f"http://{server.http}/v1/chat/completions", timeout=TIMEOUT, json={
            "model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "n": 2,
            "temperature": 0.7, "top_p": 0.9, "seed": 5, "request_id": "http-1", "ignore_eos": True},
            headers={"traceparent": TRACEPARENT.replace(PARENT_ID, "b7ad6b7169203331"), "tracestate": "vendor=x"})
        untraced = grpc_generate(server.listen, pb.GenerateRequest(
            request_id="plain-1", prompt_token_ids=[1, 2, 3], sampling=pb.SamplingParams(max_tokens=3)))
        with grpc.insecure_channel(server.listen) as ch:
            call = generate_pb2_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
                request_id="cancel-1", prompt="Once", sampling=pb.SamplingParams(max_tokens=400, ignore_eos=True)),
                timeout=TIMEOUT)
            next(call)
            call.cancel()
        refused = httpx.post(f"http://{server.http}/v1/completions", timeout=TIMEOUT, json={
            "model": model, "prompt": "x", "max_tokens": 100_000, "request_id": "refused-1"})
        # NOTE: the cancelled request ends (and its spans with it) at the scheduler's next step: wait for it
        wait_until(lambda: grpc_generate(server.listen, pb.GenerateRequest(
            prompt_token_ids=[5], sampling=pb.SamplingParams(max_tokens=1))) is not None)
        return grpc_out, http.json(), untraced, refused

    (grpc_out, http_out, untraced, refused), spans = traced(model, body)
    return {"grpc": grpc_out, "http": http_out, "untraced": untraced, "refused": refused, "spans": spans,
            "model": model}


def test_grpc_request_span_is_a_child_of_the_callers_traceparent(served):
    span = request_span(served["spans"], "grpc-1")
    assert f"{span.context.trace_id:032x}" == TRACE_ID
    assert f"{span.parent.span_id:016x}" == PARENT_ID and span.parent.is_remote
    assert span.name == f"text_completion {served['model']}"
    a = span.attributes
    assert a["gen_ai.operation.name"] == "text_completion" and a["gen_ai.request.model"] == served["model"]
    assert a["gen_ai.request.max_tokens"] == 24 and a["gen_ai.request.temperature"] == 0
    assert a["gen_ai.request.choice.count"] == 1 and tuple(a["gen_ai.request.stop_sequences"]) == ("e", "a", " ")
    num_tokens = sum(len(m.token_ids) for m in served["grpc"])
    assert a["gen_ai.usage.output_tokens"] == num_tokens and a["gen_ai.usage.input_tokens"] > 0
    assert served["grpc"][-1].finish_reason == pb.FINISH_REASON_STOP_STRING  # ended by a stop string
    assert tuple(a["gen_ai.response.finish_reasons"]) == ("stop",)
    assert a["pagedserve.outcome"] == "finished" and a["pagedserve.worker"] == "worker-0"
    assert span.status.status_code is StatusCode.UNSET


def test_queued_prefill_decode_children_cover_the_request_in_order(served):
    span = request_span(served["spans"], "grpc-1")
    kids = children(served["spans"], span)
    assert sorted(kids) == ["decode", "prefill", "queued"] and all(len(v) == 1 for v in kids.values())
    queued, prefill, decode = kids["queued"][0], kids["prefill"][0], kids["decode"][0]
    assert span.start_time <= queued.start_time <= queued.end_time == prefill.start_time
    assert prefill.end_time == decode.start_time <= decode.end_time <= span.end_time
    for s in (queued, prefill, decode):
        assert s.context.trace_id == span.context.trace_id and s.kind is SpanKind.INTERNAL
    assert span.attributes["gen_ai.latency.time_to_first_token"] >= span.attributes["gen_ai.latency.time_in_queue"]


def test_http_chat_with_n_2_honours_traceparent_and_tracestate(served):
    span = request_span(served["spans"], "http-1")
    assert f"{span.context.trace_id:032x}" == TRACE_ID and f"{span.parent.span_id:016x}" == "b7ad6b7169203331"
    assert span.parent.trace_state.get("vendor") == "x"
    a = span.attributes
    assert span.name == f"chat {served['model']}" and a["gen_ai.operation.name"] == "chat"
    assert a["gen_ai.request.choice.count"] == 2 and a["gen_ai.request.top_p"] == pytest.approx(0.9)
    assert a["gen_ai.request.temperature"] == pytest.approx(0.7) and a["gen_ai.request.seed"] == 5
    usage = served["http"]["usage"]
    assert a["gen_ai.usage.input_tokens"] == usage["prompt_tokens"]
    assert a["gen_ai.usage.output_tokens"] == usage["completion_tokens"] == 12
    assert tuple(a["gen_ai.response.finish_reasons"]) == ("length", "length")


def test_a_request_without_traceparent_starts_its_own_trace(served):
    span = request_span(served["spans"], "plain-1")
    assert span.parent is None and f"{span.context.trace_id:032x}" != TRACE_ID
    assert span.attributes["gen_ai.usage.output_tokens"] == sum(len(m.token_ids) for m in served["untraced"])


def test_a_cancelled_request_ends_its_span_once_as_aborted(served):
    span = request_span(served["spans"], "cancel-1")
    assert span.attributes["pagedserve.outcome"] == "aborted"
    assert 0 < span.attributes["gen_ai.usage.output_tokens"] < 400


def test_a_refused_request_has_an_error_span(served):
    assert served["refused"].status_code == 400
    span = request_span(served["spans"], "refused-1")
    assert span.status.status_code is StatusCode.ERROR and "max_tokens" in span.status.description
    assert span.attributes["error.type"] == "INVALID_ARGUMENT"
    assert not children(served["spans"], span)


def test_a_worker_killed_mid_request_adds_a_migrated_span(tiny_served_model):
    """The request's first step is in flight on a stopped worker-0 when it is killed: the request is recomputed on
    worker-1 and its span says so."""
    def kv_sequences(server, worker_id: str) -> int:
        with grpc.insecure_channel(server.listen) as ch:
            return len(generate_pb2_grpc.GenerationStub(ch).GetKVState(
                pb.GetKVStateRequest(worker_id=worker_id), timeout=60).sequences)

    def num_workers(server) -> int:
        with grpc.insecure_channel(server.listen) as ch:
            return len(generate_pb2_grpc.GenerationStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=60).workers)

    def body(server):
        first = server.workers[0]
        os.kill(first.pid, signal.SIGSTOP)
        out: list = []
        client = threading.Thread(target=lambda: out.extend(grpc_generate(server.listen, pb.GenerateRequest(
            request_id="moved-1", prompt="Hello there", sampling=pb.SamplingParams(max_tokens=8, ignore_eos=True)))))
        client.start()
        wait_until(lambda: kv_sequences(server, "worker-0") == 1)
        server.start_worker()
        wait_until(lambda: num_workers(server) == 2, timeout=180)
        os.kill(first.pid, signal.SIGKILL)
        client.join(TIMEOUT)
        return out

    out, spans = traced(tiny_served_model, body)
    assert sum(len(m.token_ids) for m in out) == 8
    span = request_span(spans, "moved-1")
    assert span.attributes["pagedserve.num_migrations"] == 1 and span.attributes["pagedserve.worker"] == "worker-1"
    (moved,) = children(spans, span)["migrated"]
    a = moved.attributes
    assert a["pagedserve.migration.from_worker"] == "worker-0" and a["pagedserve.migration.to_worker"] == "worker-1"
    assert a["pagedserve.migration.reason"] == "stream" and a["pagedserve.migration.recomputed_tokens"] > 0
    assert span.start_time <= moved.start_time <= moved.end_time <= span.end_time


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    """An OTLP/gRPC collector: keeps every export request."""

    def __init__(self) -> None:
        self.requests: list = []

    def Export(self, request, context):
        self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()


def attributes(kvs) -> dict:
    out = {}
    for kv in kvs:
        kind = kv.value.WhichOneof("value")
        value = getattr(kv.value, kind)
        out[kv.key] = [getattr(v, v.WhichOneof("value")) for v in value.values] if kind == "array_value" else value
    return out


def test_a_scheduler_process_exports_spans_over_otlp_grpc(tiny_served_model, monkeypatch):
    receiver, port = Receiver(), free_port()
    collector = grpc.server(futures.ThreadPoolExecutor(2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, collector)
    collector.add_insecure_port(f"127.0.0.1:{port}")
    collector.start()
    monkeypatch.setenv("OTEL_BSP_SCHEDULE_DELAY", "50")  # NOTE: the SDK's variables reach the exporter
    monkeypatch.setenv("OTEL_SERVICE_NAME", "pagedserve-otlp-test")
    try:
        with started_service(tiny_served_model, "--otlp-endpoint", f"http://127.0.0.1:{port}") as s:
            out = grpc_generate(s.address, pb.GenerateRequest(request_id="otlp-1", prompt="Hello", sampling=pb.
                                SamplingParams(max_tokens=5, ignore_eos=True)), (("traceparent", TRACEPARENT),))

            def spans():
                return [(rs, span) for r in receiver.requests for rs in r.resource_spans for ss in rs.scope_spans
                        for span in ss.spans]
            wait_until(lambda: {"text_completion " + tiny_served_model, "queued", "prefill", "decode"} <=
                       {span.name for _, span in spans()})
    finally:
        collector.stop(0)
    assert sum(len(m.token_ids) for m in out) == 5
    (resource, request), = [(rs, span) for rs, span in spans() if span.kind == span.SPAN_KIND_SERVER]
    assert attributes(resource.resource.attributes)["service.name"] == "pagedserve-otlp-test"
    assert request.trace_id.hex() == TRACE_ID and request.parent_span_id.hex() == PARENT_ID
    a = attributes(request.attributes)
    assert a["gen_ai.request.id"] == "otlp-1" and a["gen_ai.usage.output_tokens"] == 5
    assert a["gen_ai.request.max_tokens"] == 5 and a["gen_ai.response.finish_reasons"] == ["length"]
    kids = {span.name for _, span in spans() if span.parent_span_id == request.span_id}
    assert kids == {"queued", "prefill", "decode"}


NO_OTEL = """
import json, sys
import grpc, httpx
from pagedserve.v1 import generate_pb2 as pb, generate_pb2_grpc
from tests.support import inproc_scheduler

model, traceparent = sys.argv[1:]

def grpc_request(server):
    with grpc.insecure_channel(server.listen) as ch:
        list(generate_pb2_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(prompt="Hi", sampling=pb.SamplingParams(
            max_tokens=3)), metadata=(("traceparent", traceparent),), timeout=300))

def both(server):
    grpc_request(server)
    httpx.post(f"http://{server.http}/v1/completions", json={"model": model, "prompt": "Hi", "max_tokens": 3},
               headers={"traceparent": traceparent}, timeout=300).raise_for_status()

def loaded():
    return sorted(m for m in sys.modules if m.split(".")[0] == "opentelemetry" or m == "scheduler_svc.tracing.spans")

inproc_scheduler.run(model, grpc_request, "--http", "")
grpc_only = loaded()
inproc_scheduler.run(model, both)
from opentelemetry import trace
print(json.dumps({"grpc_only": grpc_only, "with_http": loaded(), "provider": type(trace.get_tracer_provider()).__name__}))
"""


def test_without_the_flag_no_tracing_code_is_imported(tiny_served_model):
    """A scheduler without --otlp-endpoint serves callers that send a traceparent without importing its tracing, the
    OpenTelemetry SDK or an exporter. NOTE: FastAPI (0.165) imports the OpenTelemetry API for its own telemetry, off
    while no global tracer provider is set (the scheduler never sets one): without the HTTP front, not even that."""
    out = subprocess.run([sys.executable, "-c", NO_OTEL, tiny_served_model, TRACEPARENT], capture_output=True,
                         text=True, timeout=600, env={**os.environ, "OTEL_EXPORTER_OTLP_ENDPOINT": ""})
    assert out.returncode == 0, out.stderr[-3000:]
    loaded = json.loads(out.stdout.strip().splitlines()[-1])
    assert loaded["grpc_only"] == []
    assert [m for m in loaded["with_http"] if m.startswith(("opentelemetry.sdk", "opentelemetry.exporter",
                                                            "scheduler_svc"))] == []
    assert loaded["provider"] == "ProxyTracerProvider"  # NOTE: no global provider: FastAPI's telemetry stays off


def scheduler_error(model_dir: str, endpoint: str, prelude: str = "") -> subprocess.CompletedProcess:
    argv = ["scheduler", "--model", model_dir, "--listen", f"127.0.0.1:{free_port()}", "--worker-listen",
            f"127.0.0.1:{free_port()}", "--metrics", "", "--otlp-endpoint", endpoint]
    code = f"import sys\n{prelude}\nfrom pagedserve_cli.main import main\nsys.exit(main({argv!r}))"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)


def test_an_endpoint_that_is_not_a_url_is_refused_naming_the_flag(tiny_served_model):
    out = scheduler_error(tiny_served_model, "localhost:4317")
    assert out.returncode == 2
    assert "--otlp-endpoint localhost:4317: expected http://HOST:PORT" in out.stderr.strip().splitlines()[-1]


def test_missing_opentelemetry_packages_are_a_start_up_error_naming_the_flag(tiny_served_model):
    out = scheduler_error(tiny_served_model, "http://127.0.0.1:4317", "sys.modules['opentelemetry'] = None")
    assert out.returncode == 1
    last = out.stderr.strip().splitlines()[-1]
    assert "--otlp-endpoint needs the OpenTelemetry SDK" in last and "opentelemetry-sdk" in last
