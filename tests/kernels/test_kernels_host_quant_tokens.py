"""The whole worker over cuda/paged_attention.cu's 8-bit-cache kernels built for the host: the same greedy tokens
as the torch backend on the same 8-bit cache (both write quant.quantize's codes; only float summation order
differs), through mixed prefill/decode steps, chunked prefill, a prefix-cache hit and a copy-on-write fork (whose
copy moves the scales with the codes)."""

from __future__ import annotations

import pytest

from tests.kernels.tokens import run_greedy, save_kernel_tiny
from worker_svc.attention.cupy_backend import CupyAttentionBackend
from worker_svc.attention.torch_backend import TorchAttentionBackend

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def kernel_model_dir(tmp_path_factory) -> str:
    return save_kernel_tiny(tmp_path_factory.mktemp("kernel-tiny-quant"))


@pytest.mark.parametrize(("kv_cache_dtype", "chunk"), [("int8", 7), ("fp8_e4m3", 512)])
def test_kernel_host_8bit_cache_greedy_matches_torch_backend(kernel_model_dir, launcher, kv_cache_dtype, chunk):
    backend = CupyAttentionBackend(launcher, num_threads=64, partition_size=64, poison_workspace=True)
    _, got = run_greedy(kernel_model_dir, backend, "cpu", chunk, kv_cache_dtype)
    _, want = run_greedy(kernel_model_dir, TorchAttentionBackend(), "cpu", chunk, kv_cache_dtype)
    assert got == want
    tag = {"int8": "f32_i8", "fp8_e4m3": "f32_e4m3"}[kv_cache_dtype]
    names = {name for name, _, _ in launcher.launches}
    assert {f"write_kv_{tag}", f"paged_decode_{tag}_d64", "paged_decode_reduce_f32_d64",
            f"paged_prefill_{tag}_d64", "copy_blocks_u128"} <= names, names  # fmt: skip
    assert backend._fallback is None  # every attention call ran the kernels
