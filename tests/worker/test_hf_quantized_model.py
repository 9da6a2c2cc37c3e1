"""SmolLM2-135M served from Hugging Face GPTQ, AWQ and compressed-tensors checkpoints of itself
(tests.support.hf_quant: RTN quants in the formats' documented packing) without dequantising: every quantised
Linear is held as GGML blocks, each weight exactly the checkpoint's s * (q - z), so in float32 the logits are, bit
for bit, those of the float model holding those weights (worker_svc/quant/int_groups.py), and its greedy tokens are
transformers' generate's on that model."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from pagedserve_cli.bench.local_driver import LocalDriver
from pagedserve_common.startup import StartupError
from tests.support.hf_quant import write_checkpoint
from tests.support.worker import (assert_same_greedy, prefill_then_decode_logits, reference_greedy, reference_model,
                                  runner_for)
from worker_svc.models import load_model
from worker_svc.quant.kernel import shared_kernel

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(shared_kernel() is None, reason="no quantised kernel on this CPU (AVX2+FMA+F16C)")]
# name: (method, bits, group, sym, gptq_v2, activations), the worker's weights_reason (its last word: the blocks)
CHECKPOINTS = {
    "gptq-sym": (("gptq", 4, 128, True, False, False), "auto: as stored (GPTQ 4-bit sym, group 128 as 210 q4_0)"),
    "gptq-asym-v2": (("gptq", 4, 32, False, True, False), "auto: as stored (GPTQ 4-bit asym, group 32 as 210 q5_0)"),
    "gptq-8bit": (("gptq", 8, 64, True, False, False), "auto: as stored (GPTQ 8-bit sym, group 64 as 210 q8_0)"),
    "awq": (("awq", 4, 128, False, False, False), "auto: as stored (AWQ 4-bit asym, group 128 as 210 q5_0)"),
    "ct-w4a16": (("compressed-tensors", 4, 64, False, False, False),
                 "auto: as stored (compressed-tensors W4A16 asym, group 64 as 210 q5_0)"),
    "ct-w8a8": (("compressed-tensors", 8, -1, True, False, True),
                "auto: as stored (compressed-tensors W8A8 (its per-token int8 activations not applied) sym, per "
                "channel as 210 q8_0)"),
}


@pytest.fixture(scope="module")
def checkpoints(smollm2_dir, tmp_path_factory):
    """name -> the dir holding `quantised` (the checkpoint) and `float` (its weights dequantised), written once."""
    made = {}

    def get(name: str):
        if name not in made:
            made[name] = write_checkpoint(smollm2_dir, tmp_path_factory.mktemp(name), *CHECKPOINTS[name][0])
        return made[name]
    return get


@pytest.fixture(scope="module")
def runners(checkpoints):
    """name -> a runner (float32, --weight-dtype as-stored) over the checkpoint, built once."""
    made = {}

    def get(name: str):
        if name not in made:
            made[name] = runner_for(str(checkpoints(name) / "quantised"), "as-stored")
        return made[name]
    return get


@pytest.mark.parametrize("name", CHECKPOINTS)
def test_weights_stay_quantised_in_their_blocks(checkpoints, name):
    root = checkpoints(name)
    loaded = load_model(root / "quantised", dtype="float32", weight_dtype="as-stored")
    assert loaded.weights_reason.replace("as-stored", "auto") == CHECKPOINTS[name][1]
    assert loaded.model.model.layers[0].mlp.down_proj.weight.is_meta  # never allocated as floats
    fmt = CHECKPOINTS[name][1].rsplit(" ", 1)[1].rstrip(")")
    assert {w.format.name for w in loaded.quantized.values()} == {fmt}
    layer_weights = 576 * (576 + 192 + 192 + 576) + 3 * 576 * 1536  # q, k, v, o; gate, up, down
    held = sum(w.blocks.numel() for w in loaded.quantized.values())
    assert held == 30 * layer_weights // 32 * {"q4_0": 18, "q5_0": 22, "q8_0": 34}[fmt]  # bytes a 32-weight block
    # each is the checkpoint's weight s * (q - z), exactly
    reference = load_file(str(root / "float" / "model.safetensors"))
    for param, w in loaded.quantized.items():
        assert torch.equal(w.dequantize(), reference[param]), param


# Each block format, Q5_0 from two checkpoint kinds (every checkpoint's weights are its reference's exactly, above):
# the kernel over them computes the float model's bits
@pytest.mark.parametrize("name", ["gptq-sym", "awq", "ct-w4a16", "gptq-8bit"])  # q4_0, q5_0, q5_0, q8_0
def test_float32_logits_are_the_dequantised_models_bit_for_bit(checkpoints, runners, name):
    reference = runner_for(str(checkpoints(name) / "float"), "auto")
    assert not reference.loaded.quantized
    logits = prefill_then_decode_logits(runners(name), 16, 24), prefill_then_decode_logits(reference, 16, 24)
    assert torch.equal(*logits)


def test_greedy_tokens_are_transformers_generate_on_the_dequantised_model(checkpoints, runners):
    root = checkpoints("gptq-sym")
    prompt = [504, 3575, 282, 4649, 314]
    runner = runners("gptq-sym")
    runner.reset()
    driver = LocalDriver(runner, max_num_batched_tokens=64)
    request = driver.add(prompt, 12)
    got = driver.run()[request][0]
    assert_same_greedy(got, *reference_greedy(reference_model(str(root / "float")), prompt, 12))


def test_a_float_weight_dtype_dequantises_to_the_checkpoints_weights(checkpoints):
    root = checkpoints("awq")
    loaded = load_model(root / "quantised", dtype="float32", weight_dtype="float32")
    assert not loaded.quantized
    assert loaded.weights_reason == \
        "--weight-dtype float32: AWQ 4-bit asym, group 128 as 210 q5_0 dequantised to float32"
    state = loaded.model.state_dict()
    for name, want in load_file(str(root / "float" / "model.safetensors")).items():
        assert torch.equal(state[name], want), name
    with pytest.raises(StartupError, match=r"--weight-dtype as-stored: the quantised weights \(AWQ 4-bit asym"):
        load_model(root / "quantised", dtype="float32", weight_dtype="as-stored", lean=False)
