"""The default model served from its GGUF's Q4_1 / Q8_0 blocks (--weight-dtype auto): no float copy of a quantised
weight is made, and in float32 its logits are, bit for bit, those of the model dequantised to float32 (the quantised
kernel computes the float32 panel kernel's chain on GGML's float32 weights), so its greedy tokens are too; the
flag's refusals name it."""

from __future__ import annotations

import pytest
import torch

from pagedserve_common.startup import USAGE, StartupError
from pagedserve_cli.bench.local_driver import LocalDriver
from tests.support.worker import prefill_then_decode_logits, runner_for
from worker_svc.kv_pool import KVPool
from worker_svc.models import load_model
from worker_svc.quant.kernel import shared_kernel
from worker_svc.runner import ModelRunner
from worker_svc.worker import make_backend

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shared_kernel() is None, reason="no quantised kernel on this CPU (AVX2+FMA+F16C)")]
PROMPTS = [[504, 3575, 282, 4649, 314], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], list(range(1000, 1040))]


def test_the_default_model_runs_from_its_blocks_by_default_with_no_float_copy(smollm2_dir):
    loaded = load_model(smollm2_dir, dtype="float32")
    formats = sorted({w.format.name for w in loaded.quantized.values()})
    assert (len(loaded.quantized), formats) == (211, ["q4_1", "q8_0"])
    assert loaded.weights_reason == "auto: as stored (210 q4_1, 1 q8_0)"
    inner = loaded.model.model
    # the quantised weights' parameters were never allocated; the norms were loaded
    assert inner.embed_tokens.weight.is_meta and inner.layers[0].mlp.down_proj.weight.is_meta
    assert not inner.layers[0].input_layernorm.weight.is_meta and not inner.norm.weight.is_meta
    held = sum(w.blocks.numel() for w in loaded.quantized.values())
    assert held < 0.2 * sum(w.shape[0] * w.shape[1] * 4 for w in loaded.quantized.values())  # ~5 bits, not 32


def test_float32_logits_are_the_dequantised_models_bit_for_bit(smollm2_dir):
    runners = {w: runner_for(smollm2_dir, w) for w in ("as-stored", "float32")}
    # the blocks packed for the kernel were released; the embedding's stay (its rows are read from them)
    assert list(runners["as-stored"].loaded.quantized) == ["model.embed_tokens.weight"]
    assert not runners["float32"].loaded.quantized
    logits = {name: prefill_then_decode_logits(runner) for name, runner in runners.items()}
    assert torch.equal(logits["as-stored"], logits["float32"])


def test_greedy_tokens_are_the_dequantised_models_in_chunked_mixed_batches(smollm2_dir):
    outs = {}
    for weight_dtype in ("as-stored", "float32"):
        driver = LocalDriver(runner_for(smollm2_dir, weight_dtype), max_num_batched_tokens=8)
        ids = [driver.add(p, 16, arrival_step=2 * i) for i, p in enumerate(PROMPTS)]
        out = driver.run()
        outs[weight_dtype] = [out[i][0] for i in ids]
    assert outs["as-stored"] == outs["float32"]


def test_runners_over_one_model_kept_quantised_share_its_lean_forward(smollm2_dir):
    # building a lean forward releases the blocks it packs, so a second runner over the same model (workers in one
    # process, tests) takes the first one's: the same tokens, not a forward over released weights
    loaded = load_model(smollm2_dir, dtype="float32")
    runners = [ModelRunner(loaded, KVPool(loaded.kv_geometry(16), n), make_backend("cpu", "cpu", loaded.kv_geometry(16)))
               for n in (64, 32)]
    assert runners[0].lean is runners[1].lean and runners[1].batch_invariant
    outs = []
    for runner in runners:
        driver = LocalDriver(runner, max_num_batched_tokens=8)
        ids = [driver.add(p, 8) for p in PROMPTS]
        out = driver.run()
        outs.append([out[i][0] for i in ids])
    assert outs[0] == outs[1]
    with pytest.raises(ValueError, match="packed for a lean forward with the other batch_invariant setting"):
        ModelRunner(loaded, runners[0].pool, runners[0].backend, batch_invariant=False)


def test_bfloat16_runs_from_the_blocks_too(smollm2_dir):
    runner = runner_for(smollm2_dir, "auto", dtype="bfloat16")
    assert runner.loaded.weights_reason == "auto: as stored (210 q4_1, 1 q8_0)"
    assert runner.batch_invariant, runner.batch_invariant_reason
    driver = LocalDriver(runner, max_num_batched_tokens=64)
    request = driver.add(PROMPTS[0], 8)
    assert len(driver.run()[request][0]) == 8


def test_the_flags_refusals_name_it(smollm2_dir):
    with pytest.raises(StartupError, match="--weight-dtype float32 with --dtype bfloat16") as e:
        load_model(smollm2_dir, dtype="bfloat16", weight_dtype="float32")
    assert e.value.exit_code == USAGE
    with pytest.raises(StartupError, match="--weight-dtype as-stored: .*--transformers-forward"):
        load_model(smollm2_dir, dtype="float32", weight_dtype="as-stored", lean=False)
    # auto dequantises where the kernel cannot run them, and says why
    loaded = load_model(smollm2_dir, dtype="float32", lean=False)
    assert not loaded.quantized and loaded.weights_reason.startswith("auto: 210 q4_1, 1 q8_0 dequantised (")


@pytest.mark.skipif(shared_kernel(int8_activations=True) is None, reason="no int8-activation kernel (AVX2) here")
def test_int8_activations_run_their_kernel_within_about_one_percent_and_batch_invariant(smollm2_dir):
    runner = runner_for(smollm2_dir, "auto", activation_dtype="int8")
    assert runner.loaded.weights_reason == "auto: as stored (210 q4_1, 1 q8_0); activations int8 (--activation-dtype int8)"
    lean = runner.lean
    assert all(lin.kernel.int8_activations for lin in [lean.lm_head, lean.layers[0].qkv, lean.layers[-1].down])
    # the logits move by activation rounding only (measured: about 1.4% relative L2 on average, 8% at worst)
    got, exact = prefill_then_decode_logits(runner), prefill_then_decode_logits(runner_for(smollm2_dir, "float32"))
    rel = (got - exact).norm(dim=1) / exact.norm(dim=1)
    assert rel.mean() < 0.045 and rel.max() < 0.25, rel
    # each sequence's tokens are those it gets alone, in chunked mixed batches
    driver = LocalDriver(runner, max_num_batched_tokens=8)
    ids = [driver.add(p, 12, arrival_step=i) for i, p in enumerate(PROMPTS)]
    together = driver.run()
    for i, p in zip(ids, PROMPTS):
        runner.reset()
        alone = LocalDriver(runner, max_num_batched_tokens=64)
        request = alone.add(p, 12)
        assert alone.run()[request][0] == together[i][0]


def test_int8_activations_are_refused_by_name_where_no_weight_is_kept_quantised(smollm2_dir):
    with pytest.raises(StartupError, match="--activation-dtype int8: no weight is kept quantised") as e:
        load_model(smollm2_dir, dtype="float32", weight_dtype="float32", activation_dtype="int8")
    assert e.value.exit_code == USAGE
    with pytest.raises(ValueError, match="--activation-dtype must be one of auto, int8"):
        load_model(smollm2_dir, dtype="float32", activation_dtype="int4")
