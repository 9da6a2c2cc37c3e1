"""Helpers for worker tests: reference generation with transformers, runners, greedy comparison."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from worker_svc.kv_pool import KVPool
from worker_svc.models import load_model
from worker_svc.runner import ModelRunner
from worker_svc.worker import make_backend

# initializer_range 0.2: random weights peaked enough that greedy outputs vary with the context.
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=512, initializer_range=0.2, eos_token_id=None,
            bos_token_id=None, pad_token_id=None, tie_word_embeddings=False)


def reference_model(model_dir: str):
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()


# The two ways a worker runs a model: the production path (our lean forward over the C++ CPU attention kernel)
# and the transformers modules with the pagedserve hook over the torch backend (the fallback path).
PATHS = {"lean+cpu": (True, "cpu"), "transformers+torch": (False, "torch")}


def make_runner(model_dir: str, num_blocks: int = 64, block_size: int = 16, path: str = "lean+cpu") -> ModelRunner:
    lean, backend = PATHS[path]
    loaded = load_model(model_dir, dtype="float32")
    pool = KVPool(loaded.kv_geometry(block_size), num_blocks)
    runner = ModelRunner(loaded, pool, make_backend(backend, "cpu", pool.geometry), lean=lean)
    assert runner.forward_path == ("lean" if lean else "transformers"), runner.lean_skip_reason
    return runner


def reference_greedy(model, prompt: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' own greedy generate, and the logits at every generated position."""
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens,
                             output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    return out.sequences[0, len(prompt):].tolist(), torch.stack(out.logits, 1)[0]


def assert_same_greedy(got: list[int], ref: list[int], ref_logits: torch.Tensor) -> None:
    """Token-identical, except that a divergence at a near-tie (top two logits within 1e-4) ends the check."""
    for i, (g, r) in enumerate(zip(got, ref)):
        if g != r:
            top2 = torch.topk(ref_logits[i], 2).values
            assert float(top2[0] - top2[1]) < 1e-4, f"diverged at {i}: {got} != {ref}"
            return
    assert len(got) == len(ref), (got, ref)
