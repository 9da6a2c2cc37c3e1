"""Statistics on hand-built records, with exact expected numbers; the summary's text and last line."""

from __future__ import annotations

import re

import pytest

from pagedserve_cli.bench.clients import RequestRecord
from pagedserve_cli.bench.report import itl_gaps, last_line, percentiles, render_summary, server_metrics, summarize
from pagedserve_cli.bench.runner import arrival_offsets, parse_prometheus


def record(index, send, chunks, end, error=None, prompt=10, max_tokens=None) -> RequestRecord:
    rec = RequestRecord(index, prompt, max_tokens or sum(k for _, k in chunks), send_time=send, end_time=end,
                        error=error, finish_reason=None if error else "length")
    for t, k in chunks:
        rec.add_chunk(t, k)
    rec.output_tokens = sum(k for _, k in chunks)
    return rec


def test_percentiles_interpolate_linearly():
    p = percentiles([float(x) for x in range(1, 11)])
    assert p == pytest.approx({"p50": 5.5, "p90": 9.1, "p99": 9.91, "mean": 5.5})
    assert percentiles([]) == {"p50": None, "p90": None, "p99": None, "mean": None}
    assert percentiles([0.25]) == {"p50": 0.25, "p90": 0.25, "p99": 0.25, "mean": 0.25}


def test_a_chunk_of_k_tokens_counts_as_k_even_gaps():
    rec = record(0, 0.0, [(1.0, 2), (1.5, 1), (2.5, 4), (2.6, 1)], 2.7)
    assert itl_gaps(rec) == pytest.approx([0.5, 0.25, 0.25, 0.25, 0.25, 0.1])
    assert itl_gaps(record(1, 0.0, [(1.0, 3)], 1.0)) == []  # the first chunk's tokens belong to the TTFT


def test_summary_figures():
    records = [
        record(0, 0.0, [(0.5, 1), (1.0, 1), (2.0, 2)], 2.0),   # ttft 0.5, gaps 0.5 0.5 0.5, e2e 2.0
        record(1, 1.0, [(1.25, 1), (1.5, 1)], 4.0),            # ttft 0.25, gap 0.25, e2e 3.0 (ends last)
        record(2, 0.5, [(1.0, 1)], 1.5, error="UNAVAILABLE: no worker"),
    ]
    s = summarize(records)
    assert (s["requests"], s["completed"], s["failed"]) == (3, 2, 1)
    assert s["wall_s"] == 4.0  # first send (0.0) to last finish (4.0)
    assert s["output_tokens"] == 6 and s["prompt_tokens"] == 20
    assert s["output_tok_s"] == 1.5 and s["requests_per_s"] == 0.5
    assert s["ttft_s"]["p50"] == pytest.approx(0.375) and s["ttft_s"]["p99"] == pytest.approx(0.4975)
    assert s["itl_s"]["p50"] == 0.5 and s["itl_s"]["mean"] == pytest.approx(0.4375)
    assert s["e2e_s"]["p50"] == 2.5 and s["e2e_s"]["p90"] == pytest.approx(2.9)
    assert s["errors"] == {"UNAVAILABLE: no worker": 1}
    assert s["server"] is None
    assert last_line(s) == "output_tok_s=1.5 ttft_p50_s=0.3750 itl_p50_s=0.5000"


def test_last_line_when_nothing_was_measured():
    s = summarize([record(0, 0.0, [], 1.0, error="boom")])
    assert s["completed"] == 0 and s["output_tok_s"] == 0.0
    assert last_line(s) == "output_tok_s=0.0 ttft_p50_s=nan itl_p50_s=nan"


def test_server_metrics_peak_and_counter_deltas():
    samples = [
        (0.0, {"pagedserve_kv_blocks_used": 0, "pagedserve_kv_blocks_total": 40,
               "pagedserve_prefix_cache_queries_tokens_total": 100, "pagedserve_prefix_cache_hits_tokens_total": 10,
               "pagedserve_preemptions_total": 2}),
        (0.5, {"pagedserve_kv_blocks_used": 31, "pagedserve_kv_blocks_total": 40,
               "pagedserve_prefix_cache_queries_tokens_total": 300, "pagedserve_prefix_cache_hits_tokens_total": 60,
               "pagedserve_preemptions_total": 5}),
        (1.0, {"pagedserve_kv_blocks_used": 3, "pagedserve_kv_blocks_total": 40,
               "pagedserve_prefix_cache_queries_tokens_total": 500, "pagedserve_prefix_cache_hits_tokens_total": 110,
               "pagedserve_preemptions_total": 7, "pagedserve_worker_idle_seconds_sum": 1.5,
               "pagedserve_worker_idle_seconds_count": 4}),
    ]
    m = server_metrics(samples)
    assert m["kv_blocks_used_peak"] == 31 and m["kv_blocks_total"] == 40
    assert m["prefix_hit_rate"] == 0.25  # (110 - 10) / (500 - 100)
    assert m["preemptions"] == 5
    assert (m["worker_idle_seconds_sum"], m["worker_idle_seconds_count"]) == (1.5, 4)
    assert "worker_idle_seconds_sum" not in server_metrics(samples[:2])
    assert server_metrics([]) is None


def test_prometheus_text_sums_labels_and_drops_buckets():
    text = """# HELP pagedserve_kv_blocks_used KV blocks
# TYPE pagedserve_kv_blocks_used gauge
pagedserve_kv_blocks_used{worker="a"} 3.0
pagedserve_kv_blocks_used{worker="b"} 4.0
# TYPE pagedserve_preemptions_total counter
pagedserve_preemptions_total 2.0
# TYPE pagedserve_ttft_seconds histogram
pagedserve_ttft_seconds_bucket{le="0.1"} 1.0
pagedserve_ttft_seconds_sum 0.05
pagedserve_ttft_seconds_count 1.0
# TYPE process_cpu_seconds_total counter
process_cpu_seconds_total 9.0
"""
    assert parse_prometheus(text) == {"pagedserve_kv_blocks_used": 7.0, "pagedserve_preemptions_total": 2.0,
                                      "pagedserve_ttft_seconds_sum": 0.05, "pagedserve_ttft_seconds_count": 1.0}


def test_arrivals_all_at_once_or_seeded_poisson():
    assert arrival_offsets(3, None, 0) == [0.0, 0.0, 0.0]
    a = arrival_offsets(50, 4.0, 1)
    assert a == arrival_offsets(50, 4.0, 1) and a != arrival_offsets(50, 4.0, 2)
    assert a[0] == 0.0 and all(x < y for x, y in zip(a, a[1:]))


def test_summary_markdown_names_every_figure():
    s = summarize([record(0, 0.0, [(0.5, 1), (1.0, 1)], 1.0)], [
        (0.0, {"pagedserve_kv_blocks_used": 0, "pagedserve_prefix_cache_queries_tokens_total": 0,
               "pagedserve_prefix_cache_hits_tokens_total": 0, "pagedserve_preemptions_total": 0}),
        (1.0, {"pagedserve_kv_blocks_used": 2, "pagedserve_prefix_cache_queries_tokens_total": 10,
               "pagedserve_prefix_cache_hits_tokens_total": 0, "pagedserve_preemptions_total": 0})])
    config = {"server": "127.0.0.1:1", "workload": "mixed", "seed": 0, "rate": None, "max_concurrency": None,
              "temperature": 0.0, "ignore_eos": True}
    text = render_summary(s, config)
    for name in ("requests/s", "output tokens/s", "total wall", "TTFT p50 / p90 / p99", "ITL p50 / p90 / p99",
                 "end-to-end p50 / p90 / p99", "KV blocks used (peak) | 2", "prefix cache hit rate | 0.0%",
                 "preemptions | 0", "1 completed, 0 failed"):
        assert name in text
    assert re.search(r"\| ITL p50 / p90 / p99 \| 0\.5000 / 0\.5000 / 0\.5000 s \|", text)
