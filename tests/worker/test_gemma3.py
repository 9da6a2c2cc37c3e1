"""Gemma 3 270M, converted from its GGUF, on the paged worker: greedy tokens identical to transformers' generate (eager
attention, float32, the same dequantised weights), on a short prompt and on a prompt longer than its 512-token sliding
window, through the transformers modules with pagedserve's attention hook (the C++ CPU kernel and the torch backend),
prompts split into chunks and batched with decodes."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from pagedserve_cli.bench.local_driver import LocalDriver
from tests.support.worker import assert_same_greedy, reference_greedy, reference_model
from worker_svc.kv_pool import KVPool
from worker_svc.models import load_model
from worker_svc.runner import ModelRunner
from worker_svc.worker import make_backend

pytestmark = pytest.mark.slow
SHORT = ["The capital of France is", "def fibonacci(n):"]
LONG_TOKENS = 560  # past the 512-token window: the sliding layers' first keys fall out of it while prefilling
LONG_NEW = 40
TOWNS = ["Amberley", "Brookfield", "Castleton", "Dunmore", "Elmstead", "Fairhaven", "Glenrock", "Hollowmere"]


def long_prompt(tok) -> list[int]:
    """LONG_TOKENS tokens of a varied, deterministic chronicle (BOS first), cut mid-sentence."""
    text = " ".join(f"In {1700 + 3 * i}, {TOWNS[i % 8]} built {i % 7 + 2} bridges and {TOWNS[(5 * i + 3) % 8]} "
                    f"answered with {(i * i) % 11 + 1} mills." for i in range(120))
    ids = tok(text)["input_ids"]
    assert len(ids) > LONG_TOKENS
    return ids[:LONG_TOKENS]


@pytest.fixture(scope="module")
def reference(gemma3_dir):
    torch.set_num_threads(1)
    return reference_model(gemma3_dir)


def paged_runner(model_dir: str, backend: str) -> ModelRunner:
    loaded = load_model(model_dir, dtype="float32")
    # NOTE: the lean forward refuses Gemma 3 (sliding layers, GELU): its weights come dequantised, as the reference's
    assert not loaded.runs_quantized and loaded.model_type == "gemma3_text"
    pool = KVPool(loaded.kv_geometry(16), 96)
    runner = ModelRunner(loaded, pool, make_backend(backend, "cpu", pool.geometry))
    assert runner.forward_path == "transformers", runner.lean_skip_reason
    return runner


@pytest.mark.parametrize("backend", ["cpu", "torch"])
def test_gemma3_greedy_matches_transformers_across_the_sliding_window(gemma3_dir, reference, backend):
    tok = AutoTokenizer.from_pretrained(gemma3_dir)
    prompts = [tok(t)["input_ids"] for t in SHORT] + [long_prompt(tok)]
    new = [24, 24, LONG_NEW]
    assert all(p[0] == tok.bos_token_id for p in prompts)
    refs = [reference_greedy(reference, p, n) for p, n in zip(prompts, new)]
    runner = paged_runner(gemma3_dir, backend)
    # 200 tokens a step: the long prompt prefills in 3 chunks (the third past the window), beside the others' decodes
    driver = LocalDriver(runner, max_num_batched_tokens=200)
    ids = [driver.add(p, n, arrival_step=2 * i) for i, (p, n) in enumerate(zip(prompts, new))]
    out = driver.run()
    for request_id, ref in zip(ids, refs):
        assert_same_greedy(out[request_id][0], *ref)
    assert len(out[ids[2]][0]) == LONG_NEW and len(prompts[2]) + LONG_NEW > 512 + 64


def test_the_long_prompt_needs_the_window(gemma3_dir, reference):
    """The long prompt's next-token logits with every layer attending to everything differ from the sliding ones
    by far more than float32 rounding: a forward that ignored the window could not match the tokens above."""
    tok = AutoTokenizer.from_pretrained(gemma3_dir)
    ids = torch.tensor([long_prompt(tok)])
    with torch.inference_mode():
        sliding = reference(ids).logits[0, -1]
        reference.config.sliding_window = 10**6
        for layer in reference.model.layers:
            if layer.self_attn.sliding_window is not None:
                layer.self_attn.sliding_window = 10**6
        try:
            full = reference(ids).logits[0, -1]
        finally:
            reference.config.sliding_window = 512
            for layer in reference.model.layers:
                if layer.self_attn.sliding_window is not None:
                    layer.self_attn.sliding_window = 512
    assert float((sliding - full).abs().max()) > 1e-2
