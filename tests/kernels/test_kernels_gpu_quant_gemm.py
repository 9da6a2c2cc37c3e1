"""cuda/quant_gemm.cu on a GPU through CuPy (skipped without one): the host-shim checks of
test_kernels_host_quant_gemm.py at device sizes, and a GGUF model served from its blocks on the device.

1. Every format x float32 / float16 / bfloat16: bit for bit the contract's numpy emulation (the contract fixes every
   rounding, so the device's bits are the host shim's and the reference's), rows alone = rows in the batch.
2. load_model(device="cuda", weight_dtype="as-stored") keeps the blocks quantised and its lean forward's logits are
   the float32 dequantised model's (on the CPU) within float32 summation noise; int8 activations are refused by name.
"""

from __future__ import annotations

import secrets

import numpy as np
import pytest
import torch

from pagedserve_common.startup import StartupError
from tests.support.cuda import bits, skip_without_cupy_gpu
from tests.support.quant_blocks import random_blocks
from tests.support.quant_gemm_reference import quant_gemm
from tests.support.quant_model import PROMPT, prefill_then_decode_logits, tiny_quantized_model
from worker_svc.quant.formats import FORMATS

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(scope="module")
def gpu_kernel():
    skip_without_cupy_gpu()
    from worker_svc.quant.cupy_kernel import CupyQuantKernel

    return CupyQuantKernel()  # compiles quant_gemm.cu once for the module


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", list(FORMATS))
def test_gpu_quant_gemm_is_the_contract_bit_for_bit_and_batch_invariant(gpu_kernel, name, dtype):
    fmt = FORMATS[name]
    seed = secrets.randbits(63)
    rng = np.random.default_rng(seed)
    for m, n, k in ((1, 300, 1024), (37, 129, 2048)):
        blocks = random_blocks(rng, fmt, n, k, scale=0.02)
        x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).to(dtype)
        bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(dtype)
        packed = gpu_kernel.pack(fmt.ggml_type, torch.from_numpy(blocks), k)
        assert packed.is_cuda
        out = gpu_kernel.linear(fmt.ggml_type, x.cuda(), packed, n, bias.cuda()).cpu()
        want = torch.from_numpy(quant_gemm(x.float().numpy(), blocks, fmt, bias.float().numpy())).to(dtype)
        assert torch.equal(bits(out), bits(want)), f"seed {seed}, shape {(m, n, k)}"
        alone = gpu_kernel.linear(fmt.ggml_type, x[m - 1:].cuda(), packed, n, bias.cuda()).cpu()
        assert torch.equal(bits(alone), bits(out[m - 1:])), f"seed {seed}"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    pytest.importorskip("gguf")  # the conversion reads the file with gguf-py (the dev extra; carry it to a GPU box)
    return tiny_quantized_model(tmp_path_factory.mktemp("tiny-quant"))


def test_gpu_model_runs_from_its_blocks_within_float32_noise_of_the_dequantised_model(gpu_kernel, model_dir):
    from worker_svc.lean_model import LeanModel
    from worker_svc.models import load_model
    from worker_svc.quant.cupy_kernel import CupyQuantKernel
    from worker_svc.quant.linear import QuantLinear
    from worker_svc.worker import make_backend

    on_gpu = load_model(model_dir, dtype="float32", device="cuda", weight_dtype="as-stored")
    assert on_gpu.runs_quantized and on_gpu.weights_reason.startswith("as-stored: as stored")
    lean = LeanModel(on_gpu.model, True, on_gpu.quantized)
    assert isinstance(lean.layers[0].down, QuantLinear) and isinstance(lean.layers[0].down.kernel, CupyQuantKernel)
    assert lean.layers[0].down.parts[0].packed.is_cuda
    got = prefill_then_decode_logits(lean, on_gpu, make_backend("cupy", "cuda", on_gpu.kv_geometry(16)), PROMPT, 3,
                                     device="cuda")

    floats = load_model(model_dir, dtype="float32", weight_dtype="float32")
    want = prefill_then_decode_logits(LeanModel(floats.model, True), floats,
                                      make_backend("torch", "cpu", floats.kv_geometry(16)), PROMPT, 3)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item()), (got - want).abs().max()

    with pytest.raises(StartupError, match="int8-activation kernel runs on the CPU"):
        load_model(model_dir, dtype="float32", device="cuda", weight_dtype="as-stored", activation_dtype="int8")
    # auto dequantises on a GPU until the kernel is measured there, and says so
    auto = load_model(model_dir, dtype="float32", device="cuda")
    assert not auto.runs_quantized and "on a GPU auto dequantises" in auto.weights_reason, auto.weights_reason
