"""cuda/paged_attention.cu on every commit without a GPU.

1. nvcc builds it for sm_80 and sm_90 (ptxas register/spill report checked: no spills).
2. The same source, built for the host with cuda/host_shim.h, runs through CupyAttentionBackend (with the host
   launcher of conftest.py) and is compared with the float64 reference: fresh random inputs each run (the seed
   is in the failure message), outputs and split workspaces NaN-poisoned before each launch, every unwritten
   pool slot NaN, scattered block tables, partial last blocks, GQA ratios 1/3/8, decode split over several CTAs.
"""

from __future__ import annotations

import re
import secrets

import numpy as np
import pytest
import torch

from tests.kernels.cases import GQA, check_forward, make_case
from worker_svc.attention.cupy_backend import CupyAttentionBackend

pytestmark = pytest.mark.timeout(600)

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
NUM_THREADS = 64  # threads per attention CTA on the host: 2 warps (the GPU uses 128)


def fresh_rng():
    seed = secrets.randbits(63)
    return np.random.default_rng(seed), seed


def backend(launcher, **kw):
    return CupyAttentionBackend(launcher, num_threads=NUM_THREADS, poison_workspace=True, **kw)


# ---- device builds ---------------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["sm_80", "sm_90"])
def test_kernel_nvcc_builds_without_spills(builds, arch, capsys):
    rc, log = builds.result(arch)
    assert rc == 0, log
    entries = re.findall(r"Compiling entry function '(\w+)' for '(\w+)'", log)
    regs = re.findall(r"Used (\d+) registers", log)
    spills = re.findall(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    names = {e for e, _ in entries}
    for tag in ("f32", "f16", "bf16"):
        assert f"write_kv_{tag}" in names
        for hd in (64, 128, 256):
            for kind in ("paged_decode", "paged_decode_reduce", "paged_prefill"):
                assert f"{kind}_{tag}_d{hd}" in names
        for cache in ("i8", "e4m3", "e5m2"):  # 8-bit caches (issue 25)
            assert f"write_kv_{tag}_{cache}" in names
            for hd in (64, 128, 256):
                assert {f"paged_decode_{tag}_{cache}_d{hd}", f"paged_prefill_{tag}_{cache}_d{hd}"} <= names
    assert {"copy_blocks_u8", "copy_blocks_u16", "copy_blocks_u32", "copy_blocks_u128"} <= names
    assert len(regs) == len(entries) == len(spills)
    with capsys.disabled():
        print(f"\n[{arch}] ptxas:")
        for (name, _), r, (st, ld) in zip(entries, regs, spills):
            if "_f16_" in name or name.startswith(("write_kv_f16", "copy")):
                print(f"  {name:32s} {r:>4s} registers, spill stores {st} B, loads {ld} B")
    assert all(st == "0" and ld == "0" for st, ld in spills), "register spills"


# ---- write_kv / copy_blocks ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_write_kv_writes_exactly_its_slots(launcher, dtype):
    rng, seed = fresh_rng()
    layers, num_blocks, block_size, kvh, hd = 2, 6, 8, 3, 64
    pool = torch.full((layers, 2, num_blocks, block_size, kvh, hd), float("nan"), dtype=dtype)
    slots = torch.from_numpy(rng.permutation(num_blocks * block_size)[:17])
    # Strided key/value: every other token row of a bigger tensor.
    key = torch.randn(34, kvh, hd).to(dtype)[::2]
    value = torch.randn(34, kvh, hd).to(dtype)[1::2]
    backend(launcher).write_kv(pool[1], key, value, slots)
    flat = pool[1].reshape(2, num_blocks * block_size, kvh, hd)
    assert torch.equal(flat[0, slots], key) and torch.equal(flat[1, slots], value), seed
    untouched = torch.ones(num_blocks * block_size, dtype=torch.bool)
    untouched[slots] = False
    assert torch.isnan(flat[:, untouched]).all() and torch.isnan(pool[0]).all(), seed


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_copy_blocks_matches_torch(launcher, dtype):
    rng, seed = fresh_rng()
    pool = torch.randn(3, 2, 10, 8, 2, 64).to(dtype)
    copies = [(1, 7), (4, 2), (4, 9), (0, 5)]
    expected = pool.clone()
    src = torch.tensor([s for s, _ in copies])
    dst = torch.tensor([d for _, d in copies])
    expected[:, :, dst] = expected[:, :, src]
    backend(launcher).copy_blocks(pool, copies)
    assert torch.equal(pool, expected), seed
    assert launcher.launches[-1][0] == "copy_blocks_u128"
    # A 6-byte block (block_size 3, kvh 1, hd 1, 16-bit) falls back to 2-byte words.
    small = torch.randn(2, 2, 5, 3, 1, 1).to(torch.float16)
    exp_small = small.clone()
    exp_small[:, :, [4]] = exp_small[:, :, [1]]
    backend(launcher).copy_blocks(small, [(1, 4)])
    assert torch.equal(small, exp_small) and launcher.launches[-1][0] == "copy_blocks_u16"


# ---- attention -------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", GQA)
@pytest.mark.parametrize("block_size", [8, 16])
def test_kernel_decode_split_matches_reference(launcher, dtype, heads, block_size):
    rng, seed = fresh_rng()
    be = backend(launcher)
    query, kv_layer, meta, _ = make_case(rng, be, ["decode"] * 5, block_size, *heads, 64, dtype, max_blocks=8)
    assert meta.is_all_decode
    # 2-5 splits of the longest context; generally not a multiple of block_size or of the kernel's tile.
    be.partition_size = max(3, -(-meta.max_seq_len // int(rng.integers(2, 6))))
    check_forward(be, query, kv_layer, meta, seed)
    names = [name for name, _, _ in launcher.launches]
    splits = launcher.launches[-2][1][2]
    assert names[-2:] == [f"paged_decode_{_tag(dtype)}_d64", f"paged_decode_reduce_{_tag(dtype)}_d64"]
    assert splits > 1


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [32, 128])
def test_kernel_decode_single_split_head_dim_128(launcher, dtype, block_size):
    rng, seed = fresh_rng()
    be = backend(launcher)  # default sizing: short contexts -> one split, output written directly
    query, kv_layer, meta, _ = make_case(rng, be, ["decode"] * 3, block_size, 6, 2, 128, dtype, max_blocks=2)
    check_forward(be, query, kv_layer, meta, seed)
    assert launcher.launches[-1] == (f"paged_decode_{_tag(dtype)}_d128", (2, 3, 1), NUM_THREADS)


MIXED = ["decode", "chunk", "decode", "prefill", "chunk", "decode"]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("heads", GQA)
def test_kernel_mixed_batch_matches_reference(launcher, dtype, heads):
    rng, seed = fresh_rng()
    be = backend(launcher, partition_size=32)
    kinds = list(rng.permutation(MIXED))  # decodes are not necessarily first
    block_size = int(rng.choice([8, 16]))
    query, kv_layer, meta, _ = make_case(rng, be, kinds, block_size, *heads, 64, dtype, max_blocks=3)
    check_forward(be, query, kv_layer, meta, f"{seed} (block_size {block_size})")
    names = [name for name, _, _ in launcher.launches]
    assert f"paged_prefill_{_tag(dtype)}_d64" in names and f"paged_decode_{_tag(dtype)}_d64" in names


@pytest.mark.parametrize("kinds", [["prefill"] * 2, ["chunk"] * 3, ["prefill", "chunk"]])
def test_kernel_prefill_only_head_dim_128(launcher, kinds):
    rng, seed = fresh_rng()
    be = backend(launcher)
    query, kv_layer, meta, _ = make_case(rng, be, kinds, 16, 4, 2, 128, torch.float32, max_blocks=3)
    assert meta.num_decodes == 0
    check_forward(be, query, kv_layer, meta, seed)
    assert {name for name, _, _ in launcher.launches} == {"write_kv_f32", "paged_prefill_f32_d128"}


def test_kernel_unsupported_head_dim_falls_back_to_torch(launcher):
    rng, seed = fresh_rng()
    be = backend(launcher)
    query, kv_layer, meta, _ = make_case(rng, be, ["decode", "chunk"], 8, 4, 2, 16, torch.float32)
    check_forward(be, query, kv_layer, meta, seed)
    assert not any(name.startswith("paged_") for name, _, _ in launcher.launches)


def _tag(dtype):
    return {torch.float32: "f32", torch.float16: "f16", torch.bfloat16: "bf16"}[dtype]
