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
    assert kv.bytes_per_token == 2 * 80 * 8 * 128
    assert kv.blocks_per_sequence == 63 and kv.bytes_per_sequence == 63 * 16 * kv.bytes_per_token
    assert kv.num_blocks == 80 * 2**30 // kv.bytes_per_block
    assert kv.num_tokens == kv.num_blocks * 16
    assert kv.num_sequences == kv.num_blocks // 63
    assert kv.contiguous_num_sequences == 80 * 2**30 // (4096 * kv.bytes_per_token)
    assert kv.num_sequences > 4 * kv.contiguous_num_sequences  # why paging: no max-length reservation


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
