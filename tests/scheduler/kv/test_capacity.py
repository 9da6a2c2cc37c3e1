"""KV capacity planning: bytes per token/block/sequence from config.json, and `pagedserve kv-plan`."""

import json
import subprocess
import sys

import pytest

from pagedserve_common.kv_geometry import KVGeometry
from scheduler_svc.kv.capacity import plan

LLAMA2_70B = {"num_hidden_layers": 80, "hidden_size": 8192, "num_attention_heads": 64,
              "max_position_embeddings": 4096, "torch_dtype": "float16"}


def test_llama2_70b_shape_without_gqa_is_10_gib_per_4k_sequence():
    shape = KVGeometry.from_config({**LLAMA2_70B, "num_key_value_heads": 64})
    kv = plan(shape, seq_len=4096)
    assert kv.bytes_per_token == 2 * 80 * 64 * 128 * 2 == 2_621_440
    assert kv.bytes_per_block == 16 * 2_621_440
    assert kv.bytes_per_sequence == 10_737_418_240 == 10 * 2**30


def test_gqa_counts_kv_heads_not_attention_heads():
    kv = plan(KVGeometry.from_config({**LLAMA2_70B, "num_key_value_heads": 8}), seq_len=4096)
    assert kv.bytes_per_sequence == 1_342_177_280


def test_missing_kv_heads_means_multi_head_attention_and_head_dim_is_derived():
    shape = KVGeometry.from_config(LLAMA2_70B)
    assert (shape.num_kv_heads, shape.head_dim, shape.dtype) == (64, 128, "float16")
    assert KVGeometry.from_config({**LLAMA2_70B, "head_dim": 256}).head_dim == 256


def test_partial_blocks_are_reserved_whole_and_memory_fit_is_computed():
    shape = KVGeometry.from_config({**LLAMA2_70B, "num_key_value_heads": 8}, dtype="int8")
    kv = plan(shape, seq_len=1000, memory=80 * 2**30, max_model_len=4096)
    assert kv.bytes_per_token == 2 * 80 * 8 * 128 + 2 * 80 * 8 * 4  # codes + one float32 scale per row
    assert kv.blocks_per_sequence == 63 and kv.bytes_per_sequence == 63 * 16 * kv.bytes_per_token
    assert kv.num_blocks == 80 * 2**30 // kv.bytes_per_block
    assert kv.num_tokens == kv.num_blocks * 16
    assert kv.num_sequences == kv.num_blocks // 63
    assert kv.contiguous_num_sequences == 80 * 2**30 // (4096 * kv.bytes_per_token)
    assert kv.num_sequences > 4 * kv.contiguous_num_sequences  # why paging: no max-length reservation


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3", "fp8_e5m2"])
def test_an_8_bit_cache_halves_the_70b_fp16_figure_plus_one_float32_scale_per_token_and_kv_head(dtype):
    fp16 = KVGeometry.from_config({**LLAMA2_70B, "num_key_value_heads": 8})
    eight = KVGeometry.from_config({**LLAMA2_70B, "num_key_value_heads": 8}, dtype=dtype)
    assert fp16.bytes_per_token == 327_680 and fp16.scale_bytes_per_token == 0
    assert eight.scale_bytes_per_token == 2 * 80 * 8 * 4 == 5_120
    assert eight.bytes_per_token == 327_680 // 2 + 5_120 == 168_960


def test_int8_holds_at_least_3_7_times_the_float32_blocks_of_the_default_models_shape():
    shape = dict(num_layers=30, num_kv_heads=3, head_dim=64)  # SmolLM2-135M
    f32, i8 = KVGeometry(**shape, dtype="float32"), KVGeometry(**shape, dtype="int8")
    budget = 512 * 2**20
    assert (f32.num_blocks_for(budget), i8.num_blocks_for(budget)) == (728, 2741)
    assert i8.num_blocks_for(budget) >= 3.7 * f32.num_blocks_for(budget)


def test_cli_prints_the_scale_overhead_of_an_8_bit_cache(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA2_70B, "num_key_value_heads": 8}))
    run = [sys.executable, "-m", "pagedserve_cli.main", "kv-plan", "--model", str(tmp_path), "--seq-len", "4096"]
    text = subprocess.run([*run, "--kv-cache-dtype", "int8"], check=True, capture_output=True, text=True).stdout
    assert "KV bytes per token:    168,960  (2 x 80 x 8 x 128 x 1 + 2 x 80 x 8 x 4 scale bytes)" in text
    kv = json.loads(subprocess.run([*run, "--kv-cache-dtype", "fp8_e4m3", "--json"], check=True,
                                   capture_output=True, text=True).stdout)
    assert (kv["dtype"], kv["bytes_per_token"], kv["scale_bytes_per_token"]) == ("fp8_e4m3", 168_960, 5_120)
    auto = json.loads(subprocess.run([*run, "--dtype", "bfloat16", "--json"], check=True, capture_output=True,
                                     text=True).stdout)
    assert (auto["dtype"], auto["bytes_per_token"]) == ("bfloat16", 327_680)


def test_bad_dtype_is_rejected():
    with pytest.raises(ValueError, match="dtype"):
        KVGeometry.from_config(LLAMA2_70B, dtype="float8")


def test_cli_json_output(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({**LLAMA2_70B, "num_key_value_heads": 8}))
    out = subprocess.run([sys.executable, "-m", "pagedserve_cli.main", "kv-plan", "--model", str(tmp_path),
                          "--seq-len", "4096", "--memory", "80GiB", "--json"],
                         check=True, capture_output=True, text=True).stdout
    kv = json.loads(out)
    assert kv["bytes_per_token"] == 327_680
    assert kv["bytes_per_block"] == 5_242_880
    assert kv["bytes_per_sequence"] == 1_342_177_280
    assert kv["num_sequences"] == 64


def test_cli_reports_a_bad_memory_size(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(LLAMA2_70B))
    r = subprocess.run([sys.executable, "-m", "pagedserve_cli.main", "kv-plan", "--model", str(tmp_path),
                        "--seq-len", "8", "--memory", "lots"], capture_output=True, text=True)
    assert r.returncode == 2 and "memory" in r.stderr
