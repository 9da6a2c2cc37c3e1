"""Hugging Face GPTQ / AWQ tensors read into GGML blocks (worker_svc/quant/from_hf.py, int_groups.py): the bit
layouts checked on hand-written words; the blocks dequantise (gguf-py, the independent reference) to the checkpoint's
own s * (q - z) exactly; the quantised kernel on them is within float32's derived bound of a float64 matmul of that
weight, on every CPU path; every field that would change the weights and is not read is refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from safetensors.torch import save_file

from tests.support.hf_quant import pack, pack_compressed, q8_0_blocks, quantization_config, rtn
from worker_svc import cpu_path
from worker_svc.cpu_build import load_library
from worker_svc.cpu_features import cpu_flags
from worker_svc.quant.from_hf import load_hf_quantized
from worker_svc.quant.int_groups import IntGroups, to_blocks
from worker_svc.quant.kernel import QuantKernel, shared_kernel

GGML = {"q4_0": GGMLQuantizationType.Q4_0, "q5_0": GGMLQuantizationType.Q5_0, "q8_0": GGMLQuantizationType.Q8_0}
U32 = 2.0 ** -24


def write_dir(path, tensors: dict[str, torch.Tensor], qc: dict):
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "model.safetensors"))
    config = {"model_type": "llama", "quantization_config": qc}
    (path / "config.json").write_text(json.dumps(config))
    return path, config


def hand_gptq(tmp_path, zeros_word: int, qc_extra: dict | None = None, **tensors):
    """One 32-input, 8-output GPTQ Linear: inputs 0..7 of every output hold quants 0..7 (word 0x76543210), the
    others 0; scale of output o: (o + 1) / 2."""
    qweight = torch.zeros(4, 8, dtype=torch.int32)
    qweight[0, :] = 0x76543210
    base = {"m.qweight": qweight, "m.qzeros": torch.tensor([[zeros_word]], dtype=torch.uint32).view(torch.int32),
            "m.scales": (torch.arange(1, 9, dtype=torch.float16) / 2)[None, :].contiguous(),
            "m.g_idx": torch.zeros(32, dtype=torch.int32)}
    qc = {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False, **(qc_extra or {})}
    return load_hf_quantized(*write_dir(tmp_path, {**base, **tensors}, qc))


def hand_weight(zero_of_output) -> np.ndarray:
    q = np.zeros(32)
    q[:8] = np.arange(8)
    return np.array([(o + 1) / 2 * (q - zero_of_output(o)) for o in range(8)])


def test_gptq_v1_packs_inputs_lowest_bits_first_and_stores_zero_minus_one(tmp_path):
    # qzeros 0x76543210: output o's stored zero is o, so its zero is o + 1 (v1's "zeros - 1")
    read = hand_gptq(tmp_path, 0x76543210)
    w = read.weights["m.weight"]
    assert (w.format.name, w.shape, read.origin) == ("q5_0", (8, 32), "GPTQ 4-bit asym, group 32")
    assert read.tensor_names == {"m.qweight", "m.qzeros", "m.scales", "m.g_idx"}
    np.testing.assert_array_equal(w.dequantize().numpy(), hand_weight(lambda o: o + 1))


def test_gptq_v2_stores_the_zero_and_zero_eight_is_q4_0(tmp_path):
    read = hand_gptq(tmp_path, 0x88888888, {"checkpoint_format": "gptq_v2"})
    w = read.weights["m.weight"]
    assert w.format.name == "q4_0"
    np.testing.assert_array_equal(w.dequantize().numpy(), hand_weight(lambda o: 8))


def test_awq_packs_outputs_in_its_interleaved_order(tmp_path):
    # word 0x76543210 at every input: nibble k holds output ORDER[k] = (0, 2, 4, 6, 1, 3, 5, 7)[k], quant k
    tensors = {"m.qweight": torch.full((32, 1), 0x76543210, dtype=torch.int32),
               "m.qzeros": torch.full((1, 1), 0x11111111, dtype=torch.int32),
               "m.scales": torch.full((1, 8), 0.25, dtype=torch.float16)}
    read = load_hf_quantized(*write_dir(tmp_path, tensors, {"quant_method": "awq", "bits": 4, "group_size": 32,
                                                            "zero_point": True, "version": "gemm"}))
    quant_of_output = np.array([0, 4, 1, 5, 2, 6, 3, 7])
    want = 0.25 * (np.repeat(quant_of_output[:, None], 32, axis=1) - 1)
    assert read.weights["m.weight"].format.name == "q5_0"
    np.testing.assert_array_equal(read.weights["m.weight"].dequantize().numpy(), want)


@pytest.mark.parametrize("bits,group,sym,fmt", [(4, 32, True, "q4_0"), (4, 128, True, "q4_0"), (4, 64, False, "q5_0"),
                                                (4, 32, False, "q5_0"), (8, 96, True, "q8_0")])
def test_blocks_dequantise_to_the_checkpoints_weight_exactly(bits, group, sym, fmt):
    rng = np.random.default_rng(bits * group)
    q, scale, zero = rtn(rng.standard_normal((48, 320)).astype(np.float32) * 0.05, bits, group, sym)
    groups = IntGroups(group, q, scale.astype(np.float32), zero.astype(np.int32))
    w = to_blocks(groups, "w")
    assert w.format.name == fmt
    # gguf-py's dequantisation of the blocks (not ours) against the float64 s * (q - z)
    np.testing.assert_array_equal(gguf_dequantize(w.blocks.numpy(), GGML[fmt]).astype(np.float64),
                                  groups.dequantize())


def test_asymmetric_int4_is_q5_0_blocks_byte_for_byte():
    # two blocks of one row, scale 0.5 (fp16 0x3800): block 0's zero 16 (GPTQ v1's largest) with q_j = j % 16, so
    # its 5-bit quants q - z + 16 are j % 16, no fifth bit; block 1's zero 7 with q_j = 15 - j % 16, quants
    # 24 - j % 16, whose fifth bit (bit j of qh) is set for j % 16 <= 8. qs byte j: weight j's low nibble | weight
    # 16 + j's high
    j = np.arange(32)
    q = np.concatenate([j % 16, 15 - j % 16]).astype(np.uint8)[None, :]
    groups = IntGroups(32, q, np.full((1, 2), 0.5, np.float32), np.array([[16, 7]], np.int32))
    w = to_blocks(groups, "w")
    nibbles = np.arange(16)
    want = [0x00, 0x38, 0, 0, 0, 0, *(nibbles * 0x11),
            0x00, 0x38, 0xFF, 0x01, 0xFF, 0x01, *((8 - nibbles) % 16 * 0x11)]
    assert (w.format.name, w.shape, w.blocks.tolist()) == ("q5_0", (1, 64), [want])
    np.testing.assert_array_equal(gguf_dequantize(w.blocks.numpy(), GGML["q5_0"]).astype(np.float64),
                                  groups.dequantize())


@pytest.mark.parametrize("zero,fmt", [(16, "q5_0"), (0, "q5_0"), (17, "q8_0"), (8, "q4_0")])
def test_4_bit_quants_take_q5_0_only_where_every_q_minus_zero_is_in_its_range(zero, fmt):
    # q 0..15 against one zero: q - z spans -zero .. 15 - zero; Q5_0 holds -16..15, Q8_0 the rest of int8
    q = np.tile(np.arange(16, dtype=np.uint8), 2)[None, :]
    groups = IntGroups(32, q, np.full((1, 1), 0.125, np.float32), np.full((1, 1), zero, np.int32))
    w = to_blocks(groups, "w")
    assert w.format.name == fmt
    np.testing.assert_array_equal(gguf_dequantize(w.blocks.numpy(), GGML[fmt]).astype(np.float64),
                                  groups.dequantize())


@pytest.mark.parametrize("path", [p for p in ("avx512", "avx2") if p in cpu_path.supported(cpu_flags())])
@pytest.mark.parametrize("sym", [True, False])
def test_the_kernel_is_within_float32s_bound_of_the_checkpoints_weight(path, sym):
    rng = np.random.default_rng(7)
    q, scale, zero = rtn(rng.standard_normal((100, 256)).astype(np.float32) * 0.05, 4, 128, sym)
    groups = IntGroups(128, q, scale.astype(np.float32), zero.astype(np.int32))
    w = to_blocks(groups, "w")
    kernel = QuantKernel(load_library(cpu=cpu_path.PATHS[path]))
    x = torch.from_numpy(rng.standard_normal((5, 256)).astype(np.float32))
    out = kernel.linear(w.format.ggml_type, x, kernel.pack(w.format.ggml_type, w.blocks, 256), 100).double().numpy()
    ref = x.double().numpy() @ groups.dequantize().T
    # one float32 FMA chain of k = 256 terms on exact weights: |error| <= gamma_k * sum |x w|
    bound = 256 * U32 / (1 - 256 * U32) * (np.abs(x.double().numpy()) @ np.abs(groups.dequantize()).T)
    assert (np.abs(out - ref) <= bound).all()


@pytest.mark.parametrize("int8_activations", [False, True])
def test_the_cpu_kernels_give_q5_0_the_outputs_of_q8_0_holding_q_minus_zero_in_fewer_bytes(int8_activations):
    # both CPU kernels rebuild a Q5_0 weight's q5 - 16 = q - z under its d: every output is that of the Q8_0 blocks
    # of the same weight (d = s, int8 q - z), from panels of 5.5 bits a weight (nibbles and a fifth-bit plane)
    kernel = shared_kernel(int8_activations)
    if kernel is None:
        pytest.skip("no quantised kernel of this kind on this CPU")
    rng = np.random.default_rng(11)
    q, scale, zero = rtn(rng.standard_normal((96, 128)).astype(np.float32), 4, 64, False)
    groups = IntGroups(64, q, scale.astype(np.float32), zero.astype(np.int32))
    w = to_blocks(groups, "w")
    q8_0 = q8_0_blocks(groups)
    np.testing.assert_array_equal(gguf_dequantize(q8_0.numpy(), GGML["q8_0"]), w.dequantize().numpy())
    assert w.format.name == "q5_0" and w.blocks.numel() == 96 * 128 // 32 * 22
    packed_q5 = kernel.pack(w.format.ggml_type, w.blocks, 128)
    packed_q8 = kernel.pack(GGMLQuantizationType.Q8_0, q8_0, 128)
    assert packed_q5.numel() < 0.7 * packed_q8.numel()
    x = torch.from_numpy(rng.standard_normal((5, 128)).astype(np.float32))
    assert torch.equal(kernel.linear(w.format.ggml_type, x, packed_q5, 96),
                       kernel.linear(GGMLQuantizationType.Q8_0, x, packed_q8, 96))


def test_the_packing_round_trips_through_the_reader(tmp_path):
    rng = np.random.default_rng(3)
    q, scale, zero = rtn(rng.standard_normal((16, 64)).astype(np.float32), 4, 32, False)
    tensors = {"m.qweight": torch.from_numpy(pack(q.T, 4, axis=0)),
               "m.qzeros": torch.from_numpy(pack((zero.T - 1) & 15, 4, axis=1)),
               "m.scales": torch.from_numpy(np.ascontiguousarray(scale.T))}
    read = load_hf_quantized(*write_dir(tmp_path, tensors, {"quant_method": "gptq", "bits": 4, "group_size": 32}))
    want = IntGroups(32, q, scale.astype(np.float32), zero.astype(np.int32)).dequantize()
    np.testing.assert_array_equal(read.weights["m.weight"].dequantize().numpy(), want)


@pytest.mark.parametrize("qc,tensors,message", [
    ({"quant_method": "bitsandbytes"}, {}, "quant_method 'bitsandbytes' is not read here"),
    ({"bits": 3}, {}, "quantization_config.bits 3: GPTQ is read with 4 or 8 bits"),
    ({"checkpoint_format": "marlin"}, {}, "checkpoint_format 'marlin'"),
    ({"group_size": 0}, {}, "quantization_config.group_size 0"),
    ({"desc_act": True}, {"m.g_idx": torch.arange(32, dtype=torch.int32) % 2},
     "m.g_idx: groups out of input order (desc_act"),
    ({}, {"m.scales": torch.full((1, 8), 0.1, dtype=torch.float32)}, "m.scales: a torch.float32 scale that is not "
                                                                      "an fp16 value"),
    ({"group_size": 16}, {"m.scales": torch.ones(2, 8, dtype=torch.float16),
                          "m.qzeros": torch.zeros(2, 1, dtype=torch.int32),
                          "m.g_idx": torch.arange(32, dtype=torch.int32) // 16}, "group size 16 over 32 inputs"),
])
def test_fields_that_are_not_read_are_refused_by_name(tmp_path, qc, tensors, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(")):
        hand_gptq(tmp_path, 0x77777777, qc, **tensors)


def test_act_order_is_read_where_its_groups_are_in_input_order_and_needs_a_g_idx(tmp_path):
    read = hand_gptq(tmp_path / "a", 0x77777777, {"desc_act": True})  # g_idx: every input in group 0
    assert read.weights["m.weight"].format.name == "q4_0"
    with pytest.raises(ValueError, match="desc_act true, and no m.g_idx"):
        load_hf_quantized(*write_dir(tmp_path / "b", {"m.qweight": torch.zeros(4, 8, dtype=torch.int32),
                                                      "m.qzeros": torch.zeros(1, 1, dtype=torch.int32),
                                                      "m.scales": torch.ones(1, 8, dtype=torch.float16)},
                                     {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True}))


@pytest.mark.parametrize("qc,message", [({"version": "gemv"}, "version 'gemv'"), ({"zero_point": False},
                                                                                  "zero_point false")])
def test_awq_fields_that_are_not_read_are_refused_by_name(tmp_path, qc, message):
    base = {"quant_method": "awq", "bits": 4, "group_size": 32}
    with pytest.raises(ValueError, match=message):
        load_hf_quantized(*write_dir(tmp_path, {}, {**base, **qc}))


def test_the_compressed_tensors_layout_is_its_own_packing():
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    rng = np.random.default_rng(5)
    q, scale, zero = rtn(rng.standard_normal((48, 256)).astype(np.float32), 4, 64, False)
    tensors, _ = pack_compressed(q, scale, zero, 4, 64, False)
    signed = lambda a: torch.from_numpy(a.astype(np.int16) - 8).to(torch.int8)  # noqa: E731
    assert torch.equal(tensors["weight_packed"], pack_to_int32(signed(q), 4))
    assert torch.equal(tensors["weight_zero_point"], pack_to_int32(signed(zero), 4, packed_dim=0))


@pytest.mark.parametrize("bits,group,sym", [(4, 64, False), (4, 32, True), (8, -1, True)])
def test_compressed_tensors_blocks_are_its_own_dequantisation(tmp_path, bits, group, sym):
    # compressed-tensors' own unpacking and dequantisation (in float32, where the bf16 scale times an integer is
    # exact) is the reference
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize

    rng = np.random.default_rng(bits + group)
    size = 256 if group == -1 else group
    q, scale, zero = rtn(rng.standard_normal((48, 256)).astype(np.float32) * 0.05, bits, size, sym)
    tensors, _ = pack_compressed(q, scale, zero, bits, size, False)
    qc = quantization_config("compressed-tensors", bits, group, sym, False, activations=bits == 8)
    read = load_hf_quantized(*write_dir(tmp_path, {f"m.{k}": v for k, v in tensors.items()}, qc))
    args = QuantizationArgs(**qc["config_groups"]["group_0"]["weights"])
    if bits == 4:
        x_q = unpack_from_int32(tensors["weight_packed"], 4, torch.Size(q.shape))
        zp = tensors.get("weight_zero_point")
        zp = None if zp is None else unpack_from_int32(zp, 4, torch.Size(scale.shape), packed_dim=0)
    else:
        x_q, zp = tensors["weight"], None
    want = dequantize(x_q, tensors["weight_scale"].float(), zp, args=args, dtype=torch.float32)
    w = read.weights["m.weight"]
    assert w.format.name == ("q8_0" if bits == 8 else "q4_0" if sym else "q5_0")
    assert torch.equal(w.dequantize(), want)
    scheme = "W8A8 (its per-token int8 activations not applied) sym, per channel" if bits == 8 else \
        f"W4A16 {'sym' if sym else 'asym'}, group {group}"
    assert read.origin == f"compressed-tensors {scheme}"


@pytest.mark.parametrize("change,message", [
    ({"format": "float-quantized"}, "format 'float-quantized'"),
    ({"quantization_status": "frozen"}, "quantization_status 'frozen'"),
    ({"weights": {"strategy": "tensor"}}, "strategy 'tensor'"),
    ({"weights": {"actorder": "group"}}, "actorder"),
    ({"weights": {"type": "float"}}, "weights type 'float'"),
])
def test_compressed_tensors_fields_that_are_not_read_are_refused_by_name(tmp_path, change, message):
    qc = quantization_config("compressed-tensors", 4, 32, True, False, activations=False)
    weights = qc["config_groups"]["group_0"]["weights"]
    weights.update(change.pop("weights", {}))
    qc.update(change)
    with pytest.raises(ValueError, match=message):
        load_hf_quantized(*write_dir(tmp_path, {}, qc))
