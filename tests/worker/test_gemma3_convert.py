"""Gemma 3 270M's GGUF (Q4_K / Q6_K / Q5_0 / Q8_0 blocks) converts to a Hugging Face gemma3_text dir: the config
Gemma 3 needs (alternating sliding and full layers, a rope base per layer type), every quantised block kept and
dequantising bit for bit to the saved float weight, and Gemma's SentencePiece tokenizer with BOS as the file says."""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path

import gguf
import pytest
import torch

from tests.support.gemma3 import gemma3_gguf

pytestmark = pytest.mark.slow

TEXTS = ["The capital of France is", "hello world", " Hello  there\n\nfriend", "naïve café 日本語 🙂",
         "def f(x):\n    return x ** 2\n", "<start_of_turn>user\nhi<end_of_turn>\n"]


def test_config_is_gemma3_text_with_a_sliding_window_and_a_rope_base_per_layer_type(gemma3_dir):
    from transformers import AutoConfig

    raw = json.loads((Path(gemma3_dir) / "config.json").read_text())
    assert raw["model_type"] == "gemma3_text" and raw["architectures"] == ["Gemma3ForCausalLM"]
    # older readers' keys: the full layers' base and the sliding layers'
    assert raw["rope_theta"] == 1e6 and raw["rope_local_base_freq"] == 1e4
    config = AutoConfig.from_pretrained(gemma3_dir)
    assert config.num_hidden_layers == 18 and config.hidden_size == 640 and config.intermediate_size == 2048
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (4, 1, 256)
    # every sixth layer attends to everything, the others to the last 512 positions
    assert config.layer_types == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    assert config.sliding_window == 512
    assert config.rope_parameters["full_attention"]["rope_theta"] == 1e6
    assert config.rope_parameters["sliding_attention"]["rope_theta"] == 1e4
    assert config.query_pre_attn_scalar == 256
    assert config.hidden_activation == "gelu_pytorch_tanh"
    assert config.final_logit_softcapping is None and config.attn_logit_softcapping is None
    assert config.tie_word_embeddings and config.vocab_size == 262144
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (2, 1, 0)


def test_every_quantised_block_is_kept_and_dequantises_to_the_saved_float_weight(gemma3_dir):
    from safetensors import safe_open

    from worker_svc.quant.from_gguf import bit_equal
    from worker_svc.quant.store import load_quantized

    quantized = load_quantized(Path(gemma3_dir))
    # the file's 2-D weights: Q5_0 q/k/gate/up, Q4_K and Q6_K o/down (llama.cpp's Q4_K_M mix), Q8_0 v and embedding
    assert Counter(w.format.name for w in quantized.values()) == {"q5_0": 81, "q4_k": 27, "q8_0": 10, "q6_k": 9}
    assert len(quantized) == 18 * 7 + 1 and quantized["model.embed_tokens.weight"].format.name == "q8_0"
    with safe_open(str(Path(gemma3_dir) / "model.safetensors"), "pt") as f:
        for name, weight in quantized.items():
            saved = f.get_tensor(name)
            assert bit_equal(weight.dequantize().to(saved.dtype), saved), name


def test_transformers_loads_it_as_gemma3_for_causal_lm_with_tied_embeddings(gemma3_dir):
    from transformers import AutoModelForCausalLM, Gemma3ForCausalLM

    model = AutoModelForCausalLM.from_pretrained(gemma3_dir, dtype=torch.float32)
    assert type(model) is Gemma3ForCausalLM
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    # GGUF stores Gemma's norms as 1 + weight (q/k norms too); the loader takes the 1 off (Gemma3RMSNorm adds it)
    tensors = {t.name: t for t in gguf.GGUFReader(str(gemma3_gguf())).tensors}
    for gguf_name, param in [("output_norm.weight", model.model.norm.weight),
                             ("blk.0.attn_q_norm.weight", model.model.layers[0].self_attn.q_norm.weight),
                             ("blk.17.post_ffw_norm.weight", model.model.layers[17].post_feedforward_layernorm.weight)]:
        assert torch.equal(param, torch.from_numpy(tensors[gguf_name].data.copy()) - 1), gguf_name


def test_tokenizer_is_gemmas_and_puts_bos_first_as_the_file_says(gemma3_dir):
    from transformers import AutoTokenizer

    from scheduler_svc.frontend.tokenizer import Tokenizer

    tcfg = json.loads((Path(gemma3_dir) / "tokenizer_config.json").read_text())
    assert tcfg["tokenizer_class"] == "GemmaTokenizer"
    assert tcfg["add_bos_token"] is True and tcfg["add_eos_token"] is False  # tokenizer.ggml.add_bos/eos_token
    tok = AutoTokenizer.from_pretrained(gemma3_dir)
    ours = Tokenizer.from_model_dir(gemma3_dir)  # the scheduler's own tokenizer over the same files
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (2, 1, 0)
    assert ours.eos_token_ids == (1,)
    # SentencePiece pieces ('▁' for a space), not byte-level BPE: Gemma 3's own ids for this text
    assert tok("The capital of France is")["input_ids"] == [2, 818, 5279, 529, 7001, 563]
    for text in TEXTS:
        ids = tok(text)["input_ids"]
        assert ids[0] == 2 and 2 not in ids[1:], text
        assert ours.encode(text) == ids, text
        assert ours.encode(text, add_special_tokens=False) == ids[1:], text
        assert tok.decode(ids[1:]) == text and ours.decode(ids[1:], skip_special_tokens=False) == text, text
    assert tok("<start_of_turn>")["input_ids"] == [2, 105]  # Gemma's turn markers stay one token each
    # the vocabulary is the file's, id for id
    fields = gguf.GGUFReader(str(gemma3_gguf())).fields
    tokens = fields["tokenizer.ggml.tokens"]
    file_tokens = [bytes(tokens.parts[i]).decode() for i in tokens.data]
    assert len(file_tokens) == 262144
    for i in (0, 1, 2, 3, 105, 106, 818, 5279, 100000, 262143):
        assert tok.convert_ids_to_tokens(i) == file_tokens[i], i
