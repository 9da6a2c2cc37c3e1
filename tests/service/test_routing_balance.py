"""kv routing with two real workers (issue 48): chat requests that all share one system prompt spread over both
workers, and each of them still gets prefix-cache hits on that prompt."""

from __future__ import annotations

import json
import threading
from collections import Counter

from pagedserve.v1 import generate_pb2 as pb
from pagedserve.v1 import generate_pb2_grpc
from tests.support.service import start_worker, started_service, stop_processes, wait_until

NUM_REQUESTS = 20
MAX_TOKENS = 16
SYSTEM = "You are a terse assistant for a small hardware shop. Answer every question in one short sentence."


def attached_workers(svc) -> list[str]:
    with svc.channel() as ch:
        info = generate_pb2_grpc.GenerationStub(ch).GetModelInfo(pb.GetModelInfoRequest(), timeout=60)
    return [w.worker_id for w in info.workers]


def chat_all_at_once(svc) -> list:
    """NUM_REQUESTS chat completions, released together (a barrier), so that they overlap on the workers."""
    results: list = [None] * NUM_REQUESTS
    barrier = threading.Barrier(NUM_REQUESTS)

    def one(i: int) -> None:
        with svc.openai_client(timeout=300) as client:
            barrier.wait(timeout=120)
            try:
                results[i] = client.chat.completions.create(
                    model=svc.model_dir, max_tokens=MAX_TOKENS, temperature=0, extra_body={"ignore_eos": True},
                    messages=[{"role": "system", "content": SYSTEM},
                              {"role": "user", "content": f"Question {i}: do you sell {i + 2} mm screws?"}])
            except Exception as e:  # noqa: BLE001 - reported by the assertion below
                results[i] = e

    threads = [threading.Thread(target=one, args=(i,)) for i in range(NUM_REQUESTS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)  # a hang guard, never a measure of speed
    return results


def finished_by_worker(log_text: str) -> Counter:
    lines = [json.loads(line) for line in log_text.splitlines() if '"request finished"' in line]
    return Counter(e["worker"] for e in lines if e.get("event") == "request finished")


def test_chat_requests_sharing_a_system_prompt_spread_over_two_workers_and_hit_the_cache_on_both(
        tiny_served_model, tmp_path):
    with started_service(tiny_served_model, log=tmp_path / "scheduler.log") as svc:  # --routing kv: the default
        second = start_worker(tmp_path / "worker-1.log", svc.worker_listen, tiny_served_model)
        try:
            wait_until(lambda: len(attached_workers(svc)) == 2)
            workers = attached_workers(svc)
            results = chat_all_at_once(svc)
            assert not [r for r in results if not hasattr(r, "usage")], results  # an error, or a hung request
            assert [r.usage.completion_tokens for r in results] == [MAX_TOKENS] * NUM_REQUESTS
            wait_until(lambda: sum(finished_by_worker(svc.log_since(0)).values()) == NUM_REQUESTS)
            served = finished_by_worker(svc.log_since(0))
            # Before issue 48's fix one worker took every request: each one "hit" the worker that served the first.
            assert set(served) == set(workers) and min(served.values()) >= 0.4 * NUM_REQUESTS, served
            hits = {w: svc.metric("pagedserve_prefix_cache_hits_tokens_total", worker=svc.worker_name(w))
                    for w in workers}
            assert all(h > 0 for h in hits.values()), hits  # the shared system prompt is reused on both
        finally:
            stop_processes([second])
