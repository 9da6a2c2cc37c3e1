"""cuda/dense_gemm.cu on a GPU through CuPy (skipped without one): the host-shim checks of test_kernels_host_dense.py
at device sizes, and the lean forward on a GPU with batch invariance on.

1. float32 / float16 / bfloat16: bit for bit the contract's numpy emulation (the contract fixes every rounding, so the
   device's bits are the host shim's and the reference's), rows alone = rows in the batch; the RMSNorm likewise.
2. LeanModel(batch_invariant=True) on cuda runs every matmul and norm on the kernel, says it is batch invariant, and
   its logits are transformers' float32 forward on the CPU within float32 summation noise.
"""

from __future__ import annotations

import secrets

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from pagedserve_cli.bench.tiny_model import TINY
from tests.support.cuda import bits, skip_without_cupy_gpu
from tests.support.dense_reference import dense_gemm, rms_norm
from tests.support.quant_model import BLOCK_SIZE, PROMPT, prefill_then_decode_logits

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]

DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(scope="module")
def gpu_kernel():
    skip_without_cupy_gpu()
    from worker_svc.dense_gpu import CupyDenseKernel

    return CupyDenseKernel(norm_threads=256)  # compiles dense_gemm.cu once for the module


@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_dense_gemm_is_the_contract_bit_for_bit_and_batch_invariant(gpu_kernel, dtype):
    seed = secrets.randbits(63)
    rng = np.random.default_rng(seed)
    for m, n, k in ((1, 300, 1024), (137, 129, 1000)):
        x = torch.from_numpy(rng.standard_normal((m, k)).astype(np.float32)).to(dtype)
        w = torch.from_numpy((rng.standard_normal((n, k)) * 0.05).astype(np.float32)).to(dtype)
        bias = torch.from_numpy(rng.standard_normal(n).astype(np.float32)).to(dtype)
        out = gpu_kernel.linear(x.cuda(), w.cuda(), bias.cuda()).cpu()
        want = torch.from_numpy(dense_gemm(x.float().numpy(), w.float().numpy(), bias.float().numpy())).to(dtype)
        assert torch.equal(bits(out), bits(want)), f"seed {seed}, shape {(m, n, k)}"
        alone = gpu_kernel.linear(x[m - 1:].cuda(), w.cuda(), bias.cuda()).cpu()
        assert torch.equal(bits(alone), bits(out[m - 1:])), f"seed {seed}"


@pytest.mark.parametrize("dtype", DTYPES)
def test_gpu_rms_norm_is_the_contract_bit_for_bit_and_batch_invariant(gpu_kernel, dtype):
    seed = secrets.randbits(63)
    rng = np.random.default_rng(seed)
    x = torch.from_numpy(rng.standard_normal((33, 2048)).astype(np.float32) * 3).to(dtype)
    weight = torch.from_numpy(1 + 0.1 * rng.standard_normal(2048).astype(np.float32)).to(dtype)
    out = gpu_kernel.rms_norm(x.cuda(), weight.cuda(), 1e-6).cpu()
    assert torch.equal(bits(out), bits(rms_norm(x, weight, 1e-6, gpu_kernel.norm_threads))), f"seed {seed}"
    alone = gpu_kernel.rms_norm(x[5:6].cuda(), weight.cuda(), 1e-6).cpu()
    assert torch.equal(bits(alone), bits(out[5:6])), f"seed {seed}"


def test_gpu_lean_forward_runs_every_matmul_and_norm_on_the_dense_kernel(gpu_kernel, tmp_path):
    from worker_svc.lean_model import LeanModel
    from worker_svc.models import load_model
    from worker_svc.worker import make_backend

    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**TINY), dtype=torch.float32).save_pretrained(tmp_path)
    loaded = load_model(tmp_path, dtype="float32", device="cuda")
    lean = LeanModel(loaded.model, True)
    linears = [lean.lm_head, *(lin for layer in lean.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))]
    assert all(lin.kind == "dense" and lin.invariant for lin in linears) and lean.batch_invariant
    backend = make_backend("torch", "cuda", loaded.kv_geometry(BLOCK_SIZE))
    got = prefill_then_decode_logits(lean, loaded, backend, PROMPT, 3, device="cuda")
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.inference_mode():
        want = ref(torch.tensor([PROMPT + PROMPT[:3]])).logits[0].float()
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item()), (got - want).abs().max()
