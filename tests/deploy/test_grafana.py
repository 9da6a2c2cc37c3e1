"""deploy/grafana/pagedserve.json reads only series the scheduler exposes, through its two variables."""

from __future__ import annotations

from scheduler_svc.metrics import Metrics
from tests.support.promql import dashboard, dashboard_queries, panels, series_names

SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",), "info": ("_info",)}


def exposed() -> set[str]:
    """Every sample name the scheduler's registry can expose (labelled families before their first sample too)."""
    return {f.name + suffix for f in Metrics("m").registry.collect() for suffix in SUFFIXES.get(f.type, ("",))}


def test_every_dashboard_query_reads_series_the_scheduler_exposes():
    names = exposed()
    queries = dashboard_queries({"model_name": "m"})
    assert len(queries) >= 25
    for title, expr in queries:
        read = series_names(expr)
        assert read and read <= names, (title, read - names)


def test_the_dashboard_has_a_datasource_and_a_model_name_variable_and_every_panel_uses_the_datasource():
    d = dashboard()
    variables = {v["name"]: v for v in d["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource" and variables["datasource"]["query"] == "prometheus"
    assert "label_values(vllm:num_requests_running, model_name)" in variables["model_name"]["definition"]
    for p in panels(d["panels"]):
        assert p["datasource"]["uid"] == "${datasource}", p["title"]
        for t in p["targets"]:
            assert t["datasource"]["uid"] == "${datasource}", p["title"]
            if "vllm:" in t["expr"]:
                assert 'model_name="$model_name"' in t["expr"], (p["title"], t["expr"])
    titles = " ".join(p["title"] for p in panels(d["panels"])).lower()
    for topic in ("throughput", "time to first token", "inter-token", "end-to-end", "queue", "kv cache",
                  "prefix cache", "preemptions", "migrations", "idle"):
        assert topic in titles, topic
