"""The configuration tree of `pagedserve scheduler`, `worker` and `up`: every flag, its default and its help."""

from __future__ import annotations

from dataclasses import dataclass

from pagedserve_common.defaults import (DEFAULT_BLOCK_SIZE, DEFAULT_HTTP, DEFAULT_LISTEN, DEFAULT_METRICS,
                                        DEFAULT_MODEL, DEFAULT_WORKER_LISTEN)
from pagedserve_common.kv_geometry import DTYPE_BYTES
from pagedserve_common.model_spec import MODEL_HELP, REVISION_HELP
from pagedserve_common.options import ALWAYS, GIVEN, byte_size, count, group, option, parse_device, seconds
from pagedserve_common.units import format_bytes

ROUTING = ("kv", "least-loaded", "round-robin")  # scheduler_svc.routing
TOOL_CALL_PARSERS = ("none", "hermes", "llama3_json")  # scheduler_svc.frontend.tool_parsers
# "paged" allocates a KV block when a sequence needs one (scheduler_svc.kv.manager); the static modes reserve a
# sequence's whole run at admission (scheduler_svc.kv.static): for max_model_len tokens, or for
# min(prompt + max_tokens, max_model_len).
KV_ALLOCATIONS = ("paged", "static-max-model-len", "static-request")
DTYPES = ("auto", "float32", "float16", "bfloat16")
WEIGHT_DTYPES = ("auto", "as-stored", "bfloat16", "float32")  # --weight-dtype (worker_svc.weights)
ACTIVATION_DTYPES = ("auto", "int8")  # --activation-dtype (worker_svc.weights.choose_activations)
KV_CACHE_DTYPES = ("auto", *DTYPE_BYTES)  # --kv-cache-dtype: auto (the model's) or a cache element type
ATTENTION_BACKENDS = ("auto", "cpu", "torch", "cupy")
INT8_QK = ("auto", "on", "off")
BATCH_INVARIANT = ("auto", "on", "off")
# worker_svc.cpu_path.PATHS, best first: what the CPU has, or a lesser CPU's path forced (tests, benchmarks)
CPU_PATHS = ("native", "amx", "avx512-bf16", "avx512", "avx2")
SPECULATIVE = ("none", "ngram")  # scheduler_svc.core.speculation
SCHEDULING_POLICIES = ("fcfs", "priority", "fair")  # scheduler_svc.core.waiting

# The scheduler's constants that the help below quotes: the code reads them from here.
NGRAM_MAX, NGRAM_MIN = 4, 2  # --speculative ngram: the n-gram lengths looked up, longest first (core.speculation)
AGING_ADMISSIONS = 64  # --scheduling-policy priority: a waiting request gains one level per this many admissions
FAIR_PREFILL_WEIGHT, FAIR_DECODE_WEIGHT = 1.0, 2.0  # --scheduling-policy fair: a prompt token's, an output token's
ROUTING_BALANCE_EPS = 0.5  # --routing kv: a worker within (1 + this) x the fleet's average load (scheduler_svc.routing)
MAX_STOP_CHARS = 1024  # each stop string (and bad word): scheduler_svc.frontend.limits.Limits

# Tokens per step when not set. NOTE: a step is one forward, so its token budget bounds the inter-token latency
# of every running stream while a long prompt is prefilled. Measured on a 2-core CPU with the default model
# (64 mixed requests at once): 512 gives the best throughput too (256: -17%, 1024: -4%, 2048: -12%), and a
# 512-token step takes about 1 s there, against 4-5 s for 2048.
CPU_BATCHED_TOKENS = 512
GPU_BATCHED_TOKENS = 2048


def default_batched_tokens(device: str) -> int:
    """--max-num-batched-tokens when not set, by the worker's device (a registration's: cpu, cuda:N)."""
    return CPU_BATCHED_TOKENS if device.startswith("cpu") or not device else GPU_BATCHED_TOKENS


CPU_KV_MEMORY = 1 << 30  # a CPU worker's KV pool without --kv-memory
MAX_MESSAGE_SIZE = 4 << 20  # scheduler_svc.frontend.limits.Limits
MAX_STOP_STRINGS = 16
MAX_STRUCTURED_OUTPUT_BYTES = 64 << 10  # a structured output's spec (schema, regex, grammar, choices together)
# NOTE: well under --max-queued-requests' default (1024): one request alone cannot hold the whole queue's worth of
# sequences (a completions batch of 1,000 prompts x n=64 was 64,000 sequences)
MAX_SEQS_PER_REQUEST = 256
MAX_WORKERS = 64
# NOTE: 4 Mi blocks of 16 tokens are 67M tokens of KV: more than any one device holds for a real model (an H200's
# 141 GB holds ~380k blocks of the default model, ~70k of an 8B one).
MAX_WORKER_BLOCKS = 1 << 22
# NOTE: --max-prompt-chars' default per token of max_model_len: a token of real text averages ~4 characters; 32
# leaves room for whitespace runs and long words while refusing a multi-megabyte prompt before it costs seconds of
# tokenizing.
PROMPT_CHARS_PER_TOKEN = 32
DEFAULT_MAX_CONNECTIONS = 4096  # --max-http-connections and --max-grpc-connections at most, when not set
PER_PEER_SHARE = 4  # --max-connections-per-peer when not set: a quarter of a port (scheduler_svc.ports.ConnectionCaps)
# NOTE: ... and at least this many (or the whole of a smaller port): `up`'s workers all dial from one address, and
# one host's benchmark client may open dozens of HTTP connections
MIN_PER_PEER = 16

# `pagedserve up`'s mark on the processes it starts (pagedserve_cli.up_cmd): a random nonce in this variable of its
# scheduler's and its workers' environment. The scheduler answers health checks with it in this trailing metadata
# key (so that `up` knows its own scheduler from another on the port) and refuses a worker that presents another in
# this call metadata key when it attaches (one of another `up`). NOTE: no credential: a worker with none attaches.
UP_NONCE_VARIABLE = "PAGEDSERVE_UP_NONCE"
UP_NONCE_METADATA = "x-pagedserve-up-nonce"

TLS_SERVER_NAME_HELP = "check the server's certificate for NAME instead of the host dialled"
WORKER_TOKEN_HELP = "worker tokens, one a line (# comments)"


# -- the scheduler ------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class SchedulerNetwork:
    listen: str = option(DEFAULT_LISTEN, "client API (pagedserve.v1.Generation)", metavar="HOST:PORT", up=ALWAYS)
    worker_listen: str = option(DEFAULT_WORKER_LISTEN, "where workers dial in", metavar="HOST:PORT", up=ALWAYS)
    metrics: str = option(DEFAULT_METRICS, "Prometheus endpoint ('' = off)", metavar="HOST:PORT", up=ALWAYS)
    http: str = option("", f"serve the OpenAI-compatible HTTP API here too, e.g. {DEFAULT_HTTP} ('' = off)",
                       metavar="HOST:PORT")  # NOTE: `up` has its own, on by default (UpOptions.http)


@dataclass(slots=True)
class EngineOptions:
    """Batching, KV cache, routing and failure handling: the engine's (scheduler_svc.engine.EngineConfig) flags."""

    max_num_seqs: int = count(64, "sequences per step (a request's n samples count one each)", up=GIVEN)
    max_num_batched_tokens: int | None = count(
        None, "tokens per step; bounds inter-token latency during long prefills",
        default_text=f"{CPU_BATCHED_TOKENS} for a CPU worker, {GPU_BATCHED_TOKENS} for a GPU worker",
        up=GIVEN)
    max_queued_requests: int = count(1024, "unfinished requests beyond which a new one is refused "
                                           "(RESOURCE_EXHAUSTED)", up=GIVEN)
    no_prefix_caching: bool = option(False, "never reuse the KV blocks of a prompt's prefix computed before",
                                     up=GIVEN)
    # NOTE: off by default: a prefix hit shows in usage's cached tokens (and in the time to first token), so a shared
    # cache tells one tenant whether another sent a prompt
    shared_prefix_cache: bool = option(False, "prefix-cache hits across tenants too (else a prompt hits only blocks "
                                              "its own tenant computed: the tenant salts the block hashes, with "
                                              "cache_salt); for tenants that trust each other", up=GIVEN)
    kv_allocation: str = option(
        "paged", "paged: a KV block whenever a sequence needs one; static-max-model-len: each sequence reserves one "
                 "contiguous run of blocks for max_model_len tokens when admitted, static-request: for prompt + "
                 "max_tokens (FasterTransformer/Orca-style preallocation, to compare; no prefix caching, n = 1, no "
                 "swap space)", choices=KV_ALLOCATIONS, up=GIVEN)
    speculative: str = option("none", "speculative decoding: ngram drafts the tokens that followed the sequence's "
                                      f"last {NGRAM_MAX}..{NGRAM_MIN} tokens where they occurred before in its prompt "
                                      "or output (prompt lookup), verified in the same forward; outputs are the same "
                                      "as without (greedy: identical; sampled: the same draws)", choices=SPECULATIVE,
                              up=GIVEN)
    num_speculative_tokens: int = count(4, "drafts per sequence per step at most (--speculative)", metavar="K",
                                        up=GIVEN)
    scheduling_policy: str = option(
        "fcfs", "the order waiting requests are admitted in: fcfs (first come, first served), priority (a request's "
                "`priority` field, lower first, ties by arrival, at most its API key's max-priority; one with no room "
                "preempts the running sequence of the worst priority, recomputed later; a request waiting through "
                f"{AGING_ADMISSIONS} admissions gains one level, and one waiting --priority-max-wait goes first, so "
                "none starves), fair (each tenant an equal share of the tokens computed, a prompt token counting "
                f"{FAIR_PREFILL_WEIGHT:g} and an output token {FAIR_DECODE_WEIGHT:g}; the tenant: the API key's name, "
                "else one shared tenant; a gateway key's or a keyless server's x-pagedserve-tenant header or gRPC "
                "metadata)",
        choices=SCHEDULING_POLICIES, up=GIVEN)
    # NOTE: a bound in time, whatever the priority gap: ageing by admissions alone took 2^31 levels x
    # AGING_ADMISSIONS admissions to lift a priority-0 request over a flood at -2^31
    priority_max_wait: float = seconds(30.0, "--scheduling-policy priority: a request that has waited this long is "
                                             "admitted before every priority (by arrival among such), and may preempt "
                                             "for its room, so no flood of urgent requests holds it longer", up=GIVEN)
    tenant_weights: str | None = option(
        None, "--scheduling-policy fair: a file of `TENANT WEIGHT` lines (the weight last, the name before it; "
              "blank lines and # comments skipped): a tenant's share is proportional to its weight; unlisted "
              "tenants and the shared one weigh 1", metavar="FILE", default_text="none: every tenant weighs 1",
        up=GIVEN)
    routing: str = option("kv", "which worker takes a new request: kv (the one holding the longest prefix of the "
                                f"prompt, among those within {1 + ROUTING_BALANCE_EPS:g}x the average load, while what "
                                "it holds outweighs its extra load: a prefix every request shares spreads by load), "
                                "least-loaded (fewest pending tokens) or round-robin", choices=ROUTING, up=GIVEN)
    step_timeout: float = seconds(60.0, "a worker that takes longer for one step (its first one too: a worker "
                                        "warms up before it registers) is declared lost and its requests are "
                                        "recomputed elsewhere", up=GIVEN)
    seed: int | None = count(None, "requests that bring no seed draw theirs from this one, in arrival order: the same "
                                   "requests sent in the same order to a server started with the same seed sample the "
                                   "same tokens", minimum=0, default_text="none: each request's seed is random",
                             up=GIVEN)
    max_migrations: int = count(3, "a request whose steps took down N workers ends with INTERNAL", up=GIVEN)
    no_worker_timeout: float = seconds(60.0, "while no worker is attached requests wait this long, then UNAVAILABLE",
                                       positive=False, up=GIVEN)
    # NOTE: also how long a worker that announces it leaves may finish its running requests before they move.
    drain_timeout: float = seconds(30.0, "on SIGTERM the scheduler stops admitting (UNAVAILABLE) and lets in-flight "
                                         "streams finish this long", positive=False, up=GIVEN)
    # NOTE: a registration costs the scheduler memory in proportion to the blocks its requests use (the pool's
    # bookkeeping grows lazily), but a bound keeps one worker from claiming a pool no real device holds.
    max_workers: int = count(MAX_WORKERS, "attached workers beyond which a registration is refused "
                                          "(RESOURCE_EXHAUSTED)", up=GIVEN)
    max_worker_blocks: int = count(MAX_WORKER_BLOCKS, "KV blocks a worker may register, in its pool and in its swap "
                                                      "space each (beyond: INVALID_ARGUMENT)", up=GIVEN)


@dataclass(slots=True)
class LimitOptions:
    """Input bounds (scheduler_svc.frontend.limits): beyond one, a request is refused naming the field and bound."""

    max_message_size: int = option(MAX_MESSAGE_SIZE, "largest client request: one gRPC message (RESOURCE_EXHAUSTED "
                                                     "beyond) or one HTTP body (413), e.g. 16MiB",
                                   type=byte_size(1024), metavar="BYTES", show=format_bytes, up=GIVEN)
    max_prompt_chars: int | None = count(
        None, "characters of a text prompt, or of a chat's messages together, checked before tokenizing",
        default_text=f"{PROMPT_CHARS_PER_TOKEN} per token of max_model_len", up=GIVEN)
    max_stop_strings: int = count(MAX_STOP_STRINGS, f"stop strings per request, each up to {MAX_STOP_CHARS} "
                                                    "characters (and as many bad_words)", minimum=0, up=GIVEN)
    max_structured_output_bytes: int = option(
        MAX_STRUCTURED_OUTPUT_BYTES, "largest structured output spec (a JSON schema, regex or grammar; choices "
                                     "together), e.g. 256KiB", type=byte_size(1), metavar="BYTES", show=format_bytes,
        up=GIVEN)
    max_seqs_per_request: int = count(MAX_SEQS_PER_REQUEST, "sequences one request may ask for: n, times the "
                                                            "number of prompts of a /v1/completions batch", up=GIVEN)


@dataclass(slots=True)
class ConnectionOptions:
    """Connection bounds of the HTTP front and the gRPC ports (scheduler_svc.http.connections, scheduler_svc.server):
    the caps default to a share of the open files limit (raised to the hard limit at start)."""

    max_http_connections: int | None = count(
        None, "open connections to the HTTP front; one more gets 503 and is closed",
        default_text=f"a quarter of the open files limit, at most {DEFAULT_MAX_CONNECTIONS}", up=GIVEN)
    max_grpc_connections: int | None = count(
        None, "open connections to the client API (--listen); one more is closed at once",
        default_text=f"a quarter of the open files limit, at most {DEFAULT_MAX_CONNECTIONS}", up=GIVEN)
    max_connections_per_peer: int | None = count(
        None, "open connections one peer address (an IPv6 /64) may hold on each port: the HTTP front (503 beyond), "
              "the client API and the worker port (closed at once beyond); 0: no per-peer cap (behind a proxy, "
              "where every client has the proxy's address)", minimum=0,
        default_text=f"a quarter of each port's cap, at least {MIN_PER_PEER}", up=GIVEN)
    header_timeout: float = seconds(10.0, "a connection that has not sent a whole HTTP request head (or finished its "
                                          "gRPC handshake) this long after it opened or got its last answer is closed "
                                          "(HTTP: 408 if it sent part of one)", up=GIVEN)
    body_timeout: float = seconds(30.0, "an HTTP request body that brings no byte for this long is closed", up=GIVEN)


@dataclass(slots=True)
class SchedulerAccess:
    """NOTE: paths only, so that no key (TLS or API) reaches a repr or a log line."""

    tls_cert: str | None = option(None, "the scheduler's certificate (chain): TLS on the client API, the worker port "
                                        "and the HTTP front (needs --tls-key)", metavar="PEM", default_text="no TLS",
                                  up=GIVEN)
    tls_key: str | None = option(None, "the private key of --tls-cert", metavar="PEM", default_text="none", up=GIVEN)
    tls_ca: str | None = option(None, "the CA that signs the workers' client certificates: the worker port then "
                                      "requires one (mutual TLS; clients need none)", metavar="PEM",
                                default_text="none", up=GIVEN)
    api_key_file: str | None = option(None, "API keys, `KEY [NAME] [max-priority=N] [role=tenant|gateway|operator]` "
                                            "a line (# comments; the name: the key's tenant): the client API then "
                                            "requires `authorization: Bearer KEY` (gRPC metadata or HTTP header); "
                                            "health stays open", metavar="PATH", default_text="no keys", up=GIVEN)
    worker_token_file: str | None = option(None, WORKER_TOKEN_HELP + ": the worker port then requires "
                                                 "`authorization: Bearer TOKEN` with one of them (compared in "
                                                 "constant time); `pagedserve worker-token PATH` makes one",
                                           metavar="PATH", up=GIVEN,
                                           default_text="no token (up on loopback: a fresh one of its own)")
    insecure_workers: bool = option(False, "start even though --worker-listen is not loopback-only and neither "
                                           "mutual TLS (--tls-ca) nor --worker-token-file authenticates the "
                                           "workers (refused otherwise)", up=GIVEN)


@dataclass(slots=True)
class ObservabilityOptions:
    """Traces (scheduler_svc.tracing); metrics are --metrics (network)."""

    otlp_endpoint: str | None = option(
        None, "send OpenTelemetry traces (a span per request: queued, prefill, decode, migrated) over OTLP/gRPC to "
              "this collector, e.g. http://localhost:4317 (https:// for TLS); the OTEL_* variables of the SDK and "
              "exporter apply", metavar="URL", default_text="no traces", up=GIVEN)


@dataclass(slots=True)
class SchedulerOptions:
    """`pagedserve scheduler`."""

    model: str = option(DEFAULT_MODEL, MODEL_HELP, up=ALWAYS)
    revision: str | None = option(None, REVISION_HELP, metavar="REV", default_text="the repo's default branch",
                                  up=GIVEN)
    max_model_len: int | None = count(None, "longest sequence, prompt and output together",
                                      default_text="the model's, also the upper bound", up=GIVEN)
    served_model_name: tuple[str, ...] | None = option(
        None, "the model's name in the API (/v1/models, the `model` field, metrics); more names are aliases a request "
              "may use", nargs="+", metavar="NAME", default_text="--model", up=GIVEN)
    chat_template: str | None = option(None, "a Jinja chat template, a file or the template itself, in place of the "
                                             "model's", metavar="TEMPLATE", default_text="the model's", up=GIVEN)
    generation_config: str = option(
        "auto", "sampling defaults of requests that leave a field unset: auto (the model's generation_config.json: "
                "temperature, top_p, top_k, min_p, repetition_penalty, max_new_tokens, as vLLM's auto), vllm (none: "
                "the API's defaults) or a directory holding a generation_config.json", metavar="auto|vllm|DIR",
        up=GIVEN)
    tool_call_parser: str = option("none", "the model family's tool-call format, which tool_choice auto parses: "
                                           "hermes (Hermes/Qwen <tool_call> blocks), llama3_json (Llama 3's JSON) or "
                                           "none (tool_choice auto is refused)", choices=TOOL_CALL_PARSERS, up=GIVEN)
    network: SchedulerNetwork = group(SchedulerNetwork, "network")
    engine: EngineOptions = group(EngineOptions, "batching, KV cache, routing and failures")
    limits: LimitOptions = group(LimitOptions, "input bounds")
    connections: ConnectionOptions = group(ConnectionOptions, "connection bounds")
    access: SchedulerAccess = group(SchedulerAccess, "access (TLS, API keys, worker tokens)")
    observability: ObservabilityOptions = group(ObservabilityOptions, "observability")


# -- the worker ---------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class RunnerOptions:
    """The model runner's flags (worker_svc.worker.WorkerConfig)."""

    model: str = option(DEFAULT_MODEL, MODEL_HELP, up=ALWAYS)
    revision: str | None = option(None, REVISION_HELP, metavar="REV", default_text="the repo's default branch",
                                  up=GIVEN)
    device: str = option("cpu", "cpu, cuda (= cuda:0), cuda:N, or cuda:auto (the first GPU no other worker sharing "
                                "$PAGEDSERVE_CACHE has claimed: one GPU per compose replica)", type=parse_device)
    dtype: str = option("auto", "the weights' (and the KV cache's, under --kv-cache-dtype auto): auto is bfloat16 "
                                "on a CPU that computes it natively (AVX512-BF16 or AMX), float32 on any other CPU "
                                "(whatever the checkpoint's dtype), the checkpoint's dtype on a GPU; the worker's "
                                "start-up line says which and why (dtype, dtype_reason); float32 is the exact path",
                        choices=DTYPES, up=ALWAYS)
    weight_dtype: str = option("auto", "the weights a matmul reads: as-stored runs a quantised checkpoint's blocks "
                                       "(GGUF Q4_0, Q4_1, Q5_0, Q8_0, Q4_K, Q6_K; Hugging Face GPTQ, AWQ and "
                                       "compressed-tensors int4/int8, as Q4_0, Q5_0 or Q8_0) on the quantised "
                                       "kernel (CPU: C++; GPU: cuda/quant_gemm.cu through CuPy), dequantised in "
                                       "registers (refused where it cannot run); bfloat16 or float32 dequantise "
                                       "them at load into that dtype (then also the compute dtype); auto: as-stored "
                                       "where it runs on a CPU, else (and on a GPU, until the CUDA kernel is "
                                       "measured) dequantised to --dtype. The start-up line says which "
                                       "and why (weights_reason)", choices=WEIGHT_DTYPES, up=GIVEN)
    activation_dtype: str = option("auto", "what a matmul over weights kept quantised multiplies them with: auto, "
                                           "the float activations (the exact path: a float32 model's logits are the "
                                           "dequantised model's bit for bit); int8: each row quantised to int8 per "
                                           "32 inputs and multiplied in integers (AVX-512 VNNI or AVX2), as "
                                           "llama.cpp's CPU kernels do: several times faster matmuls, logits within "
                                           "about 1-2% (docs/models.md); CPU only; refused where no weight is kept "
                                           "quantised",
                                   choices=ACTIVATION_DTYPES, up=GIVEN)
    kv_cache_dtype: str = option("auto", "the KV cache's element type, whatever --dtype is: auto (the model's "
                                         "dtype), a float type, or 8 bits with one float32 scale per token and kv "
                                         "head (int8, fp8_e4m3, fp8_e5m2: about 3.8x the tokens of a float32 "
                                         "cache in the same --kv-memory)", choices=KV_CACHE_DTYPES, up=GIVEN)
    kv_memory: int | None = option(None, "bytes for the KV pool, e.g. 1GiB", type=byte_size(), metavar="BYTES",
                                   show=format_bytes, default_text=f"{format_bytes(CPU_KV_MEMORY)} on the CPU; on a "
                                                                    f"GPU, what its free memory allows", up=GIVEN)
    block_size: int = count(DEFAULT_BLOCK_SIZE, "tokens per KV block")
    threads: int | None = count(None, "compute threads on the CPU",
                                default_text="the cores this process may run on; under `up`, its share", up=GIVEN)
    attention_backend: str = option("auto", "auto: the C++ kernel on the CPU, CuPy kernels on a GPU",
                                    choices=ATTENTION_BACKENDS)
    int8_qk: str = option("auto", "an int8 cache's Q.K on the cpu backend in int8 (queries quantised per head per "
                                  "step, VNNI dot products, 32-bit sums; softmax and P.V in float): on needs a CPU "
                                  "with AVX-512 VNNI or AVX-VNNI; auto: on where the CPU has VNNI (measured: about 7% "
                                  "faster than dequantise-then-float at 4k-32k contexts, perplexity +0.14% against "
                                  "a float32 cache, +0.13% dequantised)",
                          choices=INT8_QK)
    transformers_forward: bool = option(False, "run the model through the transformers modules instead of the "
                                               "lean forward (not batch invariant)")
    batch_invariant: str = option("auto", "on: a sequence's logits do not depend on the sequences sharing its "
                                          "steps, how its prompt was chunked or whether it was recomputed (each "
                                          "matmul on one M-invariant kernel, attention rows on one path); off: the "
                                          "fastest kernel for each call's size (docs: the cost of on); auto: on on "
                                          "a CPU, off on a GPU, whose invariant matmul (a SIMT kernel, no tensor "
                                          "cores) has not been measured against cuBLAS yet",
                                  choices=BATCH_INVARIANT, up=GIVEN)
    cpu_path: str = option("native", "the CPU kernels' path: native (the best this CPU has) or a lesser CPU's, "
                                     "forced to run and test it here (amx, avx512-bf16: no AMX, avx512: no BF16 "
                                     "or VNNI, avx2)", choices=CPU_PATHS, up=GIVEN)
    swap_space: int = option(0, "host memory for swapped-out KV blocks, e.g. 4GiB (0: preemption recomputes)",
                             type=byte_size(), metavar="BYTES", show=format_bytes, up=GIVEN)


@dataclass(slots=True)
class WorkerAccess:
    tls_ca: str | None = option(None, "dial in over TLS, verifying the scheduler's certificate with this CA",
                                metavar="PEM", default_text="plaintext")
    tls_cert: str | None = option(None, "this worker's client certificate, signed by the CA of the scheduler's "
                                        "--tls-ca (needs --tls-key)", metavar="PEM", default_text="none")
    tls_key: str | None = option(None, "the private key of --tls-cert", metavar="PEM", default_text="none")
    tls_server_name: str | None = option(None, TLS_SERVER_NAME_HELP, metavar="NAME", default_text="the host dialled")
    worker_token_file: str | None = option(None, WORKER_TOKEN_HELP + ": this worker sends the first as "
                                                 "`authorization: Bearer TOKEN` when it attaches",
                                           metavar="PATH", default_text="no token")


@dataclass(slots=True)
class WorkerOptions:
    """`pagedserve worker`."""

    scheduler: str = option(DEFAULT_WORKER_LISTEN, "the scheduler's worker port (its --worker-listen)",
                            metavar="HOST:PORT")
    runner: RunnerOptions = group(RunnerOptions, "model and device")
    access: WorkerAccess = group(WorkerAccess, "access (TLS, worker token)")


# -- up -----------------------------------------------------------------------------------------------------------
@dataclass(slots=True)
class UpOptions:
    """`pagedserve up`'s own flags; it also has the scheduler's and the workers' that Option.up marks."""

    workers: int = count(1, "worker processes")
    device: str | None = option(None, "cpu, cuda (worker i on GPU i mod the number of visible GPUs) or cuda:N (all "
                                      "on GPU N)", type=parse_device, default_text="cuda when a GPU is visible")
    http: str = option(DEFAULT_HTTP, "the OpenAI-compatible HTTP API ('' = off)", metavar="HOST:PORT")
    startup_timeout: float = seconds(600.0, "seconds the scheduler and all workers may take to come up",
                                     positive=False)
