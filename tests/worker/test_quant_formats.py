"""worker_svc.quant.formats and .weight: GGML's block formats, the reference dequantiser bit for bit against gguf-py's
(an independent implementation), and a quantised weight's checks."""

import gguf
import numpy as np
import pytest
import torch

from tests.support.quant_blocks import random_blocks
from worker_svc.quant import FORMATS, FORMATS_BY_GGML_TYPE, QuantFormat, QuantWeight, dequantize


def reference(blocks: np.ndarray, fmt: QuantFormat) -> np.ndarray:
    return gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType(fmt.ggml_type))


def bits(a: np.ndarray) -> np.ndarray:
    """float32 as its bit patterns: -0.0 differs from 0.0."""
    assert a.dtype == np.float32
    return a.view(np.uint32)


def test_the_formats_are_ggmls():
    assert {name: (f.ggml_type, f.block_size, f.block_bytes) for name, f in FORMATS.items()} == {
        "q4_0": (2, 32, 18), "q4_1": (3, 32, 20), "q5_0": (6, 32, 22), "q8_0": (8, 32, 34), "q4_k": (12, 256, 144),
        "q6_k": (14, 256, 210)}
    for f in FORMATS.values():
        assert FORMATS_BY_GGML_TYPE[f.ggml_type] is f
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(f.ggml_type)] == (f.block_size, f.block_bytes)
        assert gguf.GGMLQuantizationType(f.ggml_type).name.lower() == f.name
    assert 0 not in FORMATS_BY_GGML_TYPE  # F32: not a block format


@pytest.mark.parametrize("name", FORMATS)
@pytest.mark.parametrize("seed", range(3))
def test_dequantize_is_bit_identical_to_gguf_py_on_random_blocks(name, seed):
    fmt = FORMATS[name]
    rng = np.random.default_rng(seed)
    num_rows, num_cols = 5 + seed, fmt.block_size * (3 + seed)  # several rows of several blocks
    blocks = random_blocks(rng, fmt, num_rows, num_cols)
    got = dequantize(blocks, fmt)
    assert got.dtype == np.float32 and got.shape == (num_rows, num_cols)
    np.testing.assert_array_equal(bits(got), bits(reference(blocks, fmt)))


@pytest.mark.parametrize("name", FORMATS)
def test_dequantize_matches_gguf_py_on_many_blocks_of_plausible_scales(name):
    fmt = FORMATS[name]
    blocks = random_blocks(np.random.default_rng(7), fmt, 64, fmt.block_size * 8, scale=0.01)
    np.testing.assert_array_equal(bits(dequantize(blocks, fmt)), bits(reference(blocks, fmt)))


def test_q4_0_low_nibbles_are_the_first_half_of_a_block():
    block = np.zeros((1, 18), np.uint8)
    block[0, 0:2] = np.array([0.5], "<f2").view(np.uint8)
    block[0, 2] = 0x9A  # weight 0: low nibble 0xA, weight 16: high nibble 0x9
    w = dequantize(block, FORMATS["q4_0"])[0]
    assert (w[0], w[16]) == ((0xA - 8) * 0.5, (0x9 - 8) * 0.5)
    assert set(w[[*range(1, 16), *range(17, 32)]]) == {-4.0}  # (0 - 8) * 0.5


def test_block_and_byte_arithmetic():
    q4_1, q6_k = FORMATS["q4_1"], FORMATS["q6_k"]
    assert q4_1.row_bytes(576) == 18 * 20 and q4_1.num_cols(360) == 576
    assert q6_k.row_bytes(512) == 2 * 210 and q6_k.num_cols(420) == 512
    for f in FORMATS.values():
        assert f.num_cols(f.row_bytes(4 * f.block_size)) == 4 * f.block_size
    with pytest.raises(ValueError, match="a row of 48 weights is not a whole number of q4_1 blocks"):
        q4_1.row_bytes(48)
    with pytest.raises(ValueError, match="a row of 0 weights"):
        q4_1.row_bytes(0)
    with pytest.raises(ValueError, match=r"a row of 211 bytes is not a whole number of q6_k blocks \(210 bytes"):
        q6_k.num_cols(211)


def test_a_wrong_row_length_is_a_value_error_naming_it():
    fmt = FORMATS["q8_0"]
    with pytest.raises(ValueError, match=r"a row of 35 bytes is not a whole number of q8_0 blocks \(34 bytes each\)"):
        dequantize(np.zeros((2, 35), np.uint8), fmt)
    with pytest.raises(ValueError, match=r"must be uint8 \[rows, row_bytes\], not int8 of shape \[2, 34\]"):
        dequantize(np.zeros((2, 34), np.int8), fmt)
    with pytest.raises(ValueError, match=r"not uint8 of shape \[34\]"):
        dequantize(np.zeros(34, np.uint8), fmt)


def test_dequantize_takes_non_contiguous_rows():
    fmt = FORMATS["q4_k"]
    blocks = random_blocks(np.random.default_rng(1), fmt, 6, 512)
    np.testing.assert_array_equal(bits(dequantize(blocks[::2], fmt)), bits(dequantize(blocks, fmt)[::2]))


def test_a_quant_weight_dequantizes_to_a_float32_tensor():
    fmt = FORMATS["q6_k"]
    blocks = random_blocks(np.random.default_rng(2), fmt, 3, 256)
    weight = QuantWeight(fmt, (3, 256), torch.from_numpy(blocks))
    got = weight.dequantize()
    assert got.dtype == torch.float32 and got.shape == (3, 256)
    np.testing.assert_array_equal(bits(got.numpy()), bits(dequantize(blocks, fmt)))


@pytest.mark.parametrize("shape, blocks, message", [
    ((3, 64), torch.zeros(3, 36, dtype=torch.uint8), None),
    ((3, 48), torch.zeros(3, 36, dtype=torch.uint8), r"shape \[3, 48\]: a row of 48 weights is not a whole number"),
    ((3, 0), torch.zeros(3, 0, dtype=torch.uint8), r"shape \[3, 0\] is not two positive sizes"),
    ((3, 64, 1), torch.zeros(3, 36, dtype=torch.uint8), r"shape \[3, 64, 1\] is not two positive sizes"),
    ((4, 64), torch.zeros(3, 36, dtype=torch.uint8), r"blocks are torch.uint8 \[3, 36\]; shape \[4, 64\] in q4_0 "
                                                     r"takes uint8 \[4, 36\]"),
    ((3, 64), torch.zeros(3, 36, dtype=torch.int8), r"blocks are torch.int8"),
    ((3, 64), torch.zeros(36, 3, dtype=torch.uint8).t(), "blocks are not contiguous"),
])
def test_a_quant_weight_checks_its_fields(shape, blocks, message):
    if message is None:
        assert QuantWeight(FORMATS["q4_0"], shape, blocks).shape == shape
    else:
        with pytest.raises(ValueError, match=message):
            QuantWeight(FORMATS["q4_0"], shape, blocks)


def test_q5_0_fifth_bits_are_qh_bit_by_weight():
    block = np.zeros((1, 22), np.uint8)
    block[0, 0:2] = np.array([0.5], "<f2").view(np.uint8)
    block[0, 2:6] = np.array([(1 << 0) | (1 << 17)], "<u4").view(np.uint8)  # weights 0 and 17: fifth bit set
    block[0, 6] = 0x3A  # weight 0: low nibble 0xA, weight 16: high nibble 0x3
    w = dequantize(block, FORMATS["q5_0"])[0]
    assert (w[0], w[16], w[17]) == ((0x1A - 16) * 0.5, (0x3 - 16) * 0.5, (0x10 - 16) * 0.5)
    assert set(w[[*range(1, 16), *range(18, 32)]]) == {-8.0}  # (0 - 16) * 0.5
