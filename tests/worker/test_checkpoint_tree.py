"""A model kept quantised loads without transformers (checkpoint_tree.py, resolved_config.py): its rotary embedding is
transformers' bit for bit, the worker process never imports transformers nor keeps the file's blocks resident once
packed, and a checkpoint missing a weight or holding one of another shape is refused naming it. (Its logits against the dequantised model: test_quantized_model.py, test_gemma3.py.)"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from transformers import AutoConfig, LlamaConfig

from worker_svc.checkpoint_tree import RotaryEmbedding, checkpoint_tree, static_rope
from worker_svc.resolved_config import resolved_config

ROOT = Path(__file__).resolve().parents[2]
POSITIONS = torch.tensor([[0, 1, 7, 511, 4095, 30000]])


def llama_config(**rope) -> LlamaConfig:
    return LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2,
                       intermediate_size=512, vocab_size=128, max_position_embeddings=8192, rope_parameters=rope)


@pytest.mark.parametrize("rope", [{"rope_type": "default", "rope_theta": 100000.0},
                                  {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
                                  {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 8192}])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_rotary_embedding_is_llamas_bit_for_bit(rope, dtype):
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    config = llama_config(**rope)
    x = torch.zeros(1, 1, dtype=dtype)
    for got, want in zip(RotaryEmbedding(config)(x, POSITIONS), LlamaRotaryEmbedding(config)(x, POSITIONS)):
        assert got.dtype == dtype and torch.equal(got, want)


def test_the_rotary_embedding_is_gemma3s_bit_for_bit_for_each_layer_type(gemma3_dir):
    from transformers.models.gemma3.modeling_gemma3 import Gemma3RotaryEmbedding

    config = AutoConfig.from_pretrained(gemma3_dir)
    x = torch.zeros(1, 1)
    ours, theirs = RotaryEmbedding(config), Gemma3RotaryEmbedding(config)
    for layer_type in ("sliding_attention", "full_attention"):
        for got, want in zip(ours(x, POSITIONS, layer_type), theirs(x, POSITIONS, layer_type)):
            assert torch.equal(got, want)
    sliding, full = ours(x, POSITIONS, "sliding_attention")[0], ours(x, POSITIONS, "full_attention")[0]
    assert not torch.equal(sliding, full)  # two bases: a table per layer type


def test_a_rope_whose_frequencies_move_with_the_sequence_has_no_tree():
    assert static_rope(llama_config(rope_type="default", rope_theta=1e4))
    assert not static_rope(llama_config(rope_type="dynamic", rope_theta=1e4, factor=2.0))


def tiny_llama_tensors() -> dict[str, torch.Tensor]:
    """Every weight of llama_config's 2-layer model, by its checkpoint name."""
    tensors = {"model.embed_tokens.weight": torch.zeros(128, 256), "model.norm.weight": torch.ones(256),
               "lm_head.weight": torch.zeros(128, 256)}
    for i in range(2):
        for name, shape in [("self_attn.q_proj", (256, 256)), ("self_attn.k_proj", (128, 256)),
                            ("self_attn.v_proj", (128, 256)), ("self_attn.o_proj", (256, 256)),
                            ("mlp.gate_proj", (512, 256)), ("mlp.up_proj", (512, 256)),
                            ("mlp.down_proj", (256, 512)), ("input_layernorm", (256,)),
                            ("post_attention_layernorm", (256,))]:
            tensors[f"model.layers.{i}.{name}.weight"] = torch.zeros(shape)
    return tensors


def test_a_checkpoint_missing_a_projection_is_refused_naming_it(tmp_path):
    from safetensors.torch import save_file

    config = llama_config(rope_type="default", rope_theta=1e4)
    tensors = tiny_llama_tensors()
    save_file(tensors, str(tmp_path / "model.safetensors"))
    tree = checkpoint_tree(tmp_path, config, torch.float32, {}, [tmp_path / "model.safetensors"])
    assert tree.model.layers[1].self_attn.k_proj.weight.shape == (128, 256)
    assert tree.model.layers[0].self_attn.scaling == 64 ** -0.5
    del tensors["model.layers.1.mlp.up_proj.weight"]
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"no weights for model\.layers\.1\.mlp\.up_proj\.weight"):
        checkpoint_tree(tmp_path, config, torch.float32, {}, [tmp_path / "model.safetensors"])


# A worker's runner over the default model (its GGUF's blocks kept, float32) and one prefill step; prints whether
# transformers' modeling code was imported.
RUNNER = textwrap.dedent("""
    import json, sys
    from pagedserve_common.sampling import SamplingParams
    from pagedserve_common.step import NewSequence, StepPlan
    from worker_svc.worker import WorkerConfig, create_runner
    runner, _ = create_runner(WorkerConfig(model="smollm2-135m-instruct", dtype="float32", threads=1,
                                           kv_memory=16 << 20, weight_dtype=sys.argv[1]))
    runner.step(StepPlan(0, new_seqs=[NewSequence(0, list(range(100, 117)), [0, 1], 0, 17,
                                                  SamplingParams(temperature=0.0))]))
    resident, mapping = 0, False  # kB of quantized.safetensors resident (its mappings' Rss)
    for line in open("/proc/self/smaps"):
        if line[0] in "0123456789abcdef" and " " in line and "-" in line.split()[0]:
            mapping = line.rstrip().endswith("/quantized.safetensors")
        elif mapping and line.startswith("Rss:"):
            resident += int(line.split()[1])
    print(json.dumps({"quantized": runner.loaded.runs_quantized, "file_kb": resident,
                      "modeling": "transformers.modeling_utils" in sys.modules,
                      "transformers": "transformers" in sys.modules}))
""")


@pytest.mark.parametrize("weight_dtype", ["auto", "float32"])
def test_only_a_model_of_float_weights_imports_transformers(weight_dtype):
    out = subprocess.run([sys.executable, "-c", RUNNER, weight_dtype], cwd=ROOT, capture_output=True, text=True,
                         timeout=600, check=True)
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got.pop("file_kb") < 4096, got  # packed, the file's blocks went; the embedding's rows looked up only
    float32 = weight_dtype == "float32"  # transformers' modules; the blocks' path reads resolved_config.json instead
    assert got == {"quantized": not float32, "modeling": float32, "transformers": float32}


def test_a_weight_of_another_shape_than_the_configs_is_refused_naming_it(tmp_path):
    from safetensors.torch import save_file

    config = llama_config(rope_type="default", rope_theta=1e4)
    tensors = tiny_llama_tensors()
    tensors["model.layers.0.self_attn.k_proj.weight"] = torch.zeros(256, 256)  # 4 kv heads' rows: config says 2
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.k_proj\.weight is \[256, 256\]; config\.json "
                                         r"makes it \[128, 256\]"):
        checkpoint_tree(tmp_path, config, torch.float32, {}, [tmp_path / "model.safetensors"])


def test_the_resolved_config_holds_what_transformers_reads_from_the_converted_dir(smollm2_dir, gemma3_dir):
    for model_dir in (smollm2_dir, gemma3_dir):
        resolved = resolved_config(Path(model_dir))
        want = AutoConfig.from_pretrained(model_dir)
        values = {k: v for k, v in want.to_dict().items() if k != "_name_or_path"}
        assert resolved is not None and resolved.to_dict() == json.loads(json.dumps(values))
        for name in ("num_hidden_layers", "rms_norm_eps", "rope_parameters", "tie_word_embeddings", "model_type"):
            assert getattr(resolved, name) == getattr(want, name), name
        assert getattr(resolved, "no_such_field", 7) == 7
