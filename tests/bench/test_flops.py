"""The FLOP model of `pagedserve bench` on hand-computed numbers (SmolLM2-135M's shapes), and its report line."""

from __future__ import annotations

import re

from pagedserve_cli.bench.efficiency import machine_line, served_dtype
from pagedserve_cli.bench.flops import ModelShape, request_flops, run_flops
from pagedserve_cli.bench.peak import peak_of

SMOLLM2 = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
           "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152}
# Per layer: qkv 576 x (9 + 2 x 3) x 64 = 552,960; o_proj 576 x 576 = 331,776; gate_up 576 x 3,072 = 1,769,472;
# down 1,536 x 576 = 884,736: 3,538,944 weights, x 30 layers x 2 = 212,336,640 FLOPs a forwarded token.
LINEAR = 212_336_640
LM_HEAD = 2 * 576 * 49152  # 56,623,104 a sampled row
ATTENTION = 4 * 30 * 9 * 64  # 69,120 a key a token (QK^T and PV, 9 query heads, 30 layers)


def test_smollm2_shapes_and_per_token_flops():
    shape = ModelShape.from_config(SMOLLM2)
    assert shape.gemms() == {"qkv": (576, 960), "o_proj": (576, 576), "gate_up": (576, 3072),
                             "down": (1536, 576), "lm_head": (576, 49152)}
    assert shape.layer_matmul_params == 3_538_944
    assert shape.linear_flops == LINEAR and shape.lm_head_flops == 56_623_104
    assert shape.attention_flops(0, 1) == ATTENTION  # the first token sees itself
    assert shape.attention_flops(0, 3) == ATTENTION * (1 + 2 + 3)
    assert shape.attention_flops(5, 5) == 0


def test_head_dim_and_kv_heads_default_as_in_transformers():
    cfg = {k: v for k, v in SMOLLM2.items() if k not in ("head_dim", "num_key_value_heads")}
    shape = ModelShape.from_config(cfg)
    assert (shape.head_dim, shape.num_kv_heads) == (64, 9)
    assert shape.gemms()["qkv"] == (576, 3 * 576)


def test_a_request_forwards_its_prompt_and_every_output_token_but_the_last():
    shape = ModelShape.from_config(SMOLLM2)
    # Prompt 3, output 2: positions 0, 1, 2 (prefill) and 3 (the first output token fed back); the second output
    # token is sampled and never forwarded. The lm_head runs on 2 rows: the prompt's last and the decode token.
    r = request_flops(shape, 3, 2)
    assert (r.prefill_tokens, r.decode_tokens, r.sampled_rows) == (3, 1, 2)
    assert r.linear == 4 * LINEAR == 849_346_560
    assert r.attention == ATTENTION * (1 + 2 + 3 + 4) == 691_200
    assert r.lm_head == 2 * LM_HEAD == 113_246_208
    assert r.total == 963_283_968


def test_prefix_cache_hits_skip_the_cached_positions_but_not_their_keys():
    shape = ModelShape.from_config(SMOLLM2)
    r = request_flops(shape, 3, 2, cached_tokens=2)  # positions 2 and 3 run, seeing 3 and 4 keys
    assert (r.prefill_tokens, r.decode_tokens) == (1, 1)
    assert (r.linear, r.attention, r.lm_head) == (2 * LINEAR, ATTENTION * 7, 2 * LM_HEAD)
    whole = request_flops(shape, 3, 1, cached_tokens=3)  # a fully cached prompt still runs its last token
    assert (whole.prefill_tokens, whole.decode_tokens, whole.attention) == (1, 0, ATTENTION * 3)


def test_a_run_spreads_its_hits_over_the_prompts():
    shape = ModelShape.from_config(SMOLLM2)
    f = run_flops(shape, [(100, 10), (300, 10)], hit_tokens=200)  # 50% hit: 50 and 150 tokens cached
    assert (f.prefill_tokens, f.decode_tokens, f.sampled_rows) == (200, 18, 20)
    assert f.linear == 218 * LINEAR
    # keys: positions 50..108 see 51..109 (4,720 in all), positions 150..308 see 151..309 (36,570)
    assert f.attention == ATTENTION * 41_290 == 2_853_964_800
    assert f.lm_head == 20 * LM_HEAD
    assert run_flops(shape, []).total == 0


def test_the_dtype_comes_from_the_flag_then_the_workers_then_the_metrics_then_spawn():
    assert served_dtype("bfloat16", ["float32"], None, None) == ("bfloat16", "--peak-dtype")
    assert served_dtype(None, ["float32"], "bfloat16", None)[0] == "float32"
    assert served_dtype(None, ["int8"], "bfloat16", None)[0] == "bfloat16"  # an int8 cache says nothing
    assert served_dtype(None, [], "auto", "float32") == ("float32", "--dtype")  # vLLM's "auto": no answer
    assert served_dtype(None, [], "auto", "auto")[0] is None


def test_the_peak_is_the_dtypes_at_the_most_threads_unless_asked():
    doc = {"peak": {"float32": {"1": {"gflops_s": 170.0}, "2": {"gflops_s": 330.0}}}}
    assert peak_of(doc, "float32") == (330.0, 2) and peak_of(doc, "float32", 1) == (170.0, 1)
    assert peak_of(doc, "float32", 4) is None
    assert peak_of(doc, "bfloat16") is None


def test_the_machine_line_names_every_role_and_nan_for_what_was_not_measured():
    line = machine_line({"model_gflops_s": 21.152, "peak_gflops_s": 325.61, "peak_share": 0.06497,
                         "per_core_share": 0.25},
                        {"by_role": {"worker": 2.8, "scheduler": 0.13, "engine core": 1.0, "client": 0.21},
                         "server_cpu_s": 3.93})
    assert line == ("model_gflops_s=21.15 peak_gflops_s=325.6 peak_share=0.0650 per_core_share=0.2500 "
                    "cpu_s_server=3.93 cpu_s_scheduler=0.13 cpu_s_worker=2.80 cpu_s_engine_core=1.00 cpu_s_client=0.21")
    empty = machine_line(None, {"by_role": {"client": 0.5}, "server_cpu_s": None})
    assert re.fullmatch(r"model_gflops_s=nan peak_gflops_s=nan peak_share=nan per_core_share=nan cpu_s_server=nan "
                        r"cpu_s_scheduler=nan cpu_s_worker=nan cpu_s_client=0\.50", empty)
