"""The whole worker over cuda/paged_attention.cu built for the host: token-identical to transformers on the CPU."""

from __future__ import annotations

import pytest

from tests.kernels.tokens import check_greedy_tokens, save_kernel_tiny
from worker_svc.attention.cupy_backend import CupyAttentionBackend

pytestmark = pytest.mark.timeout(600)


@pytest.fixture(scope="module")
def kernel_model_dir(tmp_path_factory) -> str:
    return save_kernel_tiny(tmp_path_factory.mktemp("kernel-tiny"))


@pytest.mark.parametrize("chunk", [512, 7])
def test_kernel_host_backend_greedy_matches_transformers(kernel_model_dir, launcher, chunk):
    # partition_size 64: contexts past 64 tokens split their decode over two CTAs, so the reduce pass runs too.
    backend = CupyAttentionBackend(launcher, num_threads=64, partition_size=64, poison_workspace=True)
    check_greedy_tokens(kernel_model_dir, backend, "cpu", chunk)
    names = {name for name, _, _ in launcher.launches}
    assert {"write_kv_f32", "paged_decode_f32_d64", "paged_decode_reduce_f32_d64", "paged_prefill_f32_d64",
            "copy_blocks_u128"} <= names, names
    assert backend._fallback is None  # every attention call ran the kernels
