"""worker_svc.quant.from_gguf and .store: a GGUF file's quantised weights kept, raw, at conversion (a tiny quantised
GGUF made here: offline and cheap; the real default model's in tests/models/test_gguf_quantized.py), the rope row
permutation on blocks, the check against the float weights, and load_quantized's checks of a dir's files."""

import json
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

from tests.support.quant_blocks import random_blocks
from tests.support.tiny_gguf import LAYERS, write_tiny_gguf
from worker_svc import model_store
from worker_svc.quant import FORMATS, QuantWeight, dequantize
from worker_svc.quant import from_gguf
from worker_svc.quant.from_gguf import bit_equal, check_against_floats, reverse_rope_rows
from worker_svc.quant.store import QUANTIZATION_JSON, QUANTIZED_FILE, load_quantized, save_quantized

HIDDEN, HEADS, KV_HEADS, INTER = 32, 2, 1, 256
# every block format in the tiny file: the layers' projections (ffn_down's rows, INTER long, fit a K-quant's 256)
TINY_FORMATS = {"token_embd": "q8_0", "attn_q": "q4_0", "attn_k": "q4_1", "attn_v": "q5_0", "attn_output": "q4_1",
                "ffn_gate": "q4_0", "ffn_up": "q8_0", "blk.0.ffn_down": "q4_k", "blk.1.ffn_down": "q6_k"}
HF_PROJECTIONS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                  "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                  "ffn_down": "mlp.down_proj"}  # this test's own table, to check the derived names against


@pytest.fixture(scope="module")
def tiny_quantized_gguf(tmp_path_factory) -> Path:
    return write_tiny_gguf(tmp_path_factory.mktemp("gguf") / "tiny-q.gguf", hidden=HIDDEN, heads=HEADS,
                           kv_heads=KV_HEADS, inter=INTER, formats=TINY_FORMATS)


@pytest.fixture(scope="module")
def converted(tiny_quantized_gguf, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("converted") / "model"
    model_store.convert_gguf(tiny_quantized_gguf, out, model_store.TensorProgress(bar=False))
    return out


def file_blocks(gguf_path: Path) -> dict[str, np.ndarray]:
    return {t.name: np.array(t.data) for t in gguf.GGUFReader(str(gguf_path)).tensors}


def test_conversion_keeps_every_block_quantised_weight_under_its_parameter_name(converted, tiny_quantized_gguf):
    index = json.loads((converted / QUANTIZATION_JSON).read_text())
    want = {"model.embed_tokens.weight": {"format": "q8_0", "shape": [261, HIDDEN]}}
    head_dim = HIDDEN // HEADS
    outs = {"attn_q": HIDDEN, "attn_k": KV_HEADS * head_dim, "attn_v": KV_HEADS * head_dim, "attn_output": HIDDEN,
            "ffn_gate": INTER, "ffn_up": INTER, "ffn_down": HIDDEN}
    for i in range(LAYERS):
        for kind, hf in HF_PROJECTIONS.items():
            fmt = TINY_FORMATS.get(f"blk.{i}.{kind}", TINY_FORMATS.get(kind))
            want[f"model.layers.{i}.{hf}.weight"] = {
                "format": fmt, "shape": [outs[kind], INTER if kind == "ffn_down" else HIDDEN]}
    assert index == {"source": "gguf", "tensors": want}
    assert json.loads((converted / model_store.MARKER).read_text())["format"] == model_store.MODEL_DIR_FORMAT

    floats = load_file(converted / "model.safetensors")
    weights = load_quantized(converted)
    assert set(weights) == set(want)
    for name, weight in weights.items():
        assert bit_equal(weight.dequantize().to(floats[name].dtype), floats[name]), name

    # v's rows are as stored; q's and k's are rope's permutation undone (their files' rows differ: random blocks)
    stored = file_blocks(tiny_quantized_gguf)
    attn = "model.layers.0.self_attn"
    assert torch.equal(weights[f"{attn}.v_proj.weight"].blocks, torch.from_numpy(stored["blk.0.attn_v.weight"]))
    for kind, proj, num_heads in (("attn_q", "q_proj", HEADS), ("attn_k", "k_proj", KV_HEADS)):
        raw = stored[f"blk.0.{kind}.weight"]
        assert torch.equal(weights[f"{attn}.{proj}.weight"].blocks,
                           torch.from_numpy(raw[reverse_rope_rows(len(raw), num_heads)]))
        assert not torch.equal(weights[f"{attn}.{proj}.weight"].blocks, torch.from_numpy(raw))


@pytest.mark.parametrize("num_heads, num_kv_heads", [(4, 4), (4, 2), (3, 1)])
@pytest.mark.parametrize("name", FORMATS)
def test_permuting_block_rows_then_dequantizing_is_dequantizing_then_permuting(name, num_heads, num_kv_heads):
    """The rope rows undone on blocks == transformers' LlamaTensorProcessor undoing them on the float weight."""
    fmt, head_dim = FORMATS[name], 8
    processor = LlamaTensorProcessor(config={"num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads})
    rng = np.random.default_rng(3)
    for kind, heads in (("attn_q", num_heads), ("attn_k", num_kv_heads)):
        blocks = random_blocks(rng, fmt, heads * head_dim, fmt.block_size * 2)
        tensor_name = f"blk.0.{kind}.weight"
        assert from_gguf.rope_heads("llama", tensor_name, processor.config) == heads
        floats_permuted = processor.process(weights=dequantize(blocks, fmt), name=tensor_name).weights
        mine = dequantize(blocks[reverse_rope_rows(len(blocks), heads)], fmt)
        np.testing.assert_array_equal(mine.view(np.uint32), floats_permuted.view(np.uint32))


def test_rope_rows_are_permuted_only_for_llamas_q_and_k_with_both_head_counts():
    config = {"num_attention_heads": 9, "num_key_value_heads": 3}
    assert [from_gguf.rope_heads("llama", f"blk.3.{kind}.weight", config) for kind in
            ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_up")] == [9, 3, None, None, None]
    assert from_gguf.rope_heads("qwen2", "blk.3.attn_q.weight", config) is None
    assert from_gguf.rope_heads("llama", "blk.3.attn_q.weight", {"num_attention_heads": 9}) is None
    assert reverse_rope_rows(8, 2).tolist() == [0, 2, 1, 3, 4, 6, 5, 7]
    with pytest.raises(ValueError, match="6 rows are not 4 heads of an even size"):
        reverse_rope_rows(6, 4)


def test_an_architecture_whose_tensors_transformers_reshapes_keeps_no_quantized_weights(tiny_quantized_gguf,
                                                                                          monkeypatch):
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(tiny_quantized_gguf.parent, gguf_file=tiny_quantized_gguf.name)
    model = AutoModelForCausalLM.from_config(config)
    gguf_config = {"num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS}
    assert len(from_gguf.quantized_weights(tiny_quantized_gguf, model, gguf_config)) == 1 + 7 * LAYERS
    monkeypatch.setattr(from_gguf, "ROW_ORDER_ARCHS", set())  # llama as if its processor did more than reorder
    assert from_gguf.quantized_weights(tiny_quantized_gguf, model, gguf_config) == {}


def test_blocks_that_do_not_dequantize_to_the_float_weight_fail_the_conversion_naming_it(tiny_quantized_gguf,
                                                                                          tmp_path, monkeypatch):
    monkeypatch.setattr(from_gguf, "reverse_rope_rows", lambda num_rows, num_heads: np.arange(num_rows))
    with pytest.raises(RuntimeError, match=r"quantised weight model\.layers\.0\.self_attn\.q_proj\.weight \(q4_0 "
                                           r"\[32, 32\]\) does not dequantise to its float weight"):
        model_store.convert_gguf(tiny_quantized_gguf, tmp_path / "model", model_store.TensorProgress(bar=False))
    assert not (tmp_path / "model" / model_store.MARKER).exists()


def q8_weight(values: torch.Tensor) -> QuantWeight:
    """Q8_0 blocks of one row of 32 integers (|v| < 128) and scale d."""
    blocks = np.zeros((1, 34), np.uint8)
    blocks[0, 0:2] = np.array([0.25], "<f2").view(np.uint8)
    blocks[0, 2:] = values.to(torch.int8).numpy().view(np.uint8)
    return QuantWeight(FORMATS["q8_0"], (1, 32), torch.from_numpy(blocks))


def test_the_check_compares_in_the_dtype_the_float_weights_are_saved_in():
    values = torch.arange(-16, 16)
    weight = q8_weight(values)
    floats = (values * 0.25).to(torch.bfloat16).reshape(1, 32)
    check_against_floats({"w": weight}, {"w": floats})
    floats[0, 5] = -floats[0, 5]
    with pytest.raises(RuntimeError, match=r"quantised weight w \(q8_0 \[1, 32\]\) does not dequantise to its float "
                                           r"weight \(torch.bfloat16 \[1, 32\]\)"):
        check_against_floats({"w": weight}, {"w": floats})
    with pytest.raises(RuntimeError, match="quantised weight w has no float weight of that name"):
        check_against_floats({"w": weight}, {"v": floats})


def test_bit_equal_tells_signed_zeros_apart():
    assert bit_equal(torch.tensor([0.0, 1.0]), torch.tensor([0.0, 1.0]))
    assert not bit_equal(torch.tensor([0.0]), torch.tensor([-0.0]))
    assert not bit_equal(torch.tensor([1.0]), torch.tensor([1.0], dtype=torch.float64))
    assert bit_equal(torch.tensor([float("nan")]), torch.tensor([float("nan")]))


# --- load_quantized: a dir's files checked (the dir may be the user's) ---

@pytest.fixture
def stored(tmp_path) -> Path:
    rng = np.random.default_rng(5)
    weights = {name: QuantWeight(FORMATS[fmt], (3, 64), torch.from_numpy(random_blocks(rng, FORMATS[fmt], 3, 64)))
               for name, fmt in (("a.weight", "q4_0"), ("b.weight", "q8_0"))}
    save_quantized(tmp_path, weights, source="gguf")
    return tmp_path


def edit_index(model_dir: Path, name: str, **entry) -> None:
    index = json.loads((model_dir / QUANTIZATION_JSON).read_text())
    index["tensors"][name] = {**index["tensors"].get(name, {}), **entry}
    (model_dir / QUANTIZATION_JSON).write_text(json.dumps(index))


def test_load_quantized_reads_back_what_was_saved(stored):
    weights = load_quantized(stored)
    assert {n: (w.format.name, w.shape, tuple(w.blocks.shape)) for n, w in weights.items()} == {
        "a.weight": ("q4_0", (3, 64), (3, 36)), "b.weight": ("q8_0", (3, 64), (3, 68))}
    assert torch.equal(weights["b.weight"].blocks, load_file(stored / QUANTIZED_FILE)["b.weight"])


def test_a_dir_without_quantized_weights_has_none(tmp_path):
    assert load_quantized(tmp_path) == {}
    save_quantized(tmp_path, {}, source="gguf")
    assert load_quantized(tmp_path) == {}


@pytest.mark.parametrize("edit, message", [
    (dict(format="q5_1"), r"tensor 'a.weight': format 'q5_1' is not one of q4_0, q4_1, q5_0, q8_0, q4_k, q6_k"),
    (dict(format=None), r"tensor 'a.weight': format None is not one of"),
    (dict(format=["q4_0"]), r"tensor 'a.weight': format \['q4_0'\] is not one of"),
    (dict(shape=[3]), r"tensor 'a.weight': shape \[3\] is not two positive sizes \[out, in\]"),
    (dict(shape=[3, "64"]), r"tensor 'a.weight': shape \[3, '64'\] is not two positive sizes"),
    (dict(shape=[3, 48]), r"tensor 'a.weight': shape \[3, 48\]: a row of 48 weights is not a whole number of q4_0 "
                          r"blocks"),
    (dict(shape=[4, 64]), r"tensor 'a.weight': blocks are torch.uint8 \[3, 36\]; shape \[4, 64\] in q4_0 takes uint8 "
                          r"\[4, 36\]"),
    (dict(shape=[3, 128]), r"tensor 'a.weight': blocks are torch.uint8 \[3, 36\]; shape \[3, 128\] in q4_0 takes"),
    (dict(format="q8_0"), r"tensor 'a.weight': blocks are torch.uint8 \[3, 36\]; shape \[3, 64\] in q8_0 takes uint8 "
                          r"\[3, 68\]"),
])
def test_an_entry_that_disagrees_with_its_tensor_is_a_value_error_naming_both(stored, edit, message):
    edit_index(stored, "a.weight", **edit)
    with pytest.raises(ValueError, match=f"^{stored / QUANTIZATION_JSON}: {message}"):
        load_quantized(stored)


def test_tensors_and_entries_must_pair_up(stored):
    blocks = load_file(stored / QUANTIZED_FILE)
    save_file({**blocks, "c.weight": blocks["a.weight"].clone()}, stored / QUANTIZED_FILE)
    with pytest.raises(ValueError, match=rf"{QUANTIZED_FILE}: tensor 'c.weight' has no entry in {QUANTIZATION_JSON}"):
        load_quantized(stored)
    save_file({"a.weight": blocks["a.weight"]}, stored / QUANTIZED_FILE)
    with pytest.raises(ValueError, match=rf"tensor 'b.weight': not in {QUANTIZED_FILE}"):
        load_quantized(stored)
    save_file({**blocks, "a.weight": blocks["a.weight"].to(torch.int8)}, stored / QUANTIZED_FILE)
    with pytest.raises(ValueError, match=r"tensor 'a.weight': blocks are torch.int8 \[3, 36\]"):
        load_quantized(stored)
    (stored / QUANTIZED_FILE).write_bytes(b"not safetensors")
    with pytest.raises(ValueError, match=rf"{QUANTIZED_FILE}: not a safetensors file"):
        load_quantized(stored)
    (stored / QUANTIZED_FILE).unlink()
    with pytest.raises(ValueError, match=rf"lists 2 tensors, but there is no {QUANTIZED_FILE}"):
        load_quantized(stored)


@pytest.mark.parametrize("text, message", [
    ("{", "not JSON"), ("[]", 'no "tensors" object'), ('{"tensors": []}', 'no "tensors" object'),
    ('{"tensors": {"a.weight": 3}}', "tensor 'a.weight': its entry is not an object"),
])
def test_an_index_that_is_not_an_index_is_a_value_error(stored, text, message):
    (stored / QUANTIZATION_JSON).write_text(text)
    with pytest.raises(ValueError, match=message):
        load_quantized(stored)


@pytest.mark.parametrize("arch", sorted(from_gguf.AS_STORED_ARCHS))
def test_an_as_stored_architectures_processor_leaves_every_2d_weight_as_the_file_stores_it(arch):
    """Why gemma3's blocks are kept without any reordering: transformers' processor for it changes only the 1-D norm
    weights (GGUF stores Gemma's as 1 + w), never a matrix (a transformers that did would fail this first)."""
    from transformers.modeling_gguf_pytorch_utils import TENSOR_PROCESSORS

    processor = TENSOR_PROCESSORS[arch]()
    matrix = np.arange(12, dtype=np.float32).reshape(3, 4)
    for name in ("blk.0.attn_q.weight", "blk.0.attn_k.weight", "blk.0.ffn_down.weight", "token_embd.weight"):
        out = processor.process(matrix.copy(), name)
        assert np.array_equal(out.weights, matrix) and out.name == name, name
    norm = processor.process(np.ones(4, dtype=np.float32), "blk.0.attn_q_norm.weight")
    assert np.array_equal(norm.weights, np.zeros(4, dtype=np.float32))
