"""The lean forward over weights kept quantised, its matmuls on cuda/quant_gemm.cu (CupyQuantKernel through the host
shim's launcher, CPU tensors), on a tiny Llama converted from a GGUF file that holds every block format: the wiring a
GPU worker runs (test_kernels_gpu_quant_gemm.py runs it on a device).

1. Its logits are the float32 model's (the same blocks dequantised at load) within float32 summation noise: every
   quantised matmul, the tied Q8_0 head included, ran on the kernel (the launches name each format).
2. The model's blocks were never turned into float weights: QuantLinear parts hold the file's bytes as they are.
3. On a GPU, what its kernel cannot run is refused by flag (int8 activations; the blocks as stored without CuPy).
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

from pagedserve_common.startup import StartupError
from tests.support.quant_model import FORMATS, PROMPT, prefill_then_decode_logits, tiny_quantized_model
from worker_svc.lean_model import LeanModel
from worker_svc.models import load_model
from worker_svc.quant.cupy_kernel import CupyQuantKernel
from worker_svc.quant.linear import QuantLinear
from worker_svc.quant.store import load_quantized
from worker_svc.worker import make_backend

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_quantized_model(tmp_path_factory.mktemp("tiny-quant"))


def test_lean_forward_on_the_gpu_kernel_is_the_dequantised_model_within_float32_noise(model_dir, launcher):
    floats = load_model(model_dir, dtype="float32", weight_dtype="float32")  # blocks dequantised at load
    assert not floats.quantized
    quantized = load_quantized(model_dir)
    kernel = CupyQuantKernel(launcher)
    lean = LeanModel(floats.model, True, quantized, quant_kernel=kernel)
    reference = LeanModel(floats.model, True)
    backend = make_backend("torch", "cpu", floats.kv_geometry(16))

    linears = [lean.lm_head, *(lin for layer in lean.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))]
    assert all(isinstance(lin, QuantLinear) and lin.kernel is kernel for lin in linears)
    packed = {p.packed.data_ptr(): p for lin in linears for p in lin.parts}
    assert all(p.packed.dtype == torch.uint8 for p in packed.values())  # the file's bytes, not floats

    got = prefill_then_decode_logits(lean, floats, backend, PROMPT, 3)
    want = prefill_then_decode_logits(reference, floats, backend, PROMPT, 3)
    assert got.shape == want.shape == (len(PROMPT) + 3, floats.vocab_size)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item()), (got - want).abs().max()
    ran = {name.split("_")[2] + "_" + name.split("_")[3] for name, _, _ in launcher.launches}
    assert ran == set(FORMATS.values())


def test_a_gpu_worker_refuses_what_its_quantised_kernel_cannot_run_by_flag(model_dir):
    """Refused before any weight is loaded (so without a GPU): int8 activations (the GPU kernel takes floats), or,
    without CuPy, the blocks as stored."""
    with pytest.raises(StartupError) as refused:
        load_model(model_dir, dtype="float32", device="cuda", weight_dtype="as-stored", activation_dtype="int8")
    has_cupy = importlib.util.find_spec("cupy") is not None
    want = "--activation-dtype int8: the int8-activation kernel runs on the CPU" if has_cupy else \
        "--weight-dtype as-stored: "
    assert str(refused.value).startswith(want)
    assert has_cupy or "CuPy: not installed" in str(refused.value)
    with pytest.raises(StartupError, match="--weight-dtype as-stored: .* not mps"):
        load_model(model_dir, dtype="float32", device="mps", weight_dtype="as-stored")
