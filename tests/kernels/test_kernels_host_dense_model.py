"""The lean forward with batch invariance on, its matmuls and RMSNorms on cuda/dense_gemm.cu (CupyDenseKernel through
the host shim's launcher, CPU tensors): the wiring a GPU worker runs with --batch-invariant on.

1. Every matmul (the fused QKV and gate/up, o, down, the lm_head) and every norm (input, post-attention, Qwen3's q/k
   norms, the final norm) ran on the kernel, and the model says it is batch invariant.
2. Its logits are transformers' forward within float32 summation noise: both sum at most 128 float32 products per
   output in their own orders (each within gamma_128 ~ 8e-6 of sum |x w|) through two layers, so 1e-4 relative
   (1e-5 of the largest logit absolute) holds with margin, while a wrong weight, bias or norm moves logits by O(1).
3. A sequence's logits are the same bits alone and beside other sequences (79 rows: two of the kernel's row tiles).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

from pagedserve_cli.bench.tiny_model import TINY
from tests.support.cuda import bits
from tests.support.quant_model import BLOCK_SIZE, PROMPT, prefill_then_decode_logits
from worker_svc.attention import AttentionMetadata
from worker_svc.dense_gpu import CupyDenseKernel
from worker_svc.kv_pool import KVPool
from worker_svc.lean_model import LeanModel
from worker_svc.models import load_model
from worker_svc.runner import StepContext
from worker_svc.worker import make_backend

pytestmark = pytest.mark.timeout(900)
CONFIGS = {"llama": lambda: LlamaConfig(**TINY), "qwen3": lambda: Qwen3Config(**TINY, head_dim=16)}


@pytest.fixture(scope="module", params=list(CONFIGS))
def model_dir(request, tmp_path_factory) -> str:
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp(f"tiny-{request.param}")
    AutoModelForCausalLM.from_config(CONFIGS[request.param](), dtype=torch.float32).save_pretrained(path)
    return str(path)


def lean_on_the_kernel(model_dir: str, dtype: str, launcher):
    loaded = load_model(model_dir, dtype=dtype)
    lean = LeanModel(loaded.model, True, dense_kernel=CupyDenseKernel(launcher, norm_threads=64))
    return loaded, lean


def test_lean_forward_on_the_dense_kernel_is_transformers_within_float32_noise(model_dir, launcher):
    loaded, lean = lean_on_the_kernel(model_dir, "float32", launcher)
    linears = [lean.lm_head, *(lin for layer in lean.layers for lin in (layer.qkv, layer.o, layer.gate_up, layer.down))]
    assert all(lin.kind == "dense" and lin.invariant for lin in linears)
    assert lean.batch_invariant and lean.ops is None and lean.stack is None

    backend = make_backend("cpu", "cpu", loaded.kv_geometry(BLOCK_SIZE))
    got = prefill_then_decode_logits(lean, loaded, backend, PROMPT, 3)
    tokens = PROMPT + PROMPT[:3]
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    with torch.inference_mode():
        want = ref(torch.tensor([tokens])).logits[0].float()
    assert got.shape == want.shape == (len(tokens), loaded.vocab_size)
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5 * want.abs().max().item()), (got - want).abs().max()

    names = [name for name, _, _ in launcher.launches]
    num_norms = len(lean.layers) * (4 if lean.layers[0].q_norm is not None else 2) + 1
    num_matmuls = 4 * len(lean.layers) + 1
    assert names[:num_norms + num_matmuls].count("rms_norm_f32") == num_norms  # the prefill step's launches
    assert names[:num_norms + num_matmuls].count("dense_gemm_f32") == num_matmuls


def sequences_logits(lean, loaded, backend, prompts: list[list[int]]) -> list[torch.Tensor]:
    """One prefill step of `prompts` side by side (a fresh pool): each prompt's logits, every row."""
    lens = [len(p) for p in prompts]
    blocks = [-(-n // BLOCK_SIZE) for n in lens]
    pool = KVPool(loaded.kv_geometry(BLOCK_SIZE), sum(blocks) + 1)
    starts = [sum(blocks[:i]) for i in range(len(prompts))]
    tables = [list(range(s, s + b)) for s, b in zip(starts, blocks)]
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.tensor([i for n in lens for i in range(n)])
    with torch.inference_mode():
        meta = AttentionMetadata.build(lens, lens, tables, BLOCK_SIZE)
        logits = lean.forward(ids, positions, StepContext(pool.kv, meta, backend), torch.arange(sum(lens)))
    return list(logits.split(lens))


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_sequence_gets_the_same_logit_bits_alone_and_beside_others(model_dir, launcher, dtype):
    loaded, lean = lean_on_the_kernel(model_dir, dtype, launcher)
    backend = make_backend("cpu", "cpu", loaded.kv_geometry(BLOCK_SIZE), batch_invariant=True)
    gen = torch.Generator().manual_seed(7)
    others = [torch.randint(0, loaded.vocab_size, (n,), generator=gen).tolist() for n in (30, 40)]
    (alone,) = sequences_logits(lean, loaded, backend, [PROMPT])
    _, beside, _ = sequences_logits(lean, loaded, backend, [others[0], PROMPT, others[1]])  # rows 30..38 of 79
    assert torch.equal(bits(alone), bits(beside))
