"""CpuAttentionBackend (the C++ kernel, with SDPA for long chunks) against the float64 reference."""

import numpy as np
import pytest
import torch

from tests.support.attention import GQA, MIXED, make_batch, random_batches, windowed_batch
from tests.support.attention import check as shared_check
from worker_svc.attention import AttentionMetadata
from worker_svc import cpu_build
from worker_svc.attention import cpu_backend
from worker_svc.attention.cpu_backend import CpuAttentionBackend
from worker_svc.cpu_features import cpu_flags

GQA_ALL = [*GQA, (9, 3)]  # SmolLM2's 9 query heads over 3 kv heads too


@pytest.fixture(scope="module")
def backend() -> CpuAttentionBackend:
    return CpuAttentionBackend()


def check(backend, query, pool, meta, dtype):
    shared_check(query, pool, meta, dtype, backend)


def break_kernel(tmp_path, monkeypatch, right: str, wrong: str) -> None:
    """Points the library's build at a copy of its sources with every `right` replaced by `wrong` (in whichever of
    the kernel's files hold it), and its cache at tmp_path."""
    copy = tmp_path / "src"
    changed = []
    for path in cpu_build.sources():
        target = copy / path.relative_to(cpu_build.SOURCE_ROOT)
        target.parent.mkdir(parents=True, exist_ok=True)
        text = path.read_text()
        target.write_text(text.replace(right, wrong))
        if right in text:
            changed.append(target.name)
    assert changed, f"no kernel source holds {right!r}"
    monkeypatch.setattr(cpu_build, "SOURCE_ROOT", copy)
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("head_dim", [64, 128, 12])  # 12: not a multiple of 8, the kernel's scalar path
@pytest.mark.parametrize("heads", GQA_ALL)
@pytest.mark.parametrize("block_size", [8, 16, 32])
def test_mixed_batch(backend, block_size, heads, head_dim, dtype):
    rng = np.random.default_rng([block_size, *heads, head_dim])
    kinds = list(rng.permutation(MIXED))
    check(backend, *make_batch(rng, kinds, block_size, *heads, head_dim, dtype), dtype)


@pytest.mark.parametrize("block_size", [16, 64])
def test_all_decode_batch_with_long_contexts(backend, block_size):
    # Contexts of 1..40 blocks: many online-softmax rescales per row.
    rng = np.random.default_rng(block_size)
    lens = rng.integers(1, 40 * block_size, size=9).tolist()
    need = [-(-s // block_size) for s in lens]
    ids = rng.permutation(sum(need) + 1)[: sum(need)].tolist()
    tables = [ids[sum(need[:i]):sum(need[:i + 1])] for i in range(len(lens))]
    pool = torch.randn(2, sum(need) + 1, block_size, 3, 64)
    meta = AttentionMetadata.build([1] * len(lens), lens, tables, block_size)
    check(backend, torch.randn(len(lens), 9, 64), pool, meta, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_large_decode_batch_gives_each_sequence_its_bits_alone(backend, dtype):
    # 96 decodes: the kernel takes them 4 a chunk and prefetches each thread's next item (and next kv head) while it
    # finishes the last; every sequence must get the reference's values and the very bits it gets attended alone.
    rng = np.random.default_rng(96)
    lens = rng.integers(1, 300, size=96).tolist()
    need = [-(-s // 16) for s in lens]
    ids = rng.permutation(sum(need) + 1)[: sum(need)].tolist()  # scattered blocks
    tables = [ids[sum(need[:i]):sum(need[:i + 1])] for i in range(len(lens))]
    pool = torch.randn(2, sum(need) + 1, 16, 3, 64).to(dtype)
    query = torch.randn(len(lens), 9, 64).to(dtype)
    meta = AttentionMetadata.build([1] * len(lens), lens, tables, 16)
    check(backend, query, pool, meta, dtype)
    batch = backend.forward(query, pool, meta, 0.125)
    for i in (0, 1, 2, 3, 4, 47, 95):
        alone = backend.forward(query[i:i + 1], pool, AttentionMetadata.build([1], [lens[i]], [tables[i]], 16), 0.125)
        assert torch.equal(batch[i:i + 1], alone), i


@pytest.mark.parametrize("invariant", [False, True])
def test_long_chunks_go_to_sdpa_and_short_ones_to_the_kernel(monkeypatch, invariant):
    # q_len above MAX_KERNEL_Q_LEN is computed by the SDPA path: poison it, and only those rows change; a
    # batch-invariant backend keeps every chunk in the kernel (SDPA's sums are another order).
    backend = CpuAttentionBackend(batch_invariant=invariant)
    long_q = cpu_backend.MAX_KERNEL_Q_LEN + 5
    lens, q_lens = [300, 40, long_q, 90], [1, 40, long_q, 30]
    need = [-(-s // 16) for s in lens]
    tables = [list(range(sum(need[:i]), sum(need[:i + 1]))) for i in range(4)]
    pool = torch.randn(2, sum(need), 16, 2, 64)
    meta = AttentionMetadata.build(q_lens, lens, tables, 16)
    query = torch.randn(sum(q_lens), 6, 64)
    check(backend, query, pool, meta, torch.float32)
    def poison(q, kv, m, scale, out, min_q_len, kv_scales=None, window=0):  # stands in for the SDPA path: marks the rows it was given
        qsl = m.query_start_loc_host
        for i in range(m.num_seqs):
            if qsl[i + 1] - qsl[i] >= min_q_len:
                out[qsl[i]:qsl[i + 1]] = 7.0

    monkeypatch.setattr(backend, "_prefills", poison)
    out = backend.forward(query, pool, meta, 0.125)
    rows = torch.zeros(sum(q_lens), dtype=torch.bool)
    rows[41:41 + long_q] = not invariant  # after the decode row and the 40-token chunk
    assert (out[rows] == 7.0).all() and not (out[~rows] == 7.0).any()


def test_strided_query_as_the_hook_passes_it(backend):
    # The transformers hook passes query[0].transpose(0, 1): [T, H, hd] with token stride hd.
    rng = np.random.default_rng(1)
    query, pool, meta = make_batch(rng, MIXED, 16, 6, 2, 64, torch.float32)
    strided = query.transpose(0, 1).contiguous().transpose(0, 1)
    assert not strided.is_contiguous()
    check(backend, strided, pool, meta, torch.float32)


def test_nan_past_seq_len_never_reaches_output(backend):
    rng = np.random.default_rng(5)
    for kinds in (["decode"] * 4, ["decode", "chunk", "decode"]):
        query, pool, meta = make_batch(rng, kinds, 32, 8, 1, 16, torch.float32, reserve_zero=True)
        assert torch.isnan(pool[:, 0]).all()
        check(backend, query, pool, meta, torch.float32)


@random_batches(GQA_ALL, [torch.float32, torch.bfloat16])
def test_random_batches_match_reference(backend, seed, kinds, block_size, heads, head_dim, dtype):
    rng = np.random.default_rng(seed)
    check(backend, *make_batch(rng, kinds, block_size, *heads, head_dim, dtype), dtype)


def test_a_broken_softmax_rescale_fails_the_comparison(tmp_path, monkeypatch):
    # The comparison has teeth: the same kernel without the online-softmax correction is caught.
    break_kernel(tmp_path, monkeypatch, "const float corr = fast_exp(m[r] - m_new);", "const float corr = 1.0f;")
    bad = CpuAttentionBackend()
    rng = np.random.default_rng(2)
    query, pool, meta = make_batch(rng, ["decode"] * 5, 8, 6, 2, 64, torch.float32)
    with pytest.raises(AssertionError):
        check(bad, query, pool, meta, torch.float32)


def test_build_failure_is_an_error_naming_the_compiler(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_CACHE", str(tmp_path))
    with pytest.raises(RuntimeError, match="no-such-g"):
        cpu_build.build_library("no-such-g++")


# Portable prebuilt libraries: what a container image without a compiler loads.

def test_prebuild_compiles_every_portable_target_named_by_source_hash(tmp_path):
    built = cpu_build.prebuild(tmp_path)
    assert [p.name.split("-")[1:4] for p in built] == [["x86", "64", "v4"], ["x86", "64", "v3"], ["x86", "64", "v2"]]
    assert all(p.parent == tmp_path and p.stat().st_size > 0 for p in built)


def test_without_a_compiler_the_best_prebuilt_build_this_cpu_runs_is_used(tmp_path, monkeypatch):
    v4, v3, v2 = cpu_build.prebuild(tmp_path)
    monkeypatch.setenv("PAGEDSERVE_KERNEL_DIR", str(tmp_path))
    avx512 = set(cpu_build.PORTABLE_TARGETS["x86-64-v4"])
    avx2 = set(cpu_build.PORTABLE_TARGETS["x86-64-v3"]) | set(cpu_build.PORTABLE_TARGETS["x86-64-v2"])
    assert cpu_build.prebuilt_library(avx512) == v4
    assert cpu_build.prebuilt_library(avx512 - {"avx512vl"}) == v3  # every AVX-512 flag v4 needs, or v3
    assert cpu_build.prebuilt_library(avx2) == v3
    assert cpu_build.prebuilt_library(set(cpu_build.PORTABLE_TARGETS["x86-64-v2"])) == v2
    assert cpu_build.prebuilt_library({"sse2"}) is None
    v4.unlink()  # stale or missing builds are never picked
    assert cpu_build.prebuilt_library(avx512) == v3
    v3.unlink()
    assert cpu_build.prebuilt_library(avx2) == v2
    monkeypatch.setattr(cpu_build.shutil, "which", lambda _: None)
    assert cpu_build.build_library() in (v2, v3, v4)


def test_without_a_compiler_or_a_prebuilt_build_the_error_says_both(tmp_path, monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_KERNEL_DIR", str(tmp_path))
    monkeypatch.setattr(cpu_build.shutil, "which", lambda _: None)
    with pytest.raises(RuntimeError, match="g\\+\\+ is not installed and no prebuilt kernel"):
        cpu_build.build_library()


@pytest.mark.parametrize("target", ["x86-64-v4", "x86-64-v3", "x86-64-v2"])
def test_prebuilt_libraries_match_the_float64_reference(tmp_path, target):
    built = dict(zip(cpu_build.PORTABLE_TARGETS, cpu_build.prebuild(tmp_path)))
    needed = set(cpu_build.PORTABLE_TARGETS[target])
    if not needed <= cpu_flags():
        pytest.skip(f"this CPU cannot run {target}")
    backend = CpuAttentionBackend(lib=cpu_backend.load_library(built[target]))
    rng = np.random.default_rng(7)
    for dtype in (torch.float32, torch.bfloat16):
        check(backend, *make_batch(rng, list(MIXED), 16, 9, 3, 64, dtype), dtype)
        for head_dim in (64, 256):  # a sliding window, NaN before it (Gemma 3's head_dim too)
            query, pool, meta, _ = windowed_batch(rng, list(MIXED), 16, 4, 1, head_dim, dtype, 37)
            shared_check(query, pool, meta, dtype, backend, window=37)


@pytest.mark.parametrize("head_dim", [64, 128])
def test_a_bfloat16_pool_with_bfloat16_or_float32_queries_matches_the_reference(backend, head_dim):
    # A bfloat16 model's queries are bf16 values (its output comes back in bf16); a float32 model over a bfloat16
    # cache (--kv-cache-dtype bfloat16) sends float32 queries and gets float32 out, at float32's tolerance.
    rng = np.random.default_rng(head_dim)
    lens, q_lens = [300, 17, 90, 48], [1, 1, 30, 48]
    need = [-(-s // 16) for s in lens]
    ids = rng.permutation(sum(need) + 1)[: sum(need)].tolist()
    tables = [ids[sum(need[:i]):sum(need[:i + 1])] for i in range(4)]
    pool = torch.randn(2, sum(need) + 1, 16, 3, head_dim).to(torch.bfloat16)
    meta = AttentionMetadata.build(q_lens, lens, tables, 16)
    bf16_values = torch.randn(sum(q_lens), 9, head_dim).to(torch.bfloat16)
    check(backend, bf16_values, pool, meta, torch.bfloat16)
    # the same bf16-valued query handed over in float32: the output comes back in float32, so the float32
    # tolerance holds whichever path scored it
    check(backend, bf16_values.float(), pool, meta, torch.float32)
    check(backend, torch.randn(sum(q_lens), 9, head_dim), pool, meta, torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_items_of_all_kv_heads_or_of_one_give_the_same_bits(backend, dtype):
    # With at least 4 query tiles a thread, a work item takes all kv heads of its tile (whole pool rows); with
    # fewer, one head. The split changes who computes what, never the arithmetic.
    rng = np.random.default_rng(5)
    query, pool, meta = make_batch(rng, ["decode"] * 12 + ["chunk", "prefill"], 16, 9, 3, 64, dtype)
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)  # 14+ tiles >= 4: grouped items
        grouped = backend.forward(query, pool, meta, 0.125)
        torch.set_num_threads(16)  # fewer than 64 tiles: one head an item
        per_head = backend.forward(query, pool, meta, 0.125)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(grouped, per_head)
    check(backend, query, pool, meta, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_write_kv_puts_each_row_in_its_slot_as_the_torch_backend_does(backend, dtype):
    # The lean forward hands K and V as views of the fused QKV output (token rows qkv-wide apart): the kernel's
    # write must land each row at its slot, K in plane 0 and V in plane 1, and touch nothing else.
    from worker_svc.attention import TorchAttentionBackend
    qkv = torch.randn(5, 9 * 64 + 2 * 3 * 64).to(dtype)
    key, value = qkv[:, 576:768].view(5, 3, 64), qkv[:, 768:].view(5, 3, 64)
    slots = torch.tensor([17, 3, 40, 41, 0])
    ours, theirs = (torch.full((2, 4, 16, 3, 64), float("nan"), dtype=dtype) for _ in range(2))
    backend.write_kv(ours, key, value, slots)
    TorchAttentionBackend().write_kv(theirs, key, value, slots)
    assert torch.equal(ours.nan_to_num(7.0), theirs.nan_to_num(7.0))
    flat = ours.view(2, 64, 3, 64)
    assert torch.equal(flat[0, 40], key[2]) and torch.equal(flat[1, 0], value[4])
    assert int(torch.isnan(flat).all(-1).all(-1).sum()) == 2 * (64 - 5)  # only the 5 slots were written


def test_write_kv_refuses_a_slot_outside_the_pool_and_writes_nothing(backend):
    pool = torch.zeros(2, 2, 16, 3, 64)
    key = value = torch.ones(2, 3, 64)
    for bad in (32, -1):
        with pytest.raises(IndexError, match="outside the pool's 32"):
            backend.write_kv(pool, key, value, torch.tensor([5, bad]))
    assert not pool.any()  # checked before the first row is written
    with pytest.raises(ValueError, match="slot_mapping has shape"):
        backend.write_kv(pool, key, value, torch.tensor([5]))


def test_a_broken_rescale_in_the_16_key_block_paths_fails_the_comparison(backend, tmp_path, monkeypatch):
    # The same teeth for the 16-key block paths (16-token blocks, head_dim 64): their own online-softmax correction.
    break_kernel(tmp_path, monkeypatch, "corr[r] = fast_exp(m[r] - m_new);", "corr[r] = 1.0f;")
    bad = CpuAttentionBackend()
    if cpu_backend.simd_width(bad.lib) != 512:
        pytest.skip("the 16-key block path is AVX-512 only; this CPU's build has none")
    # contexts of 5..40 blocks: the grouped path (4 blocks a group) rescales several times per row
    rng = np.random.default_rng(3)
    lens = rng.integers(5 * 16, 40 * 16, size=5).tolist()
    need = [-(-n // 16) for n in lens]
    ids = rng.permutation(sum(need)).tolist()
    tables = [ids[sum(need[:i]):sum(need[:i + 1])] for i in range(len(lens))]
    meta = AttentionMetadata.build([1] * len(lens), lens, tables, 16)
    pool, query = torch.randn(2, sum(need), 16, 2, 64), torch.randn(len(lens), 6, 64)
    check(backend, query, pool, meta, torch.float32)  # the real kernel (built before the patch) passes
    with pytest.raises(AssertionError):
        check(bad, query, pool, meta, torch.float32)



# Breaks of the bfloat16-query paths: the bf16 dot path's P.V accumulators put back in the wrong order (decodes and
# prefill tiles below 16 rows, or every tile without AMX), and AMX P.V without the online-softmax rescale (prefill
# tiles of 16 rows or more on an AMX CPU).
BF16_BREAKS = {
    "dot": ("back1 = _mm512_setr_epi32(8, 9, 10, 11, 24, 25, 26, 27, 12, 13, 14, 15, 28, 29, 30, 31)",
            "back1 = _mm512_setr_epi32(12, 13, 14, 15, 28, 29, 30, 31, 8, 9, 10, 11, 24, 25, 26, 27)"),
    "amx": ("_mm512_fmadd_ps(_mm512_loadu_ps(dst), cr, _mm512_load_ps(ct[cc] + r * 16))",
            "_mm512_add_ps(_mm512_loadu_ps(dst), _mm512_load_ps(ct[cc] + r * 16))"),
}


@pytest.mark.parametrize("path", list(BF16_BREAKS))
def test_bfloat16_queries_take_the_bf16_paths_and_float32_ones_do_not(tmp_path, monkeypatch, path):
    # Teeth for the paths only a bfloat16 model's queries take over a bfloat16 pool: broken, they must fail the
    # comparison (decodes on the dot path; prefill tiles on AMX where the CPU has it), while float32 queries over the
    # same pool (which never take them) still pass at float32's tolerance.
    break_kernel(tmp_path, monkeypatch, *BF16_BREAKS[path])
    # AMX tiles run only where batch invariance is off (a batch-invariant call keeps every row on the dot path)
    bad = CpuAttentionBackend(batch_invariant=path == "dot")
    if not cpu_backend.bf16_dot(bad.lib):
        pytest.skip("this CPU has no AVX512-BF16 (or its build no AVX-512): bfloat16 queries take the float path")
    amx = bool(bad.lib.ps_amx_init()) and not bad.batch_invariant
    if path == "amx" and not amx:
        pytest.skip("this CPU has no AMX-BF16: prefill tiles take the dot path")
    rng = np.random.default_rng(11)
    lens, q_lens = [300, 17, 90, 48], [1, 1, 30, 48]  # two decodes; prefill tiles of 63 rows over 2 and 1 groups
    need = [-(-s // 16) for s in lens]
    ids = rng.permutation(sum(need) + 1)[: sum(need)].tolist()
    tables = [ids[sum(need[:i]):sum(need[:i + 1])] for i in range(4)]
    pool = torch.randn(2, sum(need) + 1, 16, 3, 64).to(torch.bfloat16)
    query = torch.randn(sum(q_lens), 9, 64).to(torch.bfloat16)
    mixed = AttentionMetadata.build(q_lens, lens, tables, 16)
    decodes = AttentionMetadata.build([1] * 4, lens, tables, 16)
    prefills = AttentionMetadata.build(q_lens[2:], lens[2:], tables[2:], 16)
    check(bad, query.float(), pool, mixed, torch.float32)
    breaks = {"dot": [(decodes, query[:4])] + ([] if amx else [(prefills, query[2:])]),
              "amx": [(prefills, query[2:])]}[path]
    for meta, q in breaks:
        with pytest.raises(AssertionError):
            check(bad, q, pool, meta, torch.bfloat16)
    if path == "amx":
        check(bad, query[:4], pool, decodes, torch.bfloat16)  # decodes never take AMX