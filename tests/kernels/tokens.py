"""The worker end to end over the CUDA kernels' backend vs transformers' greedy generate (host shim or GPU)."""

from __future__ import annotations

import random

import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from pagedserve_cli.bench.tiny_model import TINY
from tests.support.worker import assert_same_greedy

# head_dim 64 (256 / 4), the kernels' smallest instantiation: the TINY models' head_dim 16 would send every
# attention call to the torch fallback and prove nothing about the kernels. GQA ratio 2.
KERNEL_TINY = {**TINY, "hidden_size": 256, "num_attention_heads": 4, "num_key_value_heads": 2}
NEW = 24


def save_kernel_tiny(path) -> str:
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(LlamaConfig(**KERNEL_TINY), dtype=torch.float32).save_pretrained(path)
    return str(path)


def check_greedy_tokens(model_dir: str, backend, device: str, chunk: int) -> None:
    """Staggered arrivals (mixed prefill + decode steps), chunked prefill when `chunk` is small, a shared
    prefix (prefix-cache hit) and an n=2 fork (copy-on-write of the shared partial block): every sample must
    be token-identical to transformers."""
    requests, out = run_greedy(model_dir, backend, device, chunk)
    ref = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                               attn_implementation="eager").to(device).eval()
    for request_id, p in requests:
        with torch.inference_mode():
            g = ref.generate(torch.tensor([p], device=device), do_sample=False, max_new_tokens=NEW,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
        for sample in out[request_id]:
            assert_same_greedy(sample, g.sequences[0, len(p):].tolist(), torch.stack(g.logits, 1)[0].cpu())


def run_greedy(model_dir: str, backend, device: str, chunk: int, kv_cache_dtype: str = "auto"):
    """check_greedy_tokens' workload through the worker's runner and the real scheduler, on a `kv_cache_dtype`
    pool: returns ([(request id, prompt)], {request id: [sample tokens]})."""
    from pagedserve_cli.bench.local_driver import LocalDriver
    from worker_svc.kv_pool import KVPool
    from worker_svc.models import load_model
    from worker_svc.runner import ModelRunner

    loaded = load_model(model_dir, dtype="float32", device=device)
    runner = ModelRunner(loaded, KVPool(loaded.kv_geometry(16, kv_cache_dtype), 64, device), backend)
    prompts = [[random.Random(i).randrange(512) for _ in range(n)] for i, n in enumerate([5, 17, 40, 70])]
    prompts.append(prompts[3][:48] + [7, 8, 9])  # three full blocks shared with prompt 3
    # 30 tokens: 29 computed once, then the two samples share the partial second block (13 tokens).
    fork_prompt = [random.Random(9).randrange(512) for _ in range(30)]
    driver = LocalDriver(runner, max_num_batched_tokens=chunk)
    # Prompt 4 arrives once prompt 3's first blocks are computed (and so cached), even with 7-token chunks.
    ids = [driver.add(p, NEW, arrival_step=step) for step, p in zip([0, 1, 2, 3, 20], prompts)]
    fork = driver.add(fork_prompt, NEW, arrival_step=1, n=2)
    out = driver.run()
    assert driver.scheduler.kv.prefix_hit_tokens >= 48  # prompt 4 read prompt 3's blocks from the cache
    assert driver.num_copies >= 1  # the fork's first decode copied the shared partial block
    return [*zip(ids, prompts), (fork, fork_prompt)], out
