"""The default model (SmolLM2-135M-Instruct) on the paged worker matches transformers' greedy generate."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.worker.helpers import assert_same_greedy, reference_greedy
from worker_svc.attention import TorchAttentionBackend
from worker_svc.driver import LocalDriver
from worker_svc.kv_pool import KVPool
from worker_svc.model_store import resolve_model
from worker_svc.models import load_model
from worker_svc.runner import ModelRunner

pytestmark = pytest.mark.slow
TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
         "The three primary colors are"]
NEW = 32


@pytest.fixture(scope="module")
def model_dir() -> str:
    return str(resolve_model("smollm2-135m-instruct"))


def test_smollm2_greedy_matches_transformers_in_mixed_chunked_batches(model_dir):
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    ref_model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa")
    refs = [reference_greedy(ref_model.eval(), p, NEW) for p in prompts]
    loaded = load_model(model_dir, dtype="float32")
    runner = ModelRunner(loaded, KVPool(loaded.kv_layout(16), 64), TorchAttentionBackend())
    # A 6-token budget splits every prompt into chunks and mixes prefills with decodes.
    driver = LocalDriver(runner, max_num_batched_tokens=6)
    ids = [driver.add(p, NEW, arrival_step=3 * i) for i, p in enumerate(prompts)]
    out = driver.run()
    for request_id, ref in zip(ids, refs):
        assert_same_greedy(out[request_id][0], *ref)
    assert tok.decode(out[ids[0]][0]).startswith(" Paris")
