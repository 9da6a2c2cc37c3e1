"""The same kernel comparisons as test_kernels_host.py, through CuPy on a GPU (skipped without one)."""

from __future__ import annotations

import secrets

import numpy as np
import pytest
import torch

from tests.kernels.cases import GQA, check_forward, make_case, make_quant_case
from tests.kernels.invariance_cases import decode_and_chunk_cases, make_scene

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CACHE_DTYPES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]  # 8-bit caches (issue 25)


@pytest.fixture(scope="module")
def gpu_backend_cls():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("cupy")
    from worker_svc.attention.cupy_backend import CupyAttentionBackend, CupyLauncher

    launcher = CupyLauncher()  # compiles once for the module

    def make(**kw):
        return CupyAttentionBackend(launcher, poison_workspace=True, **kw)

    return make


def fresh_rng():
    seed = secrets.randbits(63)
    return np.random.default_rng(seed), seed


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", GQA)
@pytest.mark.parametrize("block_size", [8, 16, 128])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_kernel_gpu_decode(gpu_backend_cls, dtype, heads, block_size, head_dim):
    rng, seed = fresh_rng()
    for be in (gpu_backend_cls(), gpu_backend_cls(partition_size=int(rng.integers(20, 80)))):
        query, kv_layer, meta, _ = make_case(rng, be, ["decode"] * 5, block_size, *heads, head_dim, dtype,
                                             device="cuda", max_blocks=8)  # fmt: skip
        check_forward(be, query, kv_layer, meta, seed)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", GQA)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_kernel_gpu_mixed_batch(gpu_backend_cls, dtype, heads, head_dim):
    rng, seed = fresh_rng()
    be = gpu_backend_cls()
    kinds = list(rng.permutation(["decode", "chunk", "decode", "prefill", "chunk", "decode"]))
    query, kv_layer, meta, _ = make_case(rng, be, kinds, int(rng.choice([8, 16, 32])), *heads, head_dim, dtype,
                                         device="cuda", max_blocks=6)  # fmt: skip
    check_forward(be, query, kv_layer, meta, seed)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_kernel_gpu_long_context_decode(gpu_backend_cls, dtype):
    """Long contexts with the default split sizing (from the SM count)."""
    rng, seed = fresh_rng()
    be = gpu_backend_cls()
    query, kv_layer, meta, _ = make_case(rng, be, ["decode"] * 2, 16, 32, 8, 128, dtype, device="cuda",
                                         max_blocks=300)  # fmt: skip
    check_forward(be, query, kv_layer, meta, seed)


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_gpu_write_kv_and_copy_blocks(gpu_backend_cls, dtype):
    be = gpu_backend_cls()
    pool = torch.full((2, 2, 6, 8, 3, 64), float("nan"), dtype=dtype, device="cuda")
    slots = torch.randperm(48, device="cuda")[:17]
    key = torch.randn(34, 3, 64, device="cuda").to(dtype)[::2]
    value = torch.randn(34, 3, 64, device="cuda").to(dtype)[1::2]
    be.write_kv(pool[1], key, value, slots)
    torch.cuda.synchronize()
    flat = pool[1].reshape(2, 48, 3, 64)
    assert torch.equal(flat[0, slots], key) and torch.equal(flat[1, slots], value)
    assert torch.isnan(pool[0]).all()

    pool = torch.randn(3, 2, 10, 8, 2, 64, device="cuda").to(dtype)
    copies = [(1, 7), (4, 2), (4, 9), (0, 5)]
    expected = pool.clone()
    expected[:, :, [d for _, d in copies]] = expected[:, :, [s for s, _ in copies]]
    be.copy_blocks(pool, copies)
    torch.cuda.synchronize()
    assert torch.equal(pool, expected)


# ---- 8-bit caches: the write is bit-identical to quant.quantize (checked inside make_quant_case) ---------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("cache", CACHE_DTYPES)
@pytest.mark.parametrize("head_dim", [64, 128])
def test_kernel_gpu_quant_mixed_batch(gpu_backend_cls, dtype, cache, head_dim):
    rng, seed = fresh_rng()
    heads = GQA[int(rng.integers(len(GQA)))]
    kinds = list(rng.permutation(["decode", "chunk", "decode", "prefill", "chunk", "decode"]))
    for be in (gpu_backend_cls(), gpu_backend_cls(partition_size=int(rng.integers(20, 80)))):
        c = make_quant_case(rng, be, kinds, int(rng.choice([8, 16, 32])), *heads, head_dim, dtype, cache,
                            device="cuda", max_blocks=6)  # fmt: skip
        check_forward(be, c.query, c.kv_layer, c.meta, seed, kv_scales=c.kv_scales)


@pytest.mark.parametrize("cache", CACHE_DTYPES)
def test_kernel_gpu_quant_long_context_decode(gpu_backend_cls, cache):
    rng, seed = fresh_rng()
    be = gpu_backend_cls()
    c = make_quant_case(rng, be, ["decode"] * 2, 16, 32, 8, 128, torch.float16, cache, device="cuda",
                        max_blocks=300)  # fmt: skip
    check_forward(be, c.query, c.kv_layer, c.meta, seed, kv_scales=c.kv_scales)


def test_kernel_gpu_quant_copy_blocks_of_scales(gpu_backend_cls):
    be = gpu_backend_cls()
    for t in (torch.rand(3, 2, 10, 16, 8, device="cuda"),  # the scales tensor
              torch.randint(-127, 128, (3, 2, 10, 16, 8, 64), dtype=torch.int8, device="cuda")):  # int8 codes
        copies = [(1, 7), (4, 2), (4, 9), (0, 5)]
        expected = t.clone()
        expected[:, :, [d for _, d in copies]] = expected[:, :, [s for s, _ in copies]]
        be.copy_blocks(t, copies)
        torch.cuda.synchronize()
        assert torch.equal(t, expected)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("head_dim", [64, 256])
@pytest.mark.parametrize("partition", [None, 16])
def test_kernel_gpu_sliding_window(gpu_backend_cls, dtype, head_dim, partition):
    """A sliding window on the device (test_kernels_host_window.py on the host): blocks before it NaN."""
    from tests.support.attention import TOL, windowed_batch
    from worker_svc.attention import AttentionMetadata, reference_attention

    rng, seed = fresh_rng()
    be = gpu_backend_cls(partition_size=partition)
    query, pool, meta, poisoned = windowed_batch(rng, ["decode", "chunk", "prefill", "decode"], 16, 4, 1, head_dim,
                                                 dtype, 37)
    assert poisoned > 0
    scale = head_dim ** -0.5
    tables = [t[:int(n)] for t, n in zip(meta.block_tables.tolist(), -(-meta.seq_lens_host // 16))]
    on_device = AttentionMetadata.build(np.diff(meta.query_start_loc_host), meta.seq_lens_host, tables, 16,
                                        device="cuda")
    out = be.forward(query.cuda(), pool.cuda(), on_device, scale, window=37).cpu()
    ref = reference_attention(query, pool, meta, scale, window=37)
    assert torch.isfinite(out).all(), f"seed {seed}"
    assert (torch.linalg.norm(out.double() - ref) / torch.linalg.norm(ref)).item() < TOL[dtype], f"seed {seed}"


@pytest.mark.parametrize("window", [0, 37])
@pytest.mark.parametrize("dtype,cache", [(torch.float16, None), (torch.bfloat16, None), (torch.float32, torch.int8)])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_kernel_gpu_rows_are_batch_invariant(gpu_backend_cls, head_dim, dtype, cache, window):
    """test_kernels_host_invariant.py on the device: with batch_invariant, a row's bits do not depend on how its step
    is made up (prefill, chunk, decode; alone or beside others)."""
    rng = np.random.default_rng([head_dim, window, dtype.itemsize])
    be = gpu_backend_cls(batch_invariant=True)
    scene = make_scene(be, rng, dtype, cache, (8, 2), head_dim, device="cuda")
    cases = dict(decode_and_chunk_cases(scene, be, window))
    want = cases.pop("prefill")
    for name, got in cases.items():
        assert torch.equal(got, want), f"{name}: not the prefill's bits"
