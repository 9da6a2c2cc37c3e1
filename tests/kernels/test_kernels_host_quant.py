"""cuda/paged_attention.cu's 8-bit caches (int8, fp8 e4m3, fp8 e5m2) on the host shim, without a GPU.

1. common.cuh's fp8 conversions against torch: decoding of all 256 codes bit for bit, encoding of a sweep of
   floats (every value, every tie between neighbours and its two float32 neighbours, random bit patterns, inf,
   zeros, float32 subnormals) bit for bit against torch's `.to(float8_*)` after the clamp quant.quantize does.
2. The quantising write (write_kv_<query>_<cache>): codes and scales bit-identical to quant.quantize, only
   the given slots written.
3. Attention over 8-bit pools vs the float64 reference reading the same codes x scales, with the float caches'
   bounds (TOL: 1e-5 relative for float32 queries, 1e-2 for float16/bfloat16): unwritten slots hold NaN scales
   (and NaN fp8 codes), scattered tables, partial last blocks, GQA 1/3/8, decode split over several CTAs,
   prefill chunks after a cached prefix, mixed batches, head_dim 64/128/256.
4. copy_blocks of the 5-D scales tensor and of a 1-byte pool, through KVPool.copy_blocks.
"""

from __future__ import annotations

import ctypes
import secrets

import numpy as np
import pytest
import torch

from pagedserve_common.kv_geometry import QUANT_MAX, KVGeometry
from tests.kernels.cases import GQA, POISON_CODE, assert_written_as_quantize, check_forward, make_quant_case
from worker_svc.attention.cupy_backend import CupyAttentionBackend
from worker_svc.attention.quant import CACHE_DTYPE, raw
from worker_svc.kv_pool import KVPool
from worker_svc.worker import make_backend

pytestmark = pytest.mark.timeout(600)

QUERY_DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CACHE_DTYPES = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
FP8 = {torch.float8_e4m3fn: 0, torch.float8_e5m2: 1}  # host_fp8_* format argument
TAGS = {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16", torch.int8: "i8",
        torch.float8_e4m3fn: "e4m3", torch.float8_e5m2: "e5m2"}  # fmt: skip
NUM_THREADS = 64


def fresh_rng():
    seed = secrets.randbits(63)
    return np.random.default_rng(seed), seed


def backend(launcher, **kw):
    return CupyAttentionBackend(launcher, num_threads=NUM_THREADS, poison_workspace=True, **kw)


# ---- fp8 conversions -------------------------------------------------------------------------------------------
def _decode(lib, fp8, codes: np.ndarray) -> np.ndarray:
    out = np.empty(codes.shape, dtype=np.float32)
    lib.host_fp8_decode(ctypes.c_int(FP8[fp8]), codes.ctypes.data_as(ctypes.c_void_p),
                        out.ctypes.data_as(ctypes.c_void_p), ctypes.c_longlong(codes.size))  # fmt: skip
    return out


def _encode(lib, fp8, x: np.ndarray) -> np.ndarray:
    x = np.ascontiguousarray(x, dtype=np.float32)
    out = np.empty(x.shape, dtype=np.uint8)
    lib.host_fp8_encode(ctypes.c_int(FP8[fp8]), x.ctypes.data_as(ctypes.c_void_p),
                        out.ctypes.data_as(ctypes.c_void_p), ctypes.c_longlong(x.size))  # fmt: skip
    return out


@pytest.mark.parametrize("fp8", list(FP8))
def test_fp8_decoding_is_bit_exact_for_all_256_codes(host_lib, fp8):
    codes = np.arange(256, dtype=np.uint8)
    ours = _decode(host_lib, fp8, codes)
    theirs = torch.from_numpy(codes).view(fp8).float().numpy()
    nan = np.isnan(theirs)
    assert np.array_equal(np.isnan(ours), nan)
    assert nan.sum() == (2 if fp8 == torch.float8_e4m3fn else 6)
    assert np.array_equal(ours[~nan].view(np.uint32), theirs[~nan].view(np.uint32))  # -0.0 and infs included


def _encoding_sweep(fp8, rng) -> np.ndarray:
    """Every finite fp8 value, every midpoint of neighbours (ties: exact in float32) and the float32 neighbours
    of both, past-max values, inf, zeros, float32 subnormals, and random bit patterns across the whole range."""
    values = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(fp8).float().numpy()
    pos = np.unique(values[np.isfinite(values) & (values >= 0)])
    mids = ((pos[:-1].astype(np.float64) + pos[1:]) / 2).astype(np.float32)
    qmax = np.float32(QUANT_MAX[CACHE_DTYPE[fp8]])
    extra = np.array([qmax * 1.01, qmax * 4, 1e30, np.inf, 1e-45, 1e-40, 2.0**-126], dtype=np.float32)
    points = np.concatenate([pos, mids, extra])
    up = np.nextafter(points, np.float32(np.inf))
    down = np.nextafter(points, np.float32(0))
    bits = rng.integers(0, np.float32(qmax * 2).view(np.uint32), size=200_000, dtype=np.uint32)
    sweep = np.concatenate([points, up, down, bits.view(np.float32)])
    assert sweep.dtype == np.float32
    return np.concatenate([sweep, -sweep])


@pytest.mark.parametrize("fp8", list(FP8))
def test_fp8_encoding_matches_torch_after_the_clamp(host_lib, fp8):
    rng, seed = fresh_rng()
    x = _encoding_sweep(fp8, rng)
    qmax = QUANT_MAX[CACHE_DTYPE[fp8]]
    theirs = torch.from_numpy(x).clamp(-qmax, qmax).to(fp8).view(torch.uint8).numpy()
    ours = _encode(host_lib, fp8, x)
    bad = np.flatnonzero(ours != theirs)
    assert bad.size == 0, f"seed {seed}: {bad.size} mismatches, e.g. x={x[bad[:5]]} ours={ours[bad[:5]]} " \
                          f"torch={theirs[bad[:5]]}"  # fmt: skip
    # NaN stays NaN (torch's clamp passes it through).
    nan = _encode(host_lib, fp8, np.array([np.nan, -np.nan], dtype=np.float32))
    assert np.isnan(_decode(host_lib, fp8, nan)).all()


# ---- the quantising write --------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", QUERY_DTYPES)
@pytest.mark.parametrize("cache", CACHE_DTYPES)
def test_quant_write_kv_is_quantize_bit_for_bit(launcher, dtype, cache):
    rng, seed = fresh_rng()
    layers, num_blocks, block_size, kvh, hd = 2, 6, 8, 3, int(rng.choice([64, 128]))
    shape = (layers, 2, num_blocks, block_size, kvh)
    pool = torch.full((*shape, hd), POISON_CODE[cache], dtype=torch.int16).to(torch.uint8).view(cache)
    scales = torch.full(shape, float("nan"))
    slots = torch.from_numpy(rng.permutation(num_blocks * block_size)[:17])
    # Strided key/value (every other token row of a bigger tensor), rows over six decades of magnitude, one
    # all-zero row (scale 1e-30, codes 0).
    magnitude = torch.from_numpy(10.0 ** rng.uniform(-3, 3, size=(34, kvh, 1))).float()
    key = (torch.randn(34, kvh, hd) * magnitude).to(dtype)[::2]
    value = (torch.randn(34, kvh, hd) * magnitude).to(dtype)[1::2]
    key[3, 1] = 0
    be = backend(launcher)
    be.write_kv(pool[1], key, value, slots, kv_scales=scales[1])
    assert launcher.launches[-1][0] == f"write_kv_{TAGS[dtype]}_{TAGS[cache]}"
    try:
        assert_written_as_quantize(pool[1], scales[1], key, value, slots)
    except AssertionError as exc:
        raise AssertionError(f"seed {seed}: {exc}") from None
    flat_codes = raw(pool[1]).reshape(2, -1, kvh, hd)
    flat_scales = scales[1].reshape(2, -1, kvh)
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    poison = raw(torch.tensor([POISON_CODE[cache]], dtype=torch.int16).to(torch.uint8).view(cache))
    assert (flat_codes[:, untouched] == poison).all() and (raw(pool[0]) == poison).all(), seed
    assert torch.isnan(flat_scales[:, untouched]).all() and torch.isnan(scales[0]).all(), seed


def test_quant_write_kv_rejects_a_missing_or_stray_scales_tensor(launcher):
    be = backend(launcher)
    pool = torch.zeros(2, 2, 8, 2, 64, dtype=torch.int8)
    key = torch.randn(1, 2, 64)
    with pytest.raises(ValueError, match="needs kv_scales"):
        be.write_kv(pool, key, key, torch.tensor([0]))
    with pytest.raises(ValueError, match="has no kv_scales"):
        be.write_kv(pool.float(), key, key, torch.tensor([0]), kv_scales=torch.zeros(2, 2, 8, 2))
    with pytest.raises(ValueError, match="kv_scales must be float32"):
        be.write_kv(pool, key, key, torch.tensor([0]), kv_scales=torch.zeros(2, 2, 8, 3))


# ---- attention -------------------------------------------------------------------------------------------------
MIXED = ["decode", "chunk", "decode", "prefill", "chunk", "decode"]


@pytest.mark.parametrize("dtype", QUERY_DTYPES)
@pytest.mark.parametrize("cache", CACHE_DTYPES)
def test_quant_mixed_batch_with_split_decode_matches_reference(launcher, dtype, cache):
    rng, seed = fresh_rng()
    heads = GQA[int(rng.integers(len(GQA)))]
    block_size = int(rng.choice([8, 16]))
    be = backend(launcher)
    kinds = list(rng.permutation(MIXED))
    c = make_quant_case(rng, be, kinds, block_size, *heads, 64, dtype, cache, max_blocks=3,
                        kv_scale=float(rng.choice([0.01, 1.0, 30.0])))  # fmt: skip
    be.partition_size = max(2, -(-c.meta.max_decode_seq_len // int(rng.integers(2, 5))))  # 2-4 splits
    check_forward(be, c.query, c.kv_layer, c.meta, f"{seed} ({heads}, block {block_size})", kv_scales=c.kv_scales)
    names = [name for name, _, _ in launcher.launches]
    tag = f"{TAGS[dtype]}_{TAGS[cache]}_d64"
    assert f"paged_decode_{tag}" in names and f"paged_prefill_{tag}" in names, names
    assert f"paged_decode_reduce_{TAGS[dtype]}_d64" in names, names


@pytest.mark.parametrize("cache", CACHE_DTYPES)
def test_quant_decode_gqa8_split_matches_reference(launcher, cache):
    rng, seed = fresh_rng()
    be = backend(launcher)
    c = make_quant_case(rng, be, ["decode"] * 4, 16, 8, 1, 64, torch.float32, cache, max_blocks=6)
    be.partition_size = max(3, -(-c.meta.max_seq_len // int(rng.integers(2, 5))))
    check_forward(be, c.query, c.kv_layer, c.meta, seed, kv_scales=c.kv_scales)
    assert launcher.launches[-2][1][2] > 1  # split over several CTAs


@pytest.mark.parametrize(("dtype", "cache"), [(torch.float16, torch.int8), (torch.bfloat16, torch.float8_e4m3fn),
                                              (torch.float32, torch.float8_e5m2)])  # fmt: skip
def test_quant_head_dim_128_matches_reference(launcher, dtype, cache):
    rng, seed = fresh_rng()
    be = backend(launcher, partition_size=20)
    c = make_quant_case(rng, be, ["chunk", "decode", "prefill"], 16, 6, 2, 128, dtype, cache, max_blocks=2)
    check_forward(be, c.query, c.kv_layer, c.meta, seed, kv_scales=c.kv_scales)
    names = {name for name, _, _ in launcher.launches}
    tag = f"{TAGS[dtype]}_{TAGS[cache]}_d128"
    assert {f"paged_decode_{tag}", f"paged_prefill_{tag}"} <= names, names


def test_quant_head_dim_256_matches_reference(launcher):
    rng, seed = fresh_rng()
    be = backend(launcher, partition_size=16)
    c = make_quant_case(rng, be, ["decode", "chunk"], 8, 4, 2, 256, torch.bfloat16, torch.float8_e4m3fn,
                        max_blocks=3)  # fmt: skip
    check_forward(be, c.query, c.kv_layer, c.meta, seed, kv_scales=c.kv_scales)
    assert "paged_prefill_bf16_e4m3_d256" in {name for name, _, _ in launcher.launches}


def test_quant_unsupported_head_dim_falls_back_to_torch(launcher):
    rng, seed = fresh_rng()
    be = backend(launcher)
    c = make_quant_case(rng, be, ["decode", "chunk"], 8, 4, 2, 16, torch.float32, torch.int8)
    check_forward(be, c.query, c.kv_layer, c.meta, seed, kv_scales=c.kv_scales)
    assert not any(name.startswith("paged_") for name, _, _ in launcher.launches)  # the write still ran ours


# ---- copy_blocks -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("cache_dtype", "block_size", "kvh", "hd", "words"),
                         [("int8", 8, 2, 64, ("u128", "u128")), ("fp8_e5m2", 3, 1, 5, ("u8", "u32"))])  # fmt: skip
def test_quant_kv_pool_copy_blocks_moves_codes_and_scales(launcher, cache_dtype, block_size, kvh, hd, words):
    pool = KVPool(KVGeometry(num_layers=3, num_kv_heads=kvh, head_dim=hd, dtype=cache_dtype,
                             block_size=block_size), 10)  # fmt: skip
    raw(pool.kv).copy_(torch.randint(0, 256, pool.kv.shape, dtype=torch.int16).to(torch.uint8))
    pool.scales.copy_(torch.rand(pool.scales.shape))
    copies = [(1, 7), (4, 2), (4, 9), (0, 5)]
    src, dst = [s for s, _ in copies], [d for _, d in copies]
    want_kv, want_scales = raw(pool.kv).clone(), pool.scales.clone()
    want_kv[:, :, dst] = want_kv[:, :, src]
    want_scales[:, :, dst] = want_scales[:, :, src]
    pool.copy_blocks(copies, backend(launcher))
    assert torch.equal(raw(pool.kv), want_kv) and torch.equal(pool.scales, want_scales)
    assert tuple(name for name, _, _ in launcher.launches) == tuple(f"copy_blocks_{w}" for w in words)


@pytest.mark.parametrize("cache_dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_quant_worker_picks_the_cupy_backend_on_a_gpu_for_8bit_caches(cache_dtype):
    geometry = KVGeometry(num_layers=2, num_kv_heads=2, head_dim=64, dtype=cache_dtype)
    assert isinstance(make_backend("auto", "cuda:0", geometry), CupyAttentionBackend)  # cupy is imported lazily


def test_quant_forward_rejects_a_misaligned_1_byte_pool(launcher):
    rng, seed = fresh_rng()
    be = backend(launcher)
    c = make_quant_case(rng, be, ["decode"], 8, 2, 1, 64, torch.float32, torch.int8)
    wide = torch.zeros(*c.kv_layer.shape[:-1], 80, dtype=torch.int8)
    wide[..., 1:65] = c.kv_layer
    with pytest.raises(ValueError, match="16-byte aligned"):  # the codes are read in 16-byte vectors
        be.forward(c.query, wide[..., 1:65], c.meta, 0.125, kv_scales=c.kv_scales)
    assert not any(name.startswith("paged_") for name, _, _ in launcher.launches)
