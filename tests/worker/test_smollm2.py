"""The default model (SmolLM2-135M-Instruct) on the paged worker matches transformers' greedy generate."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.support.worker import PATHS, assert_same_greedy, reference_greedy
from worker_svc.attention import AttentionMetadata
from pagedserve_cli.bench.local_driver import LocalDriver
from worker_svc.kv_pool import KVPool
from worker_svc.models import load_model
from worker_svc.runner import ModelRunner, StepContext
from worker_svc.worker import make_backend

pytestmark = pytest.mark.slow
TEXTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,",
         "The three primary colors are"]
NEW = 32


@pytest.mark.parametrize("path", list(PATHS))
def test_smollm2_greedy_matches_transformers_in_mixed_chunked_batches(smollm2_dir, path):
    torch.set_num_threads(1)
    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    prompts = [tok(t)["input_ids"] for t in TEXTS]
    ref_model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32, attn_implementation="sdpa")
    refs = [reference_greedy(ref_model.eval(), p, NEW) for p in prompts]
    lean, backend = PATHS[path]
    loaded = load_model(smollm2_dir, dtype="float32", lean=lean)
    pool = KVPool(loaded.kv_geometry(16), 64)
    runner = ModelRunner(loaded, pool, make_backend(backend, "cpu", pool.geometry), lean=lean)
    assert runner.forward_path == ("lean" if lean else "transformers")
    # A 6-token budget splits every prompt into chunks and mixes prefills with decodes.
    driver = LocalDriver(runner, max_num_batched_tokens=6)
    ids = [driver.add(p, NEW, arrival_step=3 * i) for i, p in enumerate(prompts)]
    out = driver.run()
    for request_id, ref in zip(ids, refs):
        assert_same_greedy(out[request_id][0], *ref)
    assert tok.decode(out[ids[0]][0]).startswith(" Paris")


def test_smollm2_lean_decode_logits_are_within_float32s_rounding_bound_of_float64(smollm2_dir):
    """The production path (lean forward, C++ attention): every decode step's logits against transformers' forward
    over the whole sequence in float64, the exact reference. The bound is derived, not picked: the probabilistic
    rounding-error bound of a computation of n sequential float32 roundings, sqrt(n) * u * |logits| (u = 2^-24;
    Higham & Mary, "A new approach to probabilistic rounding error analysis", 2019), with n the reductions' lengths
    along the network: per layer the q/k/v, o and gate/up matmuls (K = hidden), the down matmul (K = intermediate),
    the scores (head_dim) and the softmax's sum (the context), then the lm_head. Machines whose kernels sum in other
    orders (an AMD part measured 1.03e-4 against transformers' float32) stay inside it; a bfloat16 rounding
    anywhere (u = 2^-8) does not."""
    torch.set_num_threads(1)
    tokens = list(range(1000, 1096))
    loaded = load_model(smollm2_dir, dtype="float32")
    pool = KVPool(loaded.kv_geometry(16), 8)
    backend = make_backend("cpu", "cpu", pool.geometry)
    runner = ModelRunner(loaded, pool, backend)
    table = list(range(6))
    n = 40  # prefill, then one decode step per position (the kernel's q_len-1 path)
    with torch.inference_mode():
        ours = []
        meta = AttentionMetadata.build([n], [n], [table], 16)
        runner.lean.forward(torch.tensor(tokens[:n]), torch.arange(n), StepContext(runner.pool.kv, meta, backend),
                            torch.tensor([n - 1]))
        for p in range(n, len(tokens)):
            meta = AttentionMetadata.build([1], [p + 1], [table], 16)
            ours.append(runner.lean.forward(torch.tensor([tokens[p]]), torch.tensor([p]),
                                            StepContext(runner.pool.kv, meta, backend), torch.tensor([0]))[0])
        ours = torch.stack(ours).double()
        exact_model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float64, attn_implementation="sdpa")
        exact = exact_model.eval()(torch.tensor([tokens])).logits[0, n:].double()
    cfg = exact_model.config
    head_dim = cfg.hidden_size // cfg.num_attention_heads
    per_layer = 3 * cfg.hidden_size + cfg.intermediate_size + head_dim + len(tokens)
    roundings = cfg.num_hidden_layers * per_layer + cfg.hidden_size
    bound = math.sqrt(roundings) * 2.0 ** -24 * exact.abs().amax(-1)
    err = (ours - exact).abs().amax(-1)
    assert (err <= bound).all(), [(round(float(e), 7), round(float(b), 7)) for e, b in zip(err, bound) if e > b][:8]
