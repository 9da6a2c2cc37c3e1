"""The model-server protocol's series (vLLM's `vllm:` names), fleet-wide, each with the served model's name."""

from __future__ import annotations

import time
from collections.abc import Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from pagedserve_common.registration import WorkerRegistration
from scheduler_svc.core.request import FinishReason

# NOTE: vLLM's boundaries (vllm/v1/metrics/loggers.py), each list reaching past 30 minutes: a CPU run of
# docs/kv-cache.md has a 160 s TTFT, and a request that waits for a worker or is migrated twice can take far longer.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                     40.0, 80.0, 160.0, 640.0, 2560.0)  # vLLM's end at 80 s; a stalled step can take minutes
REQUEST_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
                   480.0, 960.0, 1920.0, 7680.0)
N_BUCKETS = (1, 2, 5, 10, 20)

# How a sample's end is counted in vllm:request_success_total{finished_reason} (vLLM's FinishReason strings).
# NOTE: a stop string ends a sample as vLLM's "stop" does; "abort": the client cancelled or went away (or its
# deadline passed); "error": the request failed after admission (its workers failed --max-migrations times, no
# worker came within --no-worker-timeout, the server shut down): vLLM's v1 "error" reason.
FINISHED_REASONS = {FinishReason.STOP: "stop", FinishReason.STOP_STRING: "stop", FinishReason.LENGTH: "length",
                    FinishReason.ABORT: "abort"}
ENDS = ("stop", "length", "abort", "error")


def buckets_1_2_5(high: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `high` (token-count histograms, as vLLM's reach max_model_len)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > high:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


class ProtocolMetrics:
    """vLLM's names, types and labels (model_name; finished_reason on request_success) over the scheduler's
    fleet: what the Gateway API Inference Extension's endpoint picker, KEDA queries and vLLM's dashboards read."""

    def __init__(self, r: CollectorRegistry, model_name: str, max_model_len: int) -> None:
        self.model_name = model_name
        self._registry = r
        # NOTE: declared family by family, in the order /metrics lists them
        self._add_gauges()
        self._add_counters()
        self._add_latency_histograms()
        self._add_request_histograms(max_model_len)

    def _gauge(self, name: str, doc: str):
        return Gauge(name, doc, ["model_name"], registry=self._registry).labels(self.model_name)

    def _counter(self, name: str, doc: str):
        return Counter(name, doc, ["model_name"], registry=self._registry).labels(self.model_name)

    def _histogram(self, name: str, doc: str, buckets: tuple):
        return Histogram(name, doc, ["model_name"], buckets=buckets, registry=self._registry).labels(self.model_name)

    def _add_gauges(self) -> None:
        self.running = self._gauge("vllm:num_requests_running", "Sequences holding KV blocks on a worker (a request "
                                   "with n > 1 counts n once forked): pagedserve_requests_running")
        self.waiting = self._gauge("vllm:num_requests_waiting", "Requests waiting: for a worker, or on one for their "
                                   "first admission (preempted ones included): pagedserve_requests_waiting")
        self.kv_usage = self._gauge("vllm:kv_cache_usage_perc", "KV-cache usage of the attached workers, 0 to 1: "
                                    "blocks held by live requests / blocks in their pools (cached but evictable blocks "
                                    "count as free, as in vLLM)")
        self.cache_config = Gauge("vllm:cache_config_info", "The attached workers' KV cache: one series (value 1) "
                                  "per block size and cache dtype, num_gpu_blocks their total",
                                  ["model_name", "block_size", "num_gpu_blocks", "num_cpu_blocks", "cache_dtype",
                                   "enable_prefix_caching"], registry=self._registry)

    def _add_counters(self) -> None:
        self.prompt_tokens = self._counter("vllm:prompt_tokens", "Prompt tokens of requests that produced a first "
                                           "token (usage.prompt_tokens: prefix-cache hits included, counted once per "
                                           "request)")
        self.generation_tokens = self._counter("vllm:generation_tokens", "Tokens streamed to clients (usage."
                                               "completion_tokens, every sample of a request summed)")
        self.preemptions = self._counter("vllm:num_preemptions", "Sequences preempted (recomputed or swapped in later)")
        self.prefix_queries = self._counter("vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache, "
                                            "once per admission")
        self.prefix_hits = self._counter("vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache")
        self.spec_drafts = self._counter("vllm:spec_decode_num_drafts", "Speculative decoding (--speculative): "
                                         "sequences that drafted tokens, once per step")
        self.spec_draft_tokens = self._counter("vllm:spec_decode_num_draft_tokens",
                                               "Speculative decoding: tokens drafted")
        self.spec_accepted_tokens = self._counter("vllm:spec_decode_num_accepted_tokens", "Speculative decoding: "
                                                  "drafted tokens accepted (acceptance rate: these / draft tokens)")
        self.spec_accepted_per_pos = Counter("vllm:spec_decode_num_accepted_tokens_per_pos", "Speculative decoding: "
                                             "drafts accepted at each draft position (0: the first draft)",
                                             ["model_name", "position"], registry=self._registry)
        success = Counter("vllm:request_success", "Samples (choices) ended, by reason: stop (EOS, a stop token or "
                          "string), length (max_tokens or the context), abort (cancelled by the client), error "
                          "(failed after admission)", ["model_name", "finished_reason"], registry=self._registry)
        self.success = {end: success.labels(self.model_name, end) for end in ENDS}  # NOTE: all present from the start

    def _add_latency_histograms(self) -> None:
        self.ttft = self._histogram("vllm:time_to_first_token_seconds", "Time to a request's first token",
                                    TTFT_BUCKETS)
        self.itl = self._histogram("vllm:inter_token_latency_seconds", "Time between two steps' tokens of a sample",
                                   TOKEN_GAP_BUCKETS)
        self.tpot = self._histogram("vllm:request_time_per_output_token_seconds", "A sample's decode time per token "
                                    "after its first (samples of two tokens or more)", TOKEN_GAP_BUCKETS)
        self.e2e = self._histogram("vllm:e2e_request_latency_seconds", "Arrival to end (finished, aborted or failed)",
                                   REQUEST_BUCKETS)
        self.queue = self._histogram("vllm:request_queue_time_seconds", "Arrival to first admission on a worker",
                                     REQUEST_BUCKETS)
        self.prefill = self._histogram("vllm:request_prefill_time_seconds", "First admission to first token",
                                       REQUEST_BUCKETS)
        self.decode = self._histogram("vllm:request_decode_time_seconds", "First token to last token", REQUEST_BUCKETS)
        self.inference = self._histogram("vllm:request_inference_time_seconds", "First admission to last token",
                                         REQUEST_BUCKETS)

    def _add_request_histograms(self, max_model_len: int) -> None:
        token_buckets = buckets_1_2_5(max_model_len)
        self.request_prompt = self._histogram("vllm:request_prompt_tokens", "Prompt tokens per request", token_buckets)
        self.request_generation = self._histogram("vllm:request_generation_tokens", "Tokens streamed per request (its "
                                                  "samples summed)", token_buckets)
        self.params_n = self._histogram("vllm:request_params_n", "The n request parameter", N_BUCKETS)
        self.params_max_tokens = self._histogram("vllm:request_params_max_tokens", "The max_tokens request parameter",
                                                 token_buckets)

    def fleet(self, registrations: Iterable[WorkerRegistration], no_prefix_caching: bool) -> None:
        """vllm:cache_config_info from the attached workers' registrations (redrawn when one comes or goes; no
        worker: no series)."""
        groups: dict[tuple[int, str], list[int]] = {}
        for reg in registrations:
            totals = groups.setdefault((reg.block_size, reg.dtype), [0, 0])
            totals[0] += reg.num_blocks
            totals[1] += reg.num_cpu_blocks
        self.cache_config.clear()
        for (block_size, dtype), (num_blocks, num_cpu_blocks) in sorted(groups.items()):
            self.cache_config.labels(self.model_name, str(block_size), str(num_blocks), str(num_cpu_blocks), dtype,
                                     str(not no_prefix_caching)).set(1)

    # NOTE: `stream` is a scheduler_svc.frontend.stream.RequestStream (not imported: it imports this module)
    def first_token(self, stream, now: float) -> None:
        self.ttft.observe(now - stream.arrival)
        self.prompt_tokens.inc(len(stream.request.prompt_token_ids))

    def ended(self, stream, failed: bool) -> None:
        """A request's end (once, from scheduler_svc.request_log): its samples by reason and its timings."""
        req, now = stream.request, time.monotonic()
        for s in stream.samples:
            end = FINISHED_REASONS[s.finish_reason] if s.finish_reason is not None else "error" if failed else "abort"
            self.success[end].inc()
            if s.num_tokens >= 2:
                self.tpot.observe((s.last_token_time - s.first_token_time) / (s.num_tokens - 1))
        self.e2e.observe(now - stream.arrival)
        scheduled, first = req.first_scheduled_time, stream.first_token_time
        if scheduled:
            self.queue.observe(max(0.0, scheduled - stream.arrival))
        last = max((s.last_token_time for s in stream.samples), default=0.0)
        if scheduled and first is not None:
            self.prefill.observe(max(0.0, first - scheduled))
            self.decode.observe(max(0.0, last - first))
            self.inference.observe(max(0.0, last - scheduled))
        self.request_prompt.observe(len(req.prompt_token_ids))
        self.request_generation.observe(sum(s.num_tokens for s in stream.samples))
        self.params_n.observe(req.sampling.n)
        self.params_max_tokens.observe(req.sampling.max_tokens)
