"""On a GPU, the worker with the CuPy kernels is token-identical to transformers (skipped without CUDA)."""

from __future__ import annotations

import pytest
import torch

from tests.kernels.tokens import check_greedy_tokens, run_greedy, save_kernel_tiny

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def cuda_model_dir(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("cupy")
    return save_kernel_tiny(tmp_path_factory.mktemp("kernel-tiny-gpu"))


class RecordingLauncher:
    """CupyLauncher that remembers which kernels ran."""

    def __init__(self) -> None:
        from worker_svc.attention.cupy_backend import CupyLauncher

        self.inner = CupyLauncher()
        self.num_sms = self.inner.num_sms
        self.names: set[str] = set()

    def launch(self, name, grid, block, args) -> None:
        self.names.add(name)
        self.inner.launch(name, grid, block, args)


@pytest.mark.parametrize("chunk", [512, 7])
def test_kernel_backend_greedy_matches_transformers_on_gpu(cuda_model_dir, chunk):
    from worker_svc.attention.cupy_backend import CupyAttentionBackend

    launcher = RecordingLauncher()
    backend = CupyAttentionBackend(launcher, partition_size=64, poison_workspace=True)
    check_greedy_tokens(cuda_model_dir, backend, "cuda", chunk)
    assert {"write_kv_f32", "paged_decode_f32_d64", "paged_decode_reduce_f32_d64", "paged_prefill_f32_d64",
            "copy_blocks_u128"} <= launcher.names, launcher.names
    assert backend._fallback is None  # every attention call ran the kernels


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8_e4m3"])
def test_kernel_backend_8bit_cache_greedy_matches_torch_backend_on_gpu(cuda_model_dir, kv_cache_dtype):
    """The 8-bit cache kernels give the torch backend's tokens on the same 8-bit cache (same codes written)."""
    from worker_svc.attention.cupy_backend import CupyAttentionBackend
    from worker_svc.attention.torch_backend import TorchAttentionBackend

    launcher = RecordingLauncher()
    backend = CupyAttentionBackend(launcher, partition_size=64, poison_workspace=True)
    _, got = run_greedy(cuda_model_dir, backend, "cuda", 7, kv_cache_dtype)
    _, want = run_greedy(cuda_model_dir, TorchAttentionBackend(), "cuda", 7, kv_cache_dtype)
    assert got == want
    cache = {"int8": "i8", "fp8_e4m3": "e4m3", "fp8_e5m2": "e5m2"}[kv_cache_dtype]
    assert {f"write_kv_f32_{cache}", f"paged_decode_f32_{cache}_d64", f"paged_prefill_f32_{cache}_d64"} <= \
        launcher.names, launcher.names
    assert backend._fallback is None
