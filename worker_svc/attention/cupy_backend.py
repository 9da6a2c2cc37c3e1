"""Attention backend running our own CUDA kernels (cuda/paged_attention.cu) through CuPy, on torch's pool tensor.

The kernels are compiled at first use with CuPy's RawModule (NVRTC) and launched on torch's current stream, with
raw device pointers of the torch tensors (zero-copy: the kernels read and write the very memory torch allocated,
the pool included; no DLPack capsule is needed per launch) plus element strides, so a per-layer view of the one
[layers, 2, num_blocks, block_size, kv_heads, head_dim] pool tensor works as is. An 8-bit pool (int8 / fp8 codes,
worker_svc/attention/quant.py) runs the kernels instantiated for its cache type, which quantise on write and
dequantise each K/V row with its float32 scale as they load it; queries and outputs stay in the query's dtype.

Everything but the launch itself is plain torch/numpy: `CupyAttentionBackend` takes a launcher object with
`launch(name, grid, block, args)`. The default `CupyLauncher` needs cupy and a GPU; the CPU tests pass a launcher
that runs the same .cu file compiled for the host (tests/kernels/conftest.py), so this file's planning logic
(split sizes, argument order, workspace layout) is exercised on every run, not only on GPU machines.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any, Protocol, Sequence

import numpy as np
import torch

from worker_svc.attention.backend import AttentionBackend, check_shapes
from worker_svc.attention.metadata import AttentionMetadata

# NOTE: the kernels live at the repository's top (cuda/); an installed copy (the container image) says where
# it put them with PAGEDSERVE_CUDA_DIR.
CUDA_DIR = Path(os.environ.get("PAGEDSERVE_CUDA_DIR") or Path(__file__).resolve().parents[2] / "cuda")
KERNEL_SOURCE = CUDA_DIR / "paged_attention.cu"
QUANT_GEMM_SOURCE = CUDA_DIR / "quant_gemm.cu"  # the quantised-weight matmuls (worker_svc/quant/cupy_kernel.py)
DENSE_GEMM_SOURCE = CUDA_DIR / "dense_gemm.cu"  # the batch-invariant float matmul and norm (worker_svc/dense_gpu.py)

DTYPE_TAGS = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}
# 8-bit caches: kernel names are <kind>_<query tag>_<cache tag>_d<HD> and write_kv_<query tag>_<cache tag>.
CACHE_TAGS = {torch.int8: "i8", torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}
HEAD_DIMS = (64, 128, 256)  # instantiated in paged_attention.cu
TILE = 64  # keys per tile in the kernels (paged_attention.cu)
DECODE_MAX_ROWS = 8  # MAXR of paged_decode: heads per CTA
PREFILL_MAX_ROWS = 16  # MAXR of paged_prefill: q_tile * heads per CTA


class Launcher(Protocol):
    """Runs one kernel of paged_attention.cu by its extern "C" name."""

    num_sms: int

    def launch(self, name: str, grid: tuple[int, int, int], block: int, args: Sequence[Any]) -> None: ...


def ptr(t: torch.Tensor | None) -> np.uint64:
    return np.uint64(0 if t is None else t.data_ptr())


def i64(x: int) -> np.int64:
    return np.int64(x)


def i32(x: int) -> np.int32:
    return np.int32(x)


def largest_divisor_at_most(n: int, cap: int) -> int:
    return max(d for d in range(1, min(n, cap) + 1) if n % d == 0)


class CupyLauncher:
    """Compiles one kernel file (default cuda/paged_attention.cu) once with cupy.RawModule and launches on torch's
    current stream."""

    def __init__(self, device: torch.device | int | None = None, extra_options: Sequence[str] = (),
                 source: Path = KERNEL_SOURCE) -> None:
        import cupy  # lazy: cupy is only on GPU machines

        self._cupy = cupy
        if device is None:
            index = torch.cuda.current_device()
        elif isinstance(device, int):
            index = device
        else:
            index = torch.device(device).index
            index = torch.cuda.current_device() if index is None else index
        self._device_index = int(index)
        options = ["--std=c++17", f"-I{CUDA_DIR}", *_cuda_include_options(), *extra_options]
        with cupy.cuda.Device(self._device_index):
            self.module = cupy.RawModule(code=Path(source).read_text(), options=tuple(options))
            self.num_sms = int(cupy.cuda.Device(self._device_index).attributes["MultiProcessorCount"])
        self._functions: dict[str, Any] = {}
        self._streams: dict[int, Any] = {}

    def launch(self, name: str, grid: tuple[int, int, int], block: int, args: Sequence[Any]) -> None:
        cupy = self._cupy
        fn = self._functions.get(name)
        if fn is None:
            fn = self._functions[name] = self.module.get_function(name)
        handle = torch.cuda.current_stream(self._device_index).cuda_stream
        stream = self._streams.get(handle)
        if stream is None:
            stream = self._streams[handle] = cupy.cuda.ExternalStream(handle, self._device_index)
        with cupy.cuda.Device(self._device_index), stream:
            fn(grid, (block, 1, 1), tuple(args))


def _cuda_include_options() -> list[str]:
    """-I for folders holding cuda_fp16.h/cuda_bf16.h: NVRTC (13.x included) has no built-in copy of them."""
    import glob
    import site

    dirs = []
    for env in ("CUDA_PATH", "CUDA_HOME"):
        if os.environ.get(env):
            dirs.append(Path(os.environ[env]) / "include")
    try:  # where CuPy itself found the toolkit, if it did
        import cupy

        if cupy.cuda.get_cuda_path():
            dirs.append(Path(cupy.cuda.get_cuda_path()) / "include")
    except Exception:  # noqa: BLE001 - cupy missing or without a toolkit: the other candidates remain
        pass
    dirs.append(Path("/usr/local/cuda/include"))
    for sp in site.getsitepackages():  # nvidia-cuda-runtime(-cu12) / cu13 wheels
        dirs += [Path(d) for d in sorted(glob.glob(f"{sp}/nvidia/*/include"))]
    seen, result = set(), []
    for d in dirs:
        if (d / "cuda_fp16.h").is_file() and d not in seen:
            seen.add(d)
            result.append(f"-I{d}")
    return result


class CupyAttentionBackend(AttentionBackend):
    """Paged attention with the kernels of cuda/paged_attention.cu.

    Decode sequences (q_len 1) run paged_decode (split over the context across CTAs when the batch alone
    cannot fill the GPU, then paged_decode_reduce); the other sequences run paged_prefill in the same step.
    Head dims without a kernel instantiation fall back to TorchAttentionBackend.
    8-bit pools (int8 / float8_e4m3fn / float8_e5m2 codes with kv_scales) run the kernels instantiated for
    (query dtype, cache dtype): write_kv quantises as quant.quantize does, bit for bit, and attention dequantises
    each K/V row with its scale as it loads it.

    launcher: default CupyLauncher() (GPU). num_threads: threads per attention CTA (multiple of 32, <= 256).
    partition_size: force the decode split size in keys (tests); default sized from the SM count.
    batch_invariant: a row's output independent of the batch (the worker sets it from --batch-invariant). Every
    kernel walks a row's keys in the same tiles of the absolute grid (paged_attention.cu), so a prefill row and a
    decode row agree bit for bit, whatever else shares their CTA; what is left is the decode split, whose count
    follows the batch (fewer sequences, more splits to fill the SMs) and whose merge is a different sum: invariant,
    a decode never splits (vLLM's batch-invariant mode does the same with FlashAttention's num_splits=1). The cost
    falls on long contexts at small batches, one CTA a (sequence, head group) walking the whole context.
    """

    name = "cupy"

    def __init__(
        self,
        launcher: Launcher | None = None,
        num_threads: int = 128,
        partition_size: int | None = None,
        min_partition: int = 512,
        poison_workspace: bool = False,
        batch_invariant: bool = False,
    ) -> None:
        if num_threads % 32 or not 32 <= num_threads <= 256:
            raise ValueError(f"num_threads must be a multiple of 32 in [32, 256], got {num_threads}")
        if batch_invariant and partition_size is not None:
            raise ValueError("partition_size forces a decode split, which batch_invariant rules out")
        self.batch_invariant = batch_invariant
        self._launcher = launcher
        self.num_threads = num_threads
        self.partition_size = partition_size
        self.min_partition = min_partition
        self.poison_workspace = poison_workspace  # tests: NaN-fill the split workspace before each launch
        self._fallback = None

    @property
    def launcher(self) -> Launcher:
        if self._launcher is None:
            self._launcher = CupyLauncher()
        return self._launcher

    # ---- write_kv ------------------------------------------------------------------------------------------
    def write_kv(
        self, kv_layer: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor,
        kv_scales: torch.Tensor | None = None,
    ) -> None:
        _, _, block_size, kvh, hd = kv_layer.shape
        if kv_layer.stride(-1) != 1:
            raise ValueError("kv_layer's head_dim must be contiguous")
        if (kv_layer.dtype in CACHE_TAGS) != (kv_scales is not None):
            raise ValueError(f"a {kv_layer.dtype} pool layer {'needs' if kv_scales is None else 'has no'} kv_scales")
        if kv_scales is not None:
            self._write_kv_quantized(kv_layer, kv_scales, key, value, slot_mapping)
            return
        key = _last_dim_contiguous(key.to(kv_layer.dtype))
        value = _last_dim_contiguous(value.to(kv_layer.dtype))
        slots = slot_mapping.to(device=kv_layer.device, dtype=torch.int64).contiguous()
        n = slots.shape[0]
        if n == 0:
            return
        s = kv_layer.stride()
        self.launcher.launch(
            f"write_kv_{DTYPE_TAGS[kv_layer.dtype]}",
            (n, 1, 1),
            min(self.num_threads, max(32, kvh * hd)),
            [
                ptr(kv_layer), i64(s[0]), i64(s[1]), i64(s[2]), i64(s[3]),
                ptr(key), i64(key.stride(0)), i64(key.stride(1)),
                ptr(value), i64(value.stride(0)), i64(value.stride(1)),
                ptr(slots), i32(kvh), i32(hd), i32(block_size),
            ],
        )

    def _write_kv_quantized(
        self, kv_layer: torch.Tensor, kv_scales: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """One pass: each (token, kv head) row of K and V -> codes + its scale (write_kv_<T>_<C>)."""
        _, _, block_size, kvh, hd = kv_layer.shape
        check_shapes(key, kv_layer, kv_scales)
        in_dtype = key.dtype if key.dtype in DTYPE_TAGS else torch.float32
        key = _last_dim_contiguous(key.to(in_dtype))
        value = _last_dim_contiguous(value.to(in_dtype))
        slots = slot_mapping.to(device=kv_layer.device, dtype=torch.int64).contiguous()
        if slots.shape[0] == 0:
            return
        s = kv_layer.stride()
        self.launcher.launch(
            f"write_kv_{DTYPE_TAGS[in_dtype]}_{CACHE_TAGS[kv_layer.dtype]}",
            (slots.shape[0], 1, 1),
            min(self.num_threads, 32 * 2 * kvh),  # one warp per (K or V, kv head) row
            [
                ptr(kv_layer), i64(s[0]), i64(s[1]), i64(s[2]), i64(s[3]),
                *_scale_args(kv_scales),
                ptr(key), i64(key.stride(0)), i64(key.stride(1)),
                ptr(value), i64(value.stride(0)), i64(value.stride(1)),
                ptr(slots), i32(kvh), i32(hd), i32(block_size),
            ],
        )  # fmt: skip

    # ---- forward ---------------------------------------------------------------------------------------------
    def forward(
        self,
        query: torch.Tensor,
        kv_layer: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        kv_scales: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        window: int = 0,
    ) -> torch.Tensor:
        """As AttentionBackend.forward; `out` (optional, [T, H, hd] in the compute dtype: the pool's for a float
        cache, the query's (float32 unless float16/bfloat16) for an 8-bit one) receives the result."""
        num_heads, num_kv_heads, hd = check_shapes(query, kv_layer, kv_scales)
        if query.shape[0] != meta.num_tokens:
            raise ValueError(f"query has {query.shape[0]} tokens, metadata {meta.num_tokens}")
        if not 0 <= window < 2**31:
            raise ValueError(f"window must be 0 (none) or positive (an int32), got {window}")
        quantized = kv_scales is not None
        if hd not in HEAD_DIMS or not (quantized or kv_layer.dtype in DTYPE_TAGS):
            result = self._torch_fallback().forward(query, kv_layer, meta, scale, kv_scales=kv_scales, window=window)
            return result if out is None else out.copy_(result)
        if kv_layer.stride(-1) != 1:
            raise ValueError("kv_layer's head_dim must be contiguous")
        if quantized:
            compute = query.dtype if query.dtype in DTYPE_TAGS else torch.float32
        else:
            compute = kv_layer.dtype
        query = _last_dim_contiguous(query.to(compute))
        _check_alignment(kv_layer, query)
        if out is None:
            out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        elif out.shape != query.shape or out.dtype != query.dtype or out.stride(-1) != 1:
            raise ValueError(f"out must be [T, num_heads, head_dim] in {compute}, head_dim contiguous")
        if meta.num_seqs == 0:
            return out
        reduce_tag = f"{DTYPE_TAGS[compute]}_d{hd}"  # the split reduce depends on the output type only
        tag = f"{DTYPE_TAGS[compute]}_{CACHE_TAGS[kv_layer.dtype]}_d{hd}" if quantized else reduce_tag
        block_size = kv_layer.shape[2]
        s = kv_layer.stride()
        tables = meta.block_tables.to(torch.int32).contiguous()
        seq_lens = meta.seq_lens.to(torch.int32).contiguous()
        qsl = meta.query_start_loc.to(torch.int32).contiguous()
        group = num_heads // num_kv_heads
        common = [
            ptr(out), i64(out.stride(0)), i64(out.stride(1)),
            ptr(query), i64(query.stride(0)), i64(query.stride(1)),
            ptr(kv_layer), i64(s[0]), i64(s[1]), i64(s[2]), i64(s[3]),
            *_scale_args(kv_scales),
            ptr(tables), i64(tables.stride(0) if tables.dim() == 2 and tables.shape[1] else 0),
            ptr(seq_lens), ptr(qsl),
        ]  # fmt: skip

        if meta.num_decodes:
            seq_index = None if meta.is_all_decode else meta.decode_seqs.to(torch.int64).contiguous()
            hpc = largest_divisor_at_most(group, DECODE_MAX_ROWS)
            n_dec = meta.num_decodes
            # a sliding-window layer's decode splits cover only its window's keys
            visible = min(meta.max_decode_seq_len, window) if window > 0 else meta.max_decode_seq_len
            partition, splits = self._decode_partition(visible, n_dec * (num_heads // hpc))
            if splits > 1:
                part_out = torch.empty((n_dec, num_heads, splits, hd), dtype=torch.float32, device=query.device)
                part_ml = torch.empty((n_dec, num_heads, splits, 2), dtype=torch.float32, device=query.device)
                if self.poison_workspace:
                    part_out.fill_(float("nan"))
                    part_ml.fill_(float("nan"))
            else:
                part_out = part_ml = None
            self.launcher.launch(
                f"paged_decode_{tag}",
                (num_heads // hpc, n_dec, splits),
                self.num_threads,
                [
                    *common, ptr(seq_index), ptr(part_out), ptr(part_ml),
                    i32(num_heads), i32(num_kv_heads), i32(hpc), i32(block_size), i32(partition),
                    np.float32(scale), i32(window),
                ],
            )  # fmt: skip
            if splits > 1:
                self.launcher.launch(
                    f"paged_decode_reduce_{reduce_tag}",
                    (num_heads, n_dec, 1),
                    min(hd, self.num_threads),
                    [
                        ptr(out), i64(out.stride(0)), i64(out.stride(1)), ptr(part_out), ptr(part_ml),
                        ptr(seq_lens), ptr(qsl), ptr(seq_index), i32(num_heads), i32(splits), i32(partition),
                        i32(window),
                    ],
                )  # fmt: skip

        if not meta.is_all_decode:
            hpc = largest_divisor_at_most(group, DECODE_MAX_ROWS)
            q_tile = PREFILL_MAX_ROWS // hpc
            self.launcher.launch(
                f"paged_prefill_{tag}",
                (num_heads // hpc, meta.num_seqs, -(-meta.max_query_len // q_tile)),
                self.num_threads,
                [
                    *common, i32(num_heads), i32(num_kv_heads), i32(hpc), i32(q_tile), i32(block_size),
                    i32(2 if meta.num_decodes else 1), np.float32(scale), i32(window),
                ],
            )  # fmt: skip
        return out

    def _decode_partition(self, max_ctx: int, ctas_per_split: int) -> tuple[int, int]:
        """(keys per split, number of splits) for the decode pass."""
        max_ctx = max(int(max_ctx), 1)
        if self.batch_invariant:  # one split: see the class's docstring
            return -(-max_ctx // TILE) * TILE, 1
        if self.partition_size is not None:
            return self.partition_size, -(-max_ctx // self.partition_size)
        # Enough CTAs for ~2 waves over the SMs, but no split shorter than min_partition keys.
        want = max(1, -(-2 * int(getattr(self.launcher, "num_sms", 1)) // max(ctas_per_split, 1)))
        splits = max(1, min(want, max_ctx // self.min_partition))
        per_split = -(-max_ctx // splits)
        partition = -(-per_split // TILE) * TILE  # whole tiles
        return partition, -(-max_ctx // partition)

    def _torch_fallback(self) -> AttentionBackend:
        if self._fallback is None:
            from worker_svc.attention.torch_backend import TorchAttentionBackend

            self._fallback = TorchAttentionBackend()
        return self._fallback

    # ---- copy_blocks -----------------------------------------------------------------------------------------
    def copy_blocks(self, kv_pool: torch.Tensor, copies: Sequence[tuple[int, int]]) -> None:
        """Copy whole blocks src -> dst in every layer, K and V, of a [layers, 2, num_blocks, ...] tensor: the
        [layers, 2, nb, bs, kvh, hd] pool (any element type, 8-bit codes included) or an 8-bit cache's
        [layers, 2, nb, bs, kvh] float32 scales.

        NOTE: all pairs run concurrently: no dst may also be a src of the same call (true for copy-on-write,
        whose dst is a freshly allocated block).
        """
        if not copies:
            return
        if kv_pool.dim() < 3 or kv_pool.shape[1] != 2:
            raise ValueError(f"kv_pool must be [layers, 2, num_blocks, ...], got {tuple(kv_pool.shape)}")
        if not kv_pool[0, 0, 0].is_contiguous():
            raise ValueError("a block's tile (kv_pool[layer, k/v, block]) must be contiguous")
        item = kv_pool.element_size()
        block_bytes = kv_pool[0, 0, 0].numel() * item
        strides = [kv_pool.stride(i) * item for i in range(3)]
        # The widest word that divides the block, the strides and the base address (bytes, for a 1-byte pool
        # whose block is an odd number of bytes).
        width, name = next((w, n) for w, n in ((16, "u128"), (4, "u32"), (2, "u16"), (1, "u8"))
                           if all(x % w == 0 for x in (block_bytes, *strides, kv_pool.data_ptr())))
        pairs = torch.tensor(list(copies), dtype=torch.int64).T.contiguous().to(kv_pool.device)
        src, dst = pairs[0], pairs[1]
        self.launcher.launch(
            f"copy_blocks_{name}",
            (len(copies), kv_pool.shape[0] * 2, 1),
            self.num_threads,
            [
                ptr(kv_pool), i64(strides[0] // width), i64(strides[1] // width), i64(strides[2] // width),
                i64(block_bytes // width), ptr(src), ptr(dst),
            ],
        )  # fmt: skip


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def _scale_args(kv_scales: torch.Tensor | None) -> list:
    """An 8-bit cache's scales pointer and element strides (kv, block, slot, head); nothing for a float cache."""
    if kv_scales is None:
        return []
    return [ptr(kv_scales), *(i64(st) for st in kv_scales.stride())]


def _check_alignment(kv_layer: torch.Tensor, query: torch.Tensor) -> None:
    """K/V rows are loaded in 16-byte vectors (8 bytes in P @ V; 4 bytes for a 1-byte cache's codes).

    NOTE: a 1-byte pool needs head_dim a multiple of 16 (true of 64/128/256) and 16-byte strides: the pool's
    own layout gives them. Its scales are read one float at a time (any strides).
    """
    item = kv_layer.element_size()
    if kv_layer.data_ptr() % 16 or any((st * item) % 16 for st in kv_layer.stride()[:4]):
        raise ValueError("kv_layer must be 16-byte aligned (data pointer and strides)")
    if math.prod(query.shape) and query.data_ptr() % query.element_size():
        raise ValueError("query is misaligned")
