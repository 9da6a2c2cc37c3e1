"""Batch invariance, end to end in one process: greedy tokens of held-out-style prompts alone, then beside random
concurrent requests, with chunked prefill, after forced preemptions and after a migration to another worker.

Run as `python -m tests.support.invariance --dtype D --kv-cache-dtype K` under a CPU path (PAGEDSERVE_CPU_PATH, set
before torch loads: tests/worker/test_batch_invariance.py starts one process per path); prints one JSON object:
{"batch_invariant": bool, "reason": str, "cases": {case: [tokens of each prompt]}, "preemptions": N}.
The production path end to end but for gRPC: the real Scheduler drives ModelRunners through serialized plans
(pagedserve_cli/bench/local_driver.py).
"""

from __future__ import annotations

import argparse
import json
import random

from pagedserve_common.sampling import SamplingParams
from pagedserve_cli.bench.local_driver import GREEDY, LocalDriver
from worker_svc import cpu_path

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived",
    "The three primary colors are",
    "Water boils at a temperature of",
    "In 1969, the first humans to walk on the Moon were",
    "A haiku about autumn leaves:\n",
    "To make a cup of tea, first",
]
NEW_TOKENS = 10
RESULT = "invariance-result: "


def _runner(loaded, kv_cache_dtype: str, num_blocks: int):
    """A worker's runner over `loaded` (runners share a loaded model's weights: the lean layout is made once)."""
    from worker_svc.kv_pool import KVPool
    from worker_svc.runner import ModelRunner
    from worker_svc.worker import make_backend

    pool = KVPool(loaded.kv_geometry(16, kv_cache_dtype), num_blocks)
    return ModelRunner(loaded, pool, make_backend("cpu", "cpu", pool.geometry), batch_invariant=True)


def _fresh(runner, budget: int) -> LocalDriver:
    """A driver (a new scheduler) over `runner` as a freshly started worker: nothing in its persistent batch."""
    from worker_svc.batch import PersistentBatch

    runner.batch = PersistentBatch()
    return LocalDriver(runner, max_num_batched_tokens=budget)


def _noise(rng: random.Random, vocab: int, n: int) -> list[tuple[list[int], int, SamplingParams]]:
    """n random requests: random token prompts of 5-90 tokens, 4-16 new tokens, half sampled at temperature 1."""
    out = []
    for i in range(n):
        prompt = [rng.randrange(100, vocab) for _ in range(rng.randint(5, 90))]
        sampling = GREEDY if i % 2 else SamplingParams(temperature=1.0, seed=rng.randrange(1 << 30))
        out.append((prompt, rng.randint(4, 16), sampling))
    return out


def run_cases(model_dir: str, dtype: str, kv_cache_dtype: str) -> dict:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tok(t)["input_ids"] for t in PROMPTS]
    from worker_svc.models import load_model

    loaded = load_model(model_dir, dtype=dtype)
    big = _runner(loaded, kv_cache_dtype, 256)
    small = _runner(loaded, kv_cache_dtype, 12)
    other = _runner(loaded, kv_cache_dtype, 256)  # the worker a migration moves to
    rng = random.Random(0)
    noise = _noise(rng, big.loaded.vocab_size, len(prompts))
    cases: dict[str, list[list[int]]] = {}

    alone, d = [], _fresh(big, 512)
    for p in prompts:  # one prompt at a time, each in a single chunk
        rid = d.add(p, NEW_TOKENS, arrival_step=d.step_id)
        alone.append(d.run()[rid][0])
    cases["alone"] = alone

    def crowd(runner, budget: int, move_after: int | None = None) -> tuple[list[list[int]], LocalDriver]:
        d = _fresh(runner, budget)
        ids = []
        for i, p in enumerate(prompts):  # each prompt beside random requests arriving before and after it
            prompt, new, sampling = noise[i]
            d.add(prompt, new, sampling, arrival_step=i)
            ids.append(d.add(p, NEW_TOKENS, arrival_step=i + rng.randint(0, 3)))
        if move_after is not None:
            d.run(max_steps=move_after)
            moved = _fresh(other, budget)
            d.move_to(moved)
            d = moved
        out = d.run()
        return [out[r][0] for r in ids], d

    cases["beside_8"], _ = crowd(big, 512)
    # 32 tokens a step: prompts split into chunks mixed with decodes; 192 token slots for 16 requests: preemptions
    cases["chunked_preempted"], pre = crowd(small, 32)
    cases["migrated"], _ = crowd(big, 64, move_after=10)
    return {"batch_invariant": big.batch_invariant, "reason": big.batch_invariant_reason, "cases": cases,
            "preemptions": pre.scheduler.num_preemptions, "cpu_path": cpu_path.current().name}


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False)
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--kv-cache-dtype", default="auto")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(2)
    # NOTE: one marked line: the worker's log lines share stdout
    print(RESULT + json.dumps(run_cases(args.model_dir, args.dtype, args.kv_cache_dtype)))


if __name__ == "__main__":
    main()
