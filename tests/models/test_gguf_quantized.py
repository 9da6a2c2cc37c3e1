"""The default model (SmolLM2-135M-Instruct, its GGUF in Q4_1) as model_store converts it: its block-quantised weights
kept raw beside the float ones (worker_svc.quant.store), each dequantising bit for bit to its float weight."""

import json
from collections import Counter

import pytest
from safetensors.torch import load_file

from worker_svc.model_store import MARKER, MODEL_DIR_FORMAT
from worker_svc.quant.from_gguf import bit_equal
from worker_svc.quant.store import QUANTIZATION_JSON, load_quantized

NUM_LAYERS, HIDDEN, INTERMEDIATE, KV_ROWS, VOCAB = 30, 576, 1536, 3 * 64, 49152
SHAPES = {"self_attn.q_proj": (HIDDEN, HIDDEN), "self_attn.k_proj": (KV_ROWS, HIDDEN),
          "self_attn.v_proj": (KV_ROWS, HIDDEN), "self_attn.o_proj": (HIDDEN, HIDDEN),
          "mlp.gate_proj": (INTERMEDIATE, HIDDEN), "mlp.up_proj": (INTERMEDIATE, HIDDEN),
          "mlp.down_proj": (HIDDEN, INTERMEDIATE)}


@pytest.fixture(scope="module")
def quantized(default_model):
    return load_quantized(default_model)


def test_the_default_models_211_quantized_weights_are_kept_in_their_formats(default_model, quantized):
    assert json.loads((default_model / MARKER).read_text())["format"] == MODEL_DIR_FORMAT
    assert json.loads((default_model / QUANTIZATION_JSON).read_text())["source"] == "gguf"
    want = {"model.embed_tokens.weight": ("q8_0", (VOCAB, HIDDEN))}  # tied: the lm_head is the embedding
    for i in range(NUM_LAYERS):
        want.update({f"model.layers.{i}.{proj}.weight": ("q4_1", shape) for proj, shape in SHAPES.items()})
    assert {name: (w.format.name, w.shape) for name, w in quantized.items()} == want
    assert len(quantized) == 211 and Counter(w.format.name for w in quantized.values()) == {"q4_1": 210, "q8_0": 1}
    embedding = quantized["model.embed_tokens.weight"]
    assert tuple(embedding.blocks.shape) == (VOCAB, HIDDEN // 32 * 34) and embedding.blocks.is_contiguous()


def test_every_quantized_weight_dequantizes_to_its_float_weight_bit_for_bit(default_model, quantized):
    floats = load_file(default_model / "model.safetensors")
    # the norms (F32 in the file) are only float; every projection and the embedding also quantised
    assert set(floats) - set(quantized) == {"model.norm.weight", *(
        f"model.layers.{i}.{norm}.weight" for i in range(NUM_LAYERS)
        for norm in ("input_layernorm", "post_attention_layernorm"))}
    mismatched = [name for name, w in quantized.items() if not bit_equal(w.dequantize().to(floats[name].dtype),
                                                                           floats[name])]
    assert mismatched == []
