"""/metrics: the vllm: model-server protocol series equal what the requests did, the worker label is the name a
worker registered with, no *_created series, process metrics on."""

from __future__ import annotations

import socket

import grpc
import httpx

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc
from tests.support.service import metric_value, wait_until
from tests.support.inproc import ScriptedWorker, generate, status_of, tokens_of, wait_for, with_server

M = {"model_name": "m"}


def value(engine, name: str, **labels: str) -> float | None:
    return engine.metrics.registry.get_sample_value(name, {**M, **labels})


def ends(engine) -> dict[str, float]:
    return {r: value(engine, "vllm:request_success_total", finished_reason=r) for r in ("stop", "length", "abort",
                                                                                         "error")}


@with_server(max_num_seqs=4, max_queued_requests=8)
async def test_token_counters_ends_and_histograms_equal_the_requests(engine, channel):
    ScriptedWorker(channel, answer=True)
    await wait_for(lambda: engine.workers)
    runs = [((5, 6, 7), {"max_tokens": 4}),  # ends by length
            ((1, 2, 3, 4, 5), {"max_tokens": 9, "stop_token_ids": [7]}),  # the scripted token stops it at once
            ((9, 9, 9), {"max_tokens": 3, "n": 2})]  # two samples, one prompt
    streamed = [await tokens_of(generate(channel, ids=ids, **sp)) for ids, sp in runs]
    assert [[len(s) for s in r] for r in streamed] == [[4], [1], [3, 3]]
    await wait_for(lambda: not engine.streams)
    assert value(engine, "vllm:prompt_tokens_total") == 3 + 5 + 3  # once per request, n or not
    assert value(engine, "vllm:generation_tokens_total") == 4 + 1 + 6
    assert ends(engine) == {"stop": 1, "length": 3, "abort": 0, "error": 0}  # one per sample
    for name in ("time_to_first_token_seconds", "e2e_request_latency_seconds", "request_queue_time_seconds",
                 "request_prefill_time_seconds", "request_decode_time_seconds", "request_inference_time_seconds"):
        assert value(engine, f"vllm:{name}_count") == 3, name
    assert value(engine, "vllm:request_prompt_tokens_sum") == 11
    assert value(engine, "vllm:request_generation_tokens_sum") == 11
    assert value(engine, "vllm:request_params_n_sum") == 1 + 1 + 2
    assert value(engine, "vllm:inter_token_latency_seconds_count") == 3 + 0 + 2 * 2  # gaps between a sample's tokens
    assert value(engine, "vllm:request_time_per_output_token_seconds_count") == 3  # samples of 2 tokens or more
    # the pagedserve_* twins count alike
    assert engine.metrics.registry.get_sample_value("pagedserve_e2e_seconds_count") == 3
    assert value(engine, "vllm:prefix_cache_queries_total") == sum(
        engine.metrics.registry.get_sample_value("pagedserve_prefix_cache_queries_tokens_total", {"worker": w.label})
        for w in engine.workers.values()) > 0


@with_server(no_worker_timeout=600)
async def test_a_request_cancelled_while_it_waits_for_a_worker_counts_as_abort(engine, channel):
    call = generate(channel)
    await wait_for(lambda: value(engine, "vllm:num_requests_waiting") == 1)  # no step runs: set at submit
    call.cancel()
    await wait_for(lambda: ends(engine)["abort"] == 1)
    assert ends(engine) == {"stop": 0, "length": 0, "abort": 1, "error": 0}
    assert value(engine, "vllm:num_requests_waiting") == 0
    assert value(engine, "vllm:prompt_tokens_total") == 0  # it never reached a first token
    assert value(engine, "vllm:e2e_request_latency_seconds_count") == 1
    assert value(engine, "vllm:request_queue_time_seconds_count") == 0  # never admitted on a worker


@with_server(no_worker_timeout=0.3)
async def test_a_request_that_fails_after_admission_counts_as_error(engine, channel):
    code, _ = await status_of(generate(channel))
    assert code == grpc.StatusCode.UNAVAILABLE  # no worker came within --no-worker-timeout
    assert ends(engine) == {"stop": 0, "length": 0, "abort": 0, "error": 1}
    assert value(engine, "vllm:num_requests_waiting") == 0


@with_server(max_num_seqs=4)
async def test_kv_usage_and_cache_config_cover_the_fleet_and_the_worker_label_is_its_name(engine, channel):
    reg = engine.metrics.registry
    first = ScriptedWorker(channel, num_blocks=64, name="pod-a:1")
    await wait_for(lambda: len(engine.workers) == 1)
    # the same name again while the first is attached (a restarted container: PID 1 again): a label of its own
    second = ScriptedWorker(channel, num_blocks=32, name="pod-a:1")
    await wait_for(lambda: len(engine.workers) == 2)
    assert reg.get_sample_value("pagedserve_kv_blocks_total", {"worker": "pod-a:1"}) == 64
    assert reg.get_sample_value("pagedserve_kv_blocks_total", {"worker": "pod-a:1#2"}) == 32
    info = {**M, "block_size": "16", "num_gpu_blocks": "96", "num_cpu_blocks": "0", "cache_dtype": "float32",
            "enable_prefix_caching": "True"}
    assert reg.get_sample_value("vllm:cache_config_info", info) == 1
    assert value(engine, "vllm:kv_cache_usage_perc") == 0

    call = generate(channel, ids=tuple(range(1, 41)), max_tokens=10)  # 40 prompt tokens: 3 blocks of 16
    await wait_for(lambda: any(p.new_seqs for w in (first, second) for p in w.plans))
    holder = next(w for w in (first, second) if w.plans)
    holder.reply(holder.plans[0])
    await wait_for(lambda: len(holder.plans) == 2)  # the first step is published, the second is in flight
    stub = generate_pb2_grpc.GenerationStub(channel)
    states = [await stub.GetKVState(pb.GetKVStateRequest(worker_id=wid)) for wid in engine.workers]
    used = sum(sum(1 for c in s.ref_counts if c) for s in states)
    assert used == 3 and value(engine, "vllm:kv_cache_usage_perc") == used / 96
    assert value(engine, "vllm:num_requests_running") == 1

    call.cancel()
    first.close()  # it leaves: its gauges go, the other keeps its label
    await wait_for(lambda: len(engine.workers) == 1)
    assert reg.get_sample_value("pagedserve_kv_blocks_total", {"worker": "pod-a:1"}) is None
    assert reg.get_sample_value("pagedserve_kv_blocks_total", {"worker": "pod-a:1#2"}) == 32
    assert reg.get_sample_value("vllm:cache_config_info", {**info, "num_gpu_blocks": "96"}) is None
    assert reg.get_sample_value("vllm:cache_config_info", {**info, "num_gpu_blocks": "32"}) == 1
    second.close()
    await wait_for(lambda: not engine.workers)
    assert value(engine, "vllm:kv_cache_usage_perc") == 0


def test_metrics_of_a_real_scheduler_match_an_openai_request_and_name_the_worker(service):
    text = service.scrape()
    assert "_created" not in text  # no *_created twin of any counter or histogram
    for name in ("process_cpu_seconds_total", "process_resident_memory_bytes", "process_open_fds", "python_info",
                 "python_gc_collections_total"):
        assert any(line.startswith(name) for line in text.splitlines()), name
    model = httpx.get(f"http://{service.http}/v1/models", timeout=60).json()["data"][0]["id"]
    worker = service.procs[0]
    name = f"{socket.gethostname()}:{worker.pid}"  # HOST:PID, as the worker registered
    assert metric_value(text, "pagedserve_kv_blocks_total", worker=name) > 0
    assert 'worker="worker-' not in text
    m = {"model_name": model}
    before = {n: metric_value(text, n, **m) for n in ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")}
    length_before = metric_value(text, "vllm:request_success_total", finished_reason="length", **m)
    out = service.openai_client().completions.create(model=model, prompt="The capital of France is", max_tokens=5,
                                                     extra_body={"ignore_eos": True})
    wait_until(lambda: metric_value(service.scrape(), "vllm:request_success_total", finished_reason="length", **m)
               == length_before + 1)
    after = service.scrape()
    assert metric_value(after, "vllm:prompt_tokens_total", **m) - before["vllm:prompt_tokens_total"] == \
        out.usage.prompt_tokens
    assert metric_value(after, "vllm:generation_tokens_total", **m) - before["vllm:generation_tokens_total"] == \
        out.usage.completion_tokens == 5
    usage = metric_value(after, "vllm:kv_cache_usage_perc", **m)
    assert 0 <= usage <= 1


def test_the_protocol_names_keep_their_colon_whatever_format_the_scraper_asks_for(service):
    # NOTE: Prometheus asks for OpenMetrics first; prometheus_client 0.26 would write vllm_num_requests_waiting there
    accept = "application/openmetrics-text;version=1.0.0,application/openmetrics-text;version=0.0.1;q=0.75," \
             "text/plain;version=0.0.4;q=0.5,*/*;q=0.1"  # Prometheus 2.42's Accept header
    r = httpx.get(f"http://{service.metrics}/metrics", headers={"Accept": accept}, timeout=60)
    assert r.headers["content-type"].startswith("text/plain; version=0.0.4")
    lines = r.text.splitlines()
    assert any(line.startswith("vllm:num_requests_waiting{") for line in lines)
    assert not any(line.startswith("vllm_") for line in lines)
