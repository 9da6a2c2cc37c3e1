"""The C++ CPU kernel on 8-bit KV caches (int8, fp8_e4m3, fp8_e5m2): decoding, attention against the float64
reference on the same codes and scales, every ISA build, the int8 Q.K (VNNI) path, the write, and the model.

Error bounds (relative Frobenius norm of the output against reference_attention(..., kv_scales), which reads the
same codes x scales in float64):
- dequantise-then-float (every dtype, every build): 1e-5, the float32 bound. The kernel's dequantised value is
  exactly code * scale in float32 (checked bit for bit below), so what is left is float32 rounding of the dot
  products, the softmax and P.V: measured about 1e-6.
- the int8 Q.K path: 1e-4 against the reference fed the query quantised as the kernel quantises it (the integer
  dot products are exact; only the float32 scaling and softmax round), and 2e-2 against the reference fed the
  float query. NOTE: that looser bound is the query's own rounding: each element moves by up to absmax / 254, so
  a unit-normal query row of 64 dims (absmax about 2.5) perturbs each score by about 1% of its spread before the
  softmax; measured 3.6e-3 to 5e-3 on these batches (4x margin).
"""

import math
import shutil

import numpy as np
import pytest
import torch

from tests.support.attention import GQA, MIXED, make_batch, random_batches
from worker_svc.attention import AttentionMetadata, reference_attention
from worker_svc import cpu_build
from worker_svc.attention import cpu_backend
from worker_svc.attention.cpu_backend import CpuAttentionBackend
from worker_svc.cpu_features import cpu_flags
from worker_svc.attention.quant import quantize, raw

QUANT = [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2]
GQA_ALL = [*GQA, (9, 3)]  # groups 1, 3, 8, and SmolLM2's 9 query heads over 3 kv heads
TOL, TOL_QK_SAME_QUERY, TOL_QK = 1e-5, 1e-4, 2e-2
# A free slot's garbage: NaN scales, and codes that are NaN in fp8 (S.1111.111 in both formats) or extreme in int8.
POISON_CODE = 0x7F


@pytest.fixture(scope="module")
def backend() -> CpuAttentionBackend:
    return CpuAttentionBackend()


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, object]:
    """name -> loaded library: the native build, each portable target this CPU runs, and an AVX2 + AVX-VNNI build
    (the 256-bit int8 Q.K path) where the CPU has AVX-VNNI."""
    out = tmp_path_factory.mktemp("kernels")
    libs = {"native": cpu_backend.load_library()}
    flags = cpu_flags()
    for target, path in zip(cpu_build.PORTABLE_TARGETS, cpu_build.prebuild(out)):
        if flags.issuperset(cpu_build.PORTABLE_TARGETS[target]):
            libs[target] = cpu_backend.load_library(path)
    if flags.issuperset(cpu_build.PORTABLE_TARGETS["x86-64-v3"]) and "avx_vnni" in flags:
        path = cpu_build._compile(shutil.which("g++"), (*cpu_build._portable_flags("x86-64-v3"), "-mavxvnni"),
                                    out / "avxvnni.so")
        libs["x86-64-v3+avxvnni"] = cpu_backend.load_library(path)
    return libs


def quantised_batch(rng, kinds, block_size, num_heads, num_kv_heads, head_dim, dtype, reserve_zero=None):
    """make_batch's scattered, padded batch with its pool quantised row by row (quant.quantize, what write_kv
    stores); every slot no sequence wrote keeps garbage: NaN scales and POISON_CODE codes."""
    query, pool, meta = make_batch(rng, kinds, block_size, num_heads, num_kv_heads, head_dim, torch.float32,
                                   reserve_zero=reserve_zero)
    codes, scales = quantize(pool, dtype)
    free = torch.isnan(pool).any(-1)
    raw(codes)[free] = POISON_CODE
    scales[free] = float("nan")
    return query, codes, scales, meta


def rel_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return (torch.linalg.norm(out.double() - ref) / torch.linalg.norm(ref)).item()


def check(backend, query, codes, scales, meta, tol=TOL) -> float:
    scale = 1.0 / math.sqrt(query.shape[-1])
    out = backend.forward(query, codes, meta, scale, scales)
    assert out.shape == query.shape and out.dtype == torch.float32
    assert torch.isfinite(out).all(), "garbage past seq_len leaked into the output"
    rel = rel_error(out, reference_attention(query, codes, meta, scale, scales))
    assert rel < tol, rel
    return rel


# Decoding: the kernel's widening of each code is torch's conversion, bit for bit.

@pytest.mark.parametrize("dtype", QUANT)
def test_every_code_decodes_bit_exactly_as_torch_in_every_build(builds, dtype):
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).repeat(4, 1).view(dtype)
    scales = torch.tensor([1.0, 0.37, 3e-5, 1234.5])
    for name, lib in builds.items():
        for width in (256, 13):  # whole vectors; then 13: the scalar tail too
            c = codes[:, :width].contiguous() if width == 256 else codes[:, 100:100 + width].contiguous()
            got = cpu_backend.dequantize(lib, c, scales)
            want = c.float() * scales[:, None]  # quant.dequantize: the product in float32
            nan = torch.isnan(want)
            assert torch.equal(torch.isnan(got), nan), name
            assert torch.equal(got[~nan].view(torch.int32), want[~nan].view(torch.int32)), name


# Attention on quantised data against the float64 reference.

@pytest.mark.parametrize("dtype", QUANT)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("heads", GQA_ALL)
def test_mixed_batch(backend, dtype, head_dim, heads):
    rng = np.random.default_rng([*heads, head_dim])
    check(backend, *quantised_batch(rng, list(rng.permutation(MIXED)), 16, *heads, head_dim, dtype))


@pytest.mark.parametrize("dtype", QUANT)
@pytest.mark.parametrize("block_size", [8, 32])
def test_other_block_sizes_and_a_head_dim_off_the_vector_width(backend, dtype, block_size):
    rng = np.random.default_rng(block_size)
    for head_dim in (64, 12):  # 12: the scalar paths
        check(backend, *quantised_batch(rng, MIXED, block_size, 6, 2, head_dim, dtype))


@pytest.mark.parametrize("dtype", QUANT)
def test_decode_only_batch_with_long_contexts(backend, dtype):
    # Contexts of 1..40 blocks: many online-softmax rescales per row, over scattered blocks.
    rng = np.random.default_rng(3)
    lens = rng.integers(1, 40 * 16, size=9).tolist()
    need = [-(-s // 16) for s in lens]
    ids = rng.permutation(sum(need) + 1)[: sum(need)].tolist()
    tables = [ids[sum(need[:i]):sum(need[:i + 1])] for i in range(len(lens))]
    codes, scales = quantize(torch.randn(2, sum(need) + 1, 16, 3, 64), dtype)
    meta = AttentionMetadata.build([1] * len(lens), lens, tables, 16)
    assert meta.is_all_decode
    check(backend, torch.randn(len(lens), 9, 64), codes, scales, meta)


@pytest.mark.parametrize("dtype", QUANT)
@pytest.mark.parametrize("kinds", [["prefill"] * 3, ["chunk"] * 3, ["prefill", "chunk", "decode"]])
def test_prefill_chunks(backend, dtype, kinds):
    rng = np.random.default_rng(len(kinds))
    query, codes, scales, meta = quantised_batch(rng, kinds, 16, 6, 2, 64, dtype)
    assert meta.max_query_len > 1
    check(backend, query, codes, scales, meta)


@pytest.mark.parametrize("dtype", QUANT)
def test_a_chunk_longer_than_the_kernel_takes_goes_to_sdpa_on_the_same_codes(backend, dtype):
    long_q = cpu_backend.MAX_KERNEL_Q_LEN + 5
    lens, q_lens = [300, long_q + 20, 90], [1, long_q, 30]
    need = [-(-s // 16) for s in lens]
    tables = [list(range(sum(need[:i]), sum(need[:i + 1]))) for i in range(3)]
    codes, scales = quantize(torch.randn(2, sum(need), 16, 2, 64), dtype)
    meta = AttentionMetadata.build(q_lens, lens, tables, 16)
    check(backend, torch.randn(sum(q_lens), 6, 64), codes, scales, meta)


@pytest.mark.parametrize("dtype", QUANT)
def test_nan_scales_and_codes_past_seq_len_never_reach_the_output(backend, dtype):
    # Short contexts, long padded tables pointing at block 0 (never written): most slots in reach are garbage.
    rng = np.random.default_rng(5)
    for kinds in (["decode"] * 4, ["decode", "chunk", "decode"]):
        query, codes, scales, meta = quantised_batch(rng, kinds, 32, 8, 1, 64, dtype, reserve_zero=True)
        assert torch.isnan(scales[:, 0]).all() and (raw(codes)[:, 0] == POISON_CODE).all()
        if dtype != torch.int8:
            assert torch.isnan(codes[:, 0].float()).all()
        check(backend, query, codes, scales, meta)


@random_batches(GQA_ALL, QUANT)
def test_random_batches_match_reference(backend, seed, kinds, block_size, heads, head_dim, dtype):
    rng = np.random.default_rng(seed)
    check(backend, *quantised_batch(rng, kinds, block_size, *heads, head_dim, dtype))


@pytest.mark.parametrize("target", ["x86-64-v4", "x86-64-v3", "x86-64-v2"])
def test_portable_builds_match_the_reference(builds, target):
    # v4: the AVX-512 paths; v3: the AVX2 + FMA + F16C paths (what CI without AVX-512 runs); v2: the scalar ones.
    if target not in builds:
        pytest.skip(f"this CPU cannot run {target}")
    lib = builds[target]
    assert cpu_backend.simd_width(lib) == {"x86-64-v4": 512, "x86-64-v3": 256, "x86-64-v2": 0}[target]
    backend = CpuAttentionBackend(lib=lib)
    rng = np.random.default_rng(7)
    for dtype in QUANT:
        for heads, head_dim in (((9, 3), 64), ((8, 1), 128), ((4, 4), 12)):
            check(backend, *quantised_batch(rng, list(MIXED), 16, *heads, head_dim, dtype, reserve_zero=True))


def test_the_portable_avx512_build_computes_the_native_builds_bits(builds):
    # The container image runs the prebuilt x86-64-v4 library, the host a -march=native one, and the compose and
    # Kubernetes checks want the host's greedy tokens from the containers: on the float and bfloat16 pools, and in
    # the bfloat16 forward's fused ops, both builds must give the same bits (no path only one build has).
    if "x86-64-v4" not in builds:
        pytest.skip("this CPU cannot run x86-64-v4")
    native, portable = CpuAttentionBackend(lib=builds["native"]), CpuAttentionBackend(lib=builds["x86-64-v4"])
    rng = np.random.default_rng(11)
    for dtype in (torch.float32, torch.bfloat16):
        for heads, head_dim in (((9, 3), 64), ((8, 1), 128)):
            query, pool, meta = make_batch(rng, list(MIXED), 16, *heads, head_dim, dtype)
            a = native.forward(query, pool, meta, 0.125)
            b = portable.forward(query, pool, meta, 0.125)
            assert torch.equal(a, b), (dtype, heads, head_dim)
    from worker_svc.cpu_ops import CpuOps
    ops_native, ops_portable = CpuOps(builds["native"]), CpuOps(builds["x86-64-v4"])
    gen = torch.Generator().manual_seed(0)
    x, d, w = (torch.randn(33, 576, generator=gen).bfloat16() for _ in range(3))
    w = w[0].contiguous()
    gu = (4 * torch.randn(33, 3072, generator=gen)).bfloat16()
    assert torch.equal(ops_native.rms_norm(x, w, 1e-5), ops_portable.rms_norm(x, w, 1e-5))
    x1, x2 = x.clone(), x.clone()
    assert torch.equal(ops_native.add_rms_norm(x1, d, w, 1e-5), ops_portable.add_rms_norm(x2, d, w, 1e-5))
    assert torch.equal(x1, x2)
    assert torch.equal(ops_native.silu_mul(gu), ops_portable.silu_mul(gu))
    assert torch.equal(ops_native.argmax(gu), ops_portable.argmax(gu))
    if ops_native.amx_available():  # the AMX matmul: compiled into every build (target attributes), same bits
        wq = (0.1 * torch.randn(960, 576, generator=gen)).bfloat16()
        for name, lib in builds.items():
            ops = CpuOps(lib)
            assert ops.amx_available(), name
            assert torch.equal(ops.amx_linear(x, ops.amx_pack(wq), 960, None),
                               ops_native.amx_linear(x, ops_native.amx_pack(wq), 960, None)), name


# The int8 Q.K path (VNNI).

def vnni_builds(builds) -> dict[str, object]:
    return {name: lib for name, lib in builds.items() if cpu_backend.int8_qk_width(lib)}


def quantised_query(query: torch.Tensor, scale: float) -> torch.Tensor:
    """What the kernel attends with on the int8 Q.K path: each (token, head) row of query * scale rounded to int8
    with its own scale absmax / 127 (half to even), then read back in float."""
    q = query.float() * scale
    qs = (q.abs().amax(-1, keepdim=True) / 127).clamp_min(1e-30)
    return torch.round(q * (1 / qs)).clamp(-127, 127) * qs


@pytest.mark.parametrize("head_dim", [64, 128, 12])
@pytest.mark.parametrize("heads", GQA_ALL)
def test_int8_qk_path_matches_the_reference(builds, heads, head_dim):
    libs = vnni_builds(builds)
    if not libs:
        pytest.skip("this CPU has neither AVX-512 VNNI nor AVX-VNNI: no int8 Q.K path to test")
    for name, lib in libs.items():
        backend = CpuAttentionBackend(lib=lib, int8_qk=True)
        rng = np.random.default_rng([*heads, head_dim])
        query, codes, scales, meta = quantised_batch(rng, list(rng.permutation(MIXED)), 16, *heads, head_dim,
                                                     torch.int8, reserve_zero=True)
        scale = 1.0 / math.sqrt(head_dim)
        out = backend.forward(query, codes, meta, scale, scales)
        assert torch.isfinite(out).all(), name
        same_query = reference_attention(quantised_query(query, scale), codes, meta, 1.0, scales)
        assert rel_error(out, same_query) < TOL_QK_SAME_QUERY, name
        assert rel_error(out, reference_attention(query, codes, meta, scale, scales)) < TOL_QK, name


def test_int8_qk_path_on_random_batches_and_never_on_fp8(builds):
    libs = vnni_builds(builds)
    if not libs:
        pytest.skip("this CPU has neither AVX-512 VNNI nor AVX-VNNI: no int8 Q.K path to test")
    for name, lib in libs.items():
        backend = CpuAttentionBackend(lib=lib, int8_qk=True)
        rng = np.random.default_rng(11)
        for _ in range(6):
            kinds = list(rng.choice(["decode", "chunk", "prefill"], size=int(rng.integers(1, 6))))
            block_size = int(rng.choice([8, 16, 32]))
            check(backend, *quantised_batch(rng, kinds, block_size, 9, 3, 64, torch.int8), tol=TOL_QK)
        # An fp8 layer under an int8_qk backend is dequantised: the tight bound holds.
        check(backend, *quantised_batch(rng, MIXED, 16, 9, 3, 64, torch.float8_e4m3fn))


def test_int8_qk_on_a_build_without_vnni_is_refused(builds):
    if "x86-64-v3" not in builds:
        pytest.skip("this CPU cannot run x86-64-v3")
    assert cpu_backend.int8_qk_width(builds["x86-64-v3"]) == 0
    with pytest.raises(ValueError, match="VNNI"):
        CpuAttentionBackend(lib=builds["x86-64-v3"], int8_qk=True)


# The write: inherited from the torch backend, the codes quant.quantize defines.

@pytest.mark.parametrize("dtype", QUANT)
def test_write_kv_stores_exactly_quantize_codes_and_scales(backend, dtype):
    rng = np.random.default_rng(3)
    num_blocks, block_size, kvh, hd = 6, 8, 3, 64
    pool = torch.zeros((2, num_blocks, block_size, kvh, hd), dtype=dtype)
    raw(pool).fill_(POISON_CODE)
    kv_scales = torch.full((2, num_blocks, block_size, kvh), float("nan"))
    slots = torch.from_numpy(rng.permutation(num_blocks * block_size)[:17])
    key = torch.from_numpy(rng.standard_normal((17, kvh, hd)) * 3).float()
    value = torch.from_numpy(rng.standard_normal((17, kvh, hd))).float()
    backend.write_kv(pool, key, value, slots, kv_scales)
    flat, flat_scales = raw(pool).view(2, -1, kvh, hd), kv_scales.view(2, -1, kvh)
    for i, x in enumerate((key, value)):
        codes, scales = quantize(x, dtype)
        assert torch.equal(flat[i, slots], raw(codes))
        assert torch.equal(flat_scales[i, slots].view(torch.int32), scales.view(torch.int32))
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert (flat[:, untouched] == POISON_CODE).all() and torch.isnan(flat_scales[:, untouched]).all()
