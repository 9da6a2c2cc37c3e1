"""On a GPU, the worker with the CuPy kernels is token-identical to transformers (skipped without CUDA)."""

from __future__ import annotations

import random

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from tests.worker.helpers import TINY, assert_same_greedy

pytestmark = [pytest.mark.gpu, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def cuda_model_dir(tmp_path_factory):
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    pytest.importorskip("cupy")
    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny-llama-gpu")
    AutoModelForCausalLM.from_config(LlamaConfig(**TINY), dtype=torch.float32).save_pretrained(path)
    return str(path)


@pytest.mark.parametrize("chunk", [512, 7])
def test_kernel_backend_greedy_matches_transformers_on_gpu(cuda_model_dir, chunk):
    from worker_svc.attention.cupy_backend import CupyAttentionBackend
    from worker_svc.driver import LocalDriver
    from worker_svc.kv_pool import KVPool
    from worker_svc.models import load_model
    from worker_svc.runner import ModelRunner

    loaded = load_model(cuda_model_dir, dtype="float32", device="cuda")
    runner = ModelRunner(loaded, KVPool(loaded.kv_layout(16), 64, "cuda"), CupyAttentionBackend())
    ref = AutoModelForCausalLM.from_pretrained(cuda_model_dir, dtype=torch.float32,
                                               attn_implementation="eager").cuda().eval()
    prompts = [[random.Random(i).randrange(512) for _ in range(n)] for i, n in enumerate([5, 17, 40, 64])]
    driver = LocalDriver(runner, max_num_batched_tokens=chunk)
    ids = [driver.add(p, 24, arrival_step=i) for i, p in enumerate(prompts)]
    out = driver.run()
    for request_id, p in zip(ids, prompts):
        with torch.inference_mode():
            g = ref.generate(torch.tensor([p], device="cuda"), do_sample=False, max_new_tokens=24,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        assert_same_greedy(out[request_id][0], g.sequences[0, len(p):].tolist(), torch.stack(g.logits, 1)[0].cpu())
