"""The comparison's figures and pictures, from hand-built KV snapshots: exact slot counts, pixels and lines."""

from __future__ import annotations

import math

import numpy as np
from PIL import Image

from pagedserve.v1 import generate_pb2 as pb
from pagedserve_cli.bench import kv_frames, kv_int8
from pagedserve_cli.bench.compare import COMPARISONS, Side, SideResult, no_prefix_cache_lines, \
    static_prealloc_lines
from pagedserve_cli.bench.kv_sampler import KVUsage, summarize_usage, usage_of
from pagedserve_cli.bench.spawn import SpawnConfig, up_argv


def state(num_blocks: int, seqs: list[tuple[str, list[int], int]], mode: str = "paged", num_waiting: int = 0,
          cached: tuple[int, ...] = (), block_size: int = 4, num_prefill_tokens: int = 0,
          waiting_for_blocks: bool = False) -> pb.KVState:
    refs = [0] * num_blocks
    for _, ids, _ in seqs:
        for b in ids:
            refs[b] += 1
    return pb.KVState(worker_id="worker-0", block_size=block_size, num_blocks=num_blocks, ref_counts=bytes(refs),
                      cached=bytes(1 if b in cached else 0 for b in range(num_blocks)), kv_allocation=mode,
                      num_waiting=num_waiting, num_prefill_tokens=num_prefill_tokens,
                      waiting_for_blocks=waiting_for_blocks,
                      sequences=[pb.KVSequence(request_id=r, seq_id=i, block_ids=ids, num_tokens=n)
                                 for i, (r, ids, n) in enumerate(seqs)])


def test_usage_counts_a_shared_block_once_and_strands_nothing_while_the_queue_waits_for_a_step_budget():
    # a: 3 blocks, 10 tokens (last block half full); b shares a's first two blocks (a prefix hit), 9 tokens.
    s = state(8, [("a", [0, 1, 2], 10), ("b", [0, 1, 5], 9)], num_waiting=3, cached=(0, 1, 7))
    u = usage_of(s, 1.5)
    assert u == KVUsage(t=1.5, num_running=2, num_waiting=3, reserved=4 * 4, filled=4 + 4 + 2 + 1, free=4 * 4,
                        stranded=0)


def test_static_usage_counts_empty_reservations_and_strands_free_slots_while_the_head_waits_for_blocks():
    # Two reservations of 3 blocks at 0-2 and 4-6; block 3 and 7 free but too short for a third one.
    s = state(8, [("a", [0, 1, 2], 5), ("b", [4, 5, 6], 1)], mode="static-max-model-len", num_waiting=1,
              waiting_for_blocks=True)
    assert usage_of(s, 0.0) == KVUsage(0.0, 2, 1, reserved=24, filled=6, free=8, stranded=8)
    assert usage_of(state(8, [("a", [0, 1, 2], 5)], mode="static-request"), 0.0).stranded == 0  # nobody waits


def test_summary_is_time_averaged_over_busy_samples_only():
    idle = KVUsage(0.0, 0, 0, 0, 0, 32, 0)
    busy = [KVUsage(0.25, 2, 1, reserved=24, filled=6, free=8, stranded=8),
            KVUsage(0.5, 1, 0, reserved=12, filled=10, free=20, stranded=0)]
    s = summarize_usage([idle, *busy, idle])
    assert s["samples"] == 2 and s["peak_running"] == 2 and s["mean_running"] == 1.5
    assert math.isclose(s["waste"], 1 - 16 / 44) and math.isclose(s["internal"], 20 / 44)
    assert math.isclose(s["external"], 8 / 44)
    assert summarize_usage([idle])["waste"] is None


def test_block_map_draws_free_cached_filled_and_reserved_slots():
    s = state(40, [("a", [0, 1], 6), ("b", [0, 9], 5)], cached=(3,))
    img = kv_frames.block_map(s)
    cell = kv_frames.CELL
    assert img.shape == (2 * cell, kv_frames.COLUMNS * cell, 3)  # 40 blocks: two rows of 32
    colour = np.array(kv_frames.request_colour("a"), dtype=np.uint8)
    assert (img[cell // 2, 2 * cell + cell // 2] == kv_frames.FREE_RGB).all()
    assert (img[cell // 2, 3 * cell + cell // 2] == kv_frames.CACHED_FREE_RGB).all()
    # block 0 is full and shared: solid inside, a black frame
    assert (img[cell // 2, cell // 2] == colour).all() and (img[0, 0] == 0).all()
    # block 1 holds 2 of 4 slots: the bottom half solid, the top half pale
    assert (img[cell - 2, cell + cell // 2] == colour).all()
    assert not (img[1, cell + cell // 2] == colour).all() and img[1, cell + cell // 2].min() > colour.min()


def test_pictures_are_a_gif_with_one_frame_per_time_step_and_two_pngs(tmp_path):
    paged = [(t * 0.25, state(16, [("a", [0, 1], 4 + t)])) for t in range(6)]
    static = [(t * 0.25, state(16, [("a", list(range(8)), 4 + t)], mode="static-max-model-len", num_waiting=1))
              for t in range(5)]
    names = kv_frames.write_pictures(tmp_path, "static-prealloc", [("paged", paged), ("static", static), ("x", [])])
    assert names == ["kv_map.gif", "kv_map.png", "kv_usage.png"]
    with Image.open(tmp_path / "kv_map.gif") as gif:
        assert gif.n_frames == len(kv_frames.frame_times([("paged", paged), ("static", static)])) == 6
    for name in ("kv_map.png", "kv_usage.png"):
        assert (tmp_path / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _result(name: str, waste: float, mean_running: float, tok_s: float, ttft_p50: float = 1.0,
            prefill: int = 0) -> SideResult:
    usage = {"waste": waste, "internal": waste, "external": 0.0, "mean_running": mean_running, "peak_running": 9}
    summary = {"output_tok_s": tok_s, "wall_s": 10.0, "prompt_tokens": 1000,
               "ttft_s": {"p50": ttft_p50, "p90": 2 * ttft_p50}, "server": {"prefix_hit_rate": 0.5}}
    return SideResult(Side(name, []), summary, usage, states=[(0.0, state(4, [], num_prefill_tokens=prefill))])


def test_static_prealloc_last_line_is_paged_over_max_model_len_reservations():
    table, last = static_prealloc_lines([_result("paged", 0.031, 40.0, 300.0),
                                         _result("static-max-model-len", 0.81, 5.0, 100.0),
                                         _result("static-request", 0.4, 20.0, 200.0)])
    assert last == "waste_paged=0.0310 waste_static=0.8100 concurrency_ratio=8.00 throughput_ratio=3.00"
    assert table[-1] == ("waste_paged=0.0310 waste_static_request=0.4000 concurrency_ratio_request=2.00 "
                         "throughput_ratio_request=1.50")
    assert table[2].startswith("| paged | 3.10% |") and len(table) == 2 + 3 + 2


def test_no_prefix_cache_last_line_is_prefill_with_over_without_and_ttft_without_over_with():
    table, last = no_prefix_cache_lines([_result("prefix-cache", 0, 0, 1, ttft_p50=0.5, prefill=700),
                                         _result("no-prefix-cache", 0, 0, 1, ttft_p50=4.0, prefill=10_000)])
    assert last == "prefill_tokens_ratio=0.0700 ttft_ratio=8.00"
    assert table[2].startswith("| prefix-cache | 700 | 1,000 | 50.0% | 0.500 s |")


def test_each_side_changes_one_up_flag_and_shares_the_rest():
    assert [s.extra for s in COMPARISONS["static-prealloc"].sides] == [
        [], ["--kv-allocation", "static-max-model-len"], ["--kv-allocation", "static-request"]]
    assert [s.extra for s in COMPARISONS["no-prefix-cache"].sides] == [[], ["--no-prefix-caching"]]
    assert [s.extra for s in COMPARISONS["kv-int8"].sides] == [["--kv-cache-dtype", "float32"],
                                                               ["--kv-cache-dtype", "int8"]]
    argv = up_argv(SpawnConfig("M", "float32", "512MiB", 2048), "127.0.0.1:1", "127.0.0.1:2", "127.0.0.1:3",
                   ["--no-prefix-caching"])
    assert argv[argv.index("up") + 1:] == [
        "--model", "M", "--dtype", "float32", "--listen", "127.0.0.1:1", "--worker-listen", "127.0.0.1:2",
        "--metrics", "127.0.0.1:3", "--http", "", "--startup-timeout", "600.0", "--kv-memory", "512MiB",
        "--max-model-len", "2048", "--no-prefix-caching"]


def test_capacity_at_512mib_gives_int8_at_least_3_7_times_the_float32_blocks(default_model):
    # The default model's config.json (SmolLM2-135M: 30 layers, 3 kv heads, head_dim 64), as the bench reads it.
    caps = kv_int8.model_capacities(str(default_model), 512 << 20)
    # bytes per token: 2 x 30 x 3 x 64 x dtype bytes, plus 2 x 30 x 3 x 4 of scales for the 8-bit caches
    assert [(c.dtype, c.bytes_per_token, c.num_blocks) for c in caps] == [
        ("float32", 46_080, 728), ("bfloat16", 23_040, 1456), ("int8", 12_240, 2741), ("fp8_e4m3", 12_240, 2741)]
    assert caps[2].num_blocks >= 3.7 * caps[0].num_blocks
    rows = kv_int8.capacity_lines({"512MiB": caps, "128MiB": kv_int8.model_capacities(
        str(default_model), 128 << 20)})
    assert rows[0] == ("| KV cache | bytes per token | blocks at 512MiB | x float32 | blocks at 128MiB | "
                       "x float32 |")
    assert rows[2] == "| float32 | 46,080 | 728 | 1.00 | 182 | 1.00 |"
    assert rows[4] == "| int8 | 12,240 | 2,741 | 3.77 | 685 | 3.76 |"


def test_kv_int8_last_line_is_int8_over_float32_and_the_perplexity_change_in_percent():
    last = kv_int8.last_line((728, 2741), (40.0, 150.0), (100.0, 160.0), (20.0, 20.1))
    assert last == "blocks_ratio=3.7651 concurrency_ratio=3.75 throughput_ratio=1.60 ppl_delta_pct=0.50"
    assert kv_int8.last_line((728, 2741), (40.0, 30.0), (100.0, 90.0), (20.0, 19.9)).endswith(
        "concurrency_ratio=0.75 throughput_ratio=0.90 ppl_delta_pct=-0.50")
    # no samples (a side that ran nothing) or no perplexity: nan, never a division error
    assert kv_int8.last_line((728, 2741), (None, 1.0), (0.0, 1.0), (float("nan"), 20.0)) == (
        "blocks_ratio=3.7651 concurrency_ratio=nan throughput_ratio=nan ppl_delta_pct=nan")


def test_kv_int8_table_shows_each_sides_registered_cache_and_blocks():
    base, quant = _result("float32", 0.0, 40.0, 100.0), _result("int8", 0.0, 150.0, 160.0)
    base.workers = [{"worker_id": "worker-0", "num_blocks": 728, "dtype": "float32"}]
    quant.workers = [{"worker_id": "worker-0", "num_blocks": 2741, "dtype": "int8"}]
    table, last = kv_int8.side_lines([base, quant], {"float32": 20.0, "int8": 20.1})
    assert table[2].startswith("| float32 | float32 | 728 | 40.0 | 9 |")
    assert table[3].startswith("| int8 | int8 | 2,741 | 150.0 | 9 |") and table[3].endswith("| 20.100 |")
    assert last.startswith("blocks_ratio=3.7651 concurrency_ratio=3.75 throughput_ratio=1.60 ")
