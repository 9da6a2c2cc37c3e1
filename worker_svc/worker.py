"""Assembles a worker: resolves and loads the model, sizes the KV pool, picks the attention backend."""

from __future__ import annotations

import os
from dataclasses import dataclass

import structlog
import torch

from pagedserve_common.config import BATCH_INVARIANT, CPU_KV_MEMORY, RunnerOptions
from worker_svc.attention import AttentionBackend, TorchAttentionBackend
from pagedserve_common.kv_geometry import KVGeometry
from pagedserve_common.registration import WorkerRegistration
from pagedserve_common.startup import USAGE, StartupError, one_line
from worker_svc.attention.quant import STORAGE
from worker_svc.heap import keep_heap_mapped, release_free_heap
from worker_svc.kv_pool import KVPool
from worker_svc.model_store import resolve_model
from worker_svc.models import ATTN_IMPLEMENTATION, load_model
from worker_svc.runner import ModelRunner

log = structlog.get_logger("pagedserve.worker")


@dataclass(slots=True, kw_only=True)
class WorkerConfig(RunnerOptions):
    """The worker's flags (pagedserve_common.config.RunnerOptions; device resolved: never cuda:auto) and the
    settings no flag sets."""

    gpu_memory_utilization: float = 0.9  # share of the GPU's memory the whole worker may use


GPU_HEADROOM = 256 * 2**20  # bytes left free on the GPU for what the profile doesn't see (allocator slack, NVRTC)


def _profile_kv_memory(runner_model, device: torch.device, utilization: float) -> int:
    """GPU: bytes for the KV pool after the weights and one max-size forward's activations, within what is free.

    Other processes (more workers, other jobs) may share the GPU, so the budget is the smaller of
    - our share of the GPU: `utilization` x its total memory minus this process's peak (weights + activations), and
    - what is actually free now, less room for the activations to come back and a small headroom."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    with torch.inference_mode():
        runner_model(input_ids=torch.zeros((1, 2048), dtype=torch.long, device=device), use_cache=False,
                     logits_to_keep=1)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()  # hand the activations back, so that `free` counts all but what we hold for good
    free, total = torch.cuda.mem_get_info(device)
    peak, held = torch.cuda.max_memory_allocated(device), torch.cuda.memory_allocated(device)
    share = int(total * utilization) - peak
    free_budget = free - (peak - held) - GPU_HEADROOM
    return max(0, min(share, free_budget))


def set_device(device: str) -> None:
    """Makes `device` (cpu, cuda, cuda:N) this process's current GPU, so that everything allocated or launched
    without an explicit index (torch's default stream, the CuPy kernels) lands on it too."""
    if not device.startswith("cuda"):
        return
    index = torch.device(device).index or 0
    if not torch.cuda.is_available() or index >= torch.cuda.device_count():
        raise StartupError(f"--device {device}: {torch.cuda.device_count() if torch.cuda.is_available() else 0} "
                           f"GPU(s) visible", USAGE)
    torch.cuda.set_device(index)


def available_cores() -> int:
    """The cores this process may run on (its affinity mask: what `pagedserve up` or taskset gave it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def wants_batch_invariance(setting: str, device: str) -> bool:
    """--batch-invariant: on and off as said; auto is on on a CPU (its invariant kernels' cost is measured:
    docs/worker.md) and off on a GPU, until bench/gpu_invariant.py measures cuda/dense_gemm.cu there."""
    if setting not in BATCH_INVARIANT:
        raise ValueError(f"batch_invariant must be one of {', '.join(BATCH_INVARIANT)}, got {setting!r}")
    return setting == "on" or (setting == "auto" and torch.device(device).type == "cpu")


def make_backend(name: str, device: str, geometry: KVGeometry, int8_qk: str = "auto",
                 batch_invariant: bool = True) -> AttentionBackend:
    """The attention backend `--attention-backend name` picks for `device` and the pool's geometry; int8_qk is
    `--int8-qk` (auto|on|off): on is refused (StartupError) wherever the int8 Q.K path cannot run."""
    if name not in ("auto", "cpu", "torch", "cupy"):
        raise ValueError(f"attention backend must be auto, cpu, torch or cupy, got {name!r}")
    if int8_qk not in ("auto", "on", "off"):
        raise ValueError(f"int8_qk must be auto, on or off, got {int8_qk!r}")
    backend = _pick_backend(name, device, geometry)
    if hasattr(backend, "batch_invariant"):
        backend.batch_invariant = batch_invariant
    if int8_qk == "on":
        if geometry.dtype != "int8":
            raise StartupError(f"--int8-qk on: needs --kv-cache-dtype int8 (this cache is {geometry.dtype})", USAGE)
        if backend.name != "cpu":
            raise StartupError(f"--int8-qk on: needs the cpu attention backend (this worker uses {backend.name})",
                               USAGE)
    if backend.name == "cpu" and geometry.dtype == "int8" and int8_qk != "off":
        from worker_svc.attention.cpu_backend import INT8_QK_AUTO, int8_qk_width
        if int8_qk_width(backend.lib) == 0:
            if int8_qk == "on":
                raise StartupError("--int8-qk on: the attention kernel here has no int8 dot product (this CPU has "
                                   "neither AVX-512 VNNI nor AVX-VNNI, or the kernel is a portable prebuilt build "
                                   "without them); use --int8-qk auto or off", USAGE)
        elif int8_qk == "on" or INT8_QK_AUTO:
            backend.int8_qk = True
    return backend


def _pick_backend(name: str, device: str, geometry: KVGeometry) -> AttentionBackend:
    if name == "cupy" or (name == "auto" and device.startswith("cuda")):
        from worker_svc.attention.cupy_backend import CupyAttentionBackend  # NOTE: cupy only on a GPU
        return CupyAttentionBackend()
    if name == "torch" or device != "cpu":
        return TorchAttentionBackend()
    from worker_svc.attention.cpu_backend import CpuAttentionBackend
    if not CpuAttentionBackend.supports(STORAGE[geometry.dtype], geometry.head_dim, geometry.block_size):
        if name == "cpu":
            raise ValueError(f"the CPU kernel has no {geometry.dtype} / head_dim {geometry.head_dim} / block_size "
                             f"{geometry.block_size} instance")
        return TorchAttentionBackend()
    try:
        return CpuAttentionBackend()
    except (RuntimeError, OSError) as e:
        if name == "cpu":
            raise
        log.warning("the C++ attention kernel is unavailable; using the torch backend", error=str(e))
        return TorchAttentionBackend()


def create_runner(cfg: WorkerConfig, backend: AttentionBackend | None = None) -> tuple[ModelRunner,
                                                                                    WorkerRegistration]:
    """The runner, and what the worker registers with (its name is filled in when it dials in)."""
    heap = keep_heap_mapped()
    log.info("heap kept mapped between steps" if heap.applied else "heap settings unchanged", detail=heap.reason)
    if cfg.device == "cpu":
        torch.set_num_threads(cfg.threads or available_cores())
    set_device(cfg.device)
    model_dir = resolve_model(cfg.model, cfg.revision)
    try:
        loaded = load_model(model_dir, cfg.dtype, cfg.device, model_id=cfg.model, weight_dtype=cfg.weight_dtype,
                            lean=not cfg.transformers_forward, activation_dtype=cfg.activation_dtype)
    except (OSError, ValueError) as e:  # NOTE: a missing or broken weights file, an unsupported architecture
        raise StartupError(f"--model {cfg.model}: cannot load it from {model_dir}: {one_line(e)}") from None
    geometry = loaded.kv_geometry(cfg.block_size, cfg.kv_cache_dtype)
    kv_memory = cfg.kv_memory
    if kv_memory is None:
        if cfg.device.startswith("cuda"):
            # Profiling runs the model with sdpa: the paged hook needs a pool, which is what we are sizing.
            loaded.model.set_attn_implementation("sdpa")
            kv_memory = _profile_kv_memory(loaded.model, torch.device(cfg.device), cfg.gpu_memory_utilization)
            loaded.model.set_attn_implementation(ATTN_IMPLEMENTATION)
        else:
            kv_memory = CPU_KV_MEMORY
    pool = KVPool(geometry, geometry.num_blocks_for(kv_memory), cfg.device, geometry.num_blocks_for(cfg.swap_space))
    invariant = wants_batch_invariance(cfg.batch_invariant, cfg.device)
    if cfg.batch_invariant == "auto" and not invariant:
        log.info("batch invariance is off on a GPU by default (--batch-invariant auto): its invariant matmul "
                 "(cuda/dense_gemm.cu, SIMT) is not measured against cuBLAS yet; --batch-invariant on runs it")
    backend = backend or make_backend(cfg.attention_backend, cfg.device, geometry, cfg.int8_qk, invariant)
    runner = ModelRunner(loaded, pool, backend, lean=not cfg.transformers_forward, batch_invariant=invariant)
    release_free_heap()  # NOTE: what loading freed (heap.py); before the warm-up, whose memory the steps reuse
    if invariant and not runner.batch_invariant:
        log.warning("batch invariance is off: a sequence's tokens may depend on the sequences beside it",
                    reason=runner.batch_invariant_reason)
    reg = WorkerRegistration(model_id=cfg.model, max_model_len=loaded.max_model_len, device=cfg.device,
                             kv_geometry=geometry, num_blocks=pool.num_blocks, num_cpu_blocks=pool.num_cpu_blocks)
    return runner, reg
