"""A real Prometheus (Debian's `prometheus`) scrapes `pagedserve up` every 2 s while a short load runs; then
every query of the Grafana dashboard, the autoscaler's and the endpoint picker's metrics return data through its
HTTP API. Without the binary it skips, unless PAGEDSERVE_REQUIRE_PROMETHEUS=1 (.ci/run sets it), then it fails."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import threading
import time

import grpc
import httpx
import pytest

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc
from pagedserve_common.ports import free_port
from tests.support.service import wait_until
from tests.support import promql
from tests.support.processes import stop_all, up

NUM_REQUESTS = 36
MIN_LOAD_S = 20  # ten scrapes
# NOTE: the labels a Kubernetes scrape (a ServiceMonitor on Service pagedserve-metrics) would put on the series, so
# that queries written for the cluster select them here too.
TARGET_LABELS = {"namespace": "pagedserve", "service": "pagedserve-metrics", "pod": "pagedserve-scheduler-0",
                 "container": "scheduler"}


def prometheus_binary() -> str:
    exe = shutil.which("prometheus")
    if exe is None:
        reason = "Debian's `prometheus` is not installed (apt-get install -y prometheus; .ci/run installs it)"
        if os.environ.get("PAGEDSERVE_REQUIRE_PROMETHEUS") == "1":
            pytest.fail(reason)
        pytest.skip(reason)
    return exe


class Prometheus:
    """A prometheus process scraping `target` (HOST:PORT) every 2 s, its storage in `tmp`."""

    def __init__(self, exe: str, target: str, tmp) -> None:
        self.address = f"127.0.0.1:{free_port()}"
        labels = "".join(f"\n          {k}: {v}" for k, v in TARGET_LABELS.items())
        config = tmp / "prometheus.yml"
        # NOTE: a scrape may take 2 s (its timeout; at 1 s a loaded machine's slow scrapes failed, and a failed
        # scrape marks every series stale)
        config.write_text(f"""global:
  scrape_interval: 2s
  scrape_timeout: 2s
  evaluation_interval: 2s
scrape_configs:
  - job_name: pagedserve
    static_configs:
      - targets: ["{target}"]
        labels:{labels}
""")
        self.log = tmp / "prometheus.log"
        with open(self.log, "wb") as err:
            self.proc = subprocess.Popen([exe, f"--config.file={config}", f"--storage.tsdb.path={tmp / 'data'}",
                                          f"--web.listen-address={self.address}", "--log.level=warn"],
                                         stdout=subprocess.DEVNULL, stderr=err)

    def ready(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text()[-2000:]
        try:
            return httpx.get(f"http://{self.address}/-/ready", timeout=10).status_code == 200
        except httpx.HTTPError:
            return False

    def query(self, expr: str) -> list[dict]:
        """The instant vector (or scalar, as one sample) of `expr` now; fails on a PromQL error."""
        r = httpx.get(f"http://{self.address}/api/v1/query", params={"query": expr}, timeout=60)
        body = r.json()
        assert r.status_code == 200 and body["status"] == "success", (expr, body)
        data = body["data"]
        return data["result"] if data["resultType"] == "vector" else [{"metric": {}, "value": data["result"]}]

    def total(self, expr: str) -> float:
        return sum(float(s["value"][1]) for s in self.query(expr))

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()


def load(listen: str) -> int:
    """At least NUM_REQUESTS streamed requests, 6 at a time, for at least MIN_LOAD_S (the tiny model answers in
    milliseconds: a shorter load could fall between two scrapes): a shared prefix (prefix-cache hits), n = 2 now and
    then, one ended by a stop token; each waits for its stream's end. Returns the number of samples (ends)."""
    prefix = "You are a helpful assistant. Answer in one short sentence, and never more than that. "
    errors: list[BaseException] = []

    def one(i: int) -> None:
        sampling = pb.SamplingParams(max_tokens=8 + i % 5 * 6, temperature=0, ignore_eos=True, n=2 if i % 6 == 0
                                     else 1)
        try:
            with grpc.insecure_channel(listen) as ch:
                list(generate_pb2_grpc.GenerationStub(ch).Generate(pb.GenerateRequest(
                    prompt=f"{prefix}Question {i}: what is {i} plus {i}?", sampling=sampling), timeout=300))
        except BaseException as e:  # noqa: BLE001 - re-raised below, in the test's thread
            errors.append(e)

    start, i = time.monotonic(), 0
    while i < NUM_REQUESTS or time.monotonic() - start < MIN_LOAD_S:
        threads = [threading.Thread(target=one, args=(j,)) for j in range(i, i + 6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors[0]
        i += 6
    return i + i // 6  # NOTE: one request in 6 has n = 2


def test_every_dashboard_autoscaler_and_endpoint_picker_query_returns_data(tiny_served_model, tmp_path):
    exe = prometheus_binary()
    autoscale, epp = promql.autoscale_queries(), promql.epp_metrics()
    if promql.OVERLAYS_REQUIRED:
        assert autoscale, f"no ScaledObject query in {promql.OVERLAYS / promql.AUTOSCALE}"
        assert epp, f"no vllm: metric in the endpoint picker's config in {promql.OVERLAYS / promql.GATEWAY}"
    listen, metrics = f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"
    with open(tmp_path / "up.log", "w") as err:
        proc = up(tiny_served_model, listen, "--metrics", metrics, "--workers", "2", stderr=err)
    prom = None
    try:
        line = proc.stdout.readline()
        assert line.startswith(f"pagedserve is up: {listen}"), line + (tmp_path / "up.log").read_text()[-2000:]
        prom = Prometheus(exe, metrics, tmp_path)
        wait_until(prom.ready, timeout=120, interval=0.5)
        wait_until(lambda: prom.total('up{job="pagedserve"}') == 1, timeout=120, interval=0.5)
        wait_until(lambda: prom.total("sum(pagedserve_workers)") == 2, timeout=120, interval=0.5)
        samples = load(listen)  # then every request's end scraped
        wait_until(lambda: prom.total("sum(vllm:request_success_total)") == samples, timeout=120, interval=0.5)
        time.sleep(5)  # NOTE: a few more scrapes, so that every rate() window holds the last observations

        with grpc.insecure_channel(listen) as ch:  # NOTE: the id /v1/models lists, the model_name label
            model = generate_pb2_grpc.GenerationStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=60).model_id
        queries = [(f"dashboard {title}", expr) for title, expr in promql.dashboard_queries({"model_name": model})]
        queries += [("autoscaler", q) for q in autoscale or ()]
        queries += [(f"endpoint picker {name}", name) for name in epp or ()]
        queries += [("endpoint picker (protocol)", name) for name in ("vllm:num_requests_waiting",
                    "vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:cache_config_info")]
        empty = [(what, expr) for what, expr in queries
                 if not any(math.isfinite(float(s["value"][1])) for s in prom.query(expr))]
        assert not empty, f"{len(empty)} of {len(queries)} queries returned no data: {empty}"
        assert prom.total(f'sum(vllm:generation_tokens_total{{model_name="{model}"}})') > 0
        assert 0 < prom.total("max_over_time(vllm:kv_cache_usage_perc[5m])") <= 1
        info = prom.query("vllm:cache_config_info")[0]["metric"]
        assert int(info["num_gpu_blocks"]) == prom.total("sum(pagedserve_kv_blocks_total)")
    finally:
        if prom is not None:
            prom.stop()
        stop_all(proc)
