"""Scheduler-only simulation of routing over N fake workers: prefix hit rate, completion, per-worker load.

Two workloads: chat (every request shares ONE system prefix, over 2 workers: issue 48, where kv routing sent
every request to one worker; reported as `max_worker_share=`, the largest share of requests one worker took) and
multi-tenant (12 tenants' system prompts over 3 workers whose caches hold 2/3 of them; `hit_rate_kv=… ratio=…`).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import math
import os
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere without installing

from pagedserve_cli.bench.workloads import BenchRequest, TextSource, build_workload, chat_requests  # noqa: E402
from scheduler_svc.core.request import Request  # noqa: E402
from pagedserve_common.sampling import SamplingParams  # noqa: E402
from scheduler_svc.core.config import SchedulerConfig  # noqa: E402
from scheduler_svc.core.scheduler import Scheduler  # noqa: E402
from scheduler_svc.core.step import ScheduledStep  # noqa: E402
from scheduler_svc.routing import Router  # noqa: E402
from pagedserve_common.defaults import DEFAULT_MODEL  # noqa: E402

MAX_MODEL_LEN = 2048
# Step cost model, seconds: fixed + per scheduled token + per token of context of each scheduled sequence.
# Calibrated roughly on a 2-core CPU worker with the 135M model: a 512-token prefill step ~1.3 s
# (0.02 + 512 * 0.0025), a decode step of batch 64 at context 256 ~0.33 s (0.02 + 64 * 0.0025 + 64 * 257 * 9e-6).
# So a prefix hit on a ~500-token system prompt saves ~1.25 s of one worker's time.
STEP_FIXED_S, PER_TOKEN_S, PER_CONTEXT_TOKEN_S = 0.02, 0.0025, 9e-6


def step_seconds(scheduled_tokens: int, context_tokens: int) -> float:
    return STEP_FIXED_S + PER_TOKEN_S * scheduled_tokens + PER_CONTEXT_TOKEN_S * context_tokens


@dataclass
class SimWorker:
    worker_id: str
    scheduler: Scheduler
    step: ScheduledStep | None = None  # the step in flight; None: idle
    sampled: dict[int, int] = field(default_factory=dict)  # what the step in flight will "sample"
    busy_s: float = 0.0
    prefill_tokens: int = 0  # tokens computed that sampled nothing: prompts, and recomputes after preemption
    num_routed: int = 0


@dataclass
class PolicyResult:
    policy: str
    workers: list[SimWorker]
    num_outputs: dict[str, int]  # request_id -> output tokens received
    max_tokens: dict[str, int]
    hit_rate: float  # the KV managers' counters, as the server exports them (re-admissions count too)
    request_hit_rate: float  # cached prompt tokens at first admission / prompt tokens, once per request
    completion_s: float  # first arrival to last finish
    mean_ttft_s: float
    mean_e2e_s: float
    num_preemptions: int

    @property
    def max_over_mean_load(self) -> float:
        busy = [w.busy_s for w in self.workers]
        return max(busy) / statistics.fmean(busy) if any(busy) else 1.0

    @property
    def max_worker_share(self) -> float:
        """The largest share of the requests any one worker took (1/num_workers: perfectly spread)."""
        routed = [w.num_routed for w in self.workers]
        return max(routed) / sum(routed)


def chat_workload(tokenizer, num_requests: int, seed: int = 0, system_len: int = 0) -> list[BenchRequest]:
    """`pagedserve bench --workload chat`'s requests (workloads.chat_requests: user turns of 32 to 96 tokens, outputs
    lognormal, median 64, 16 to 256), optionally with a system message of `system_len` tokens instead of the
    template's default system prompt."""
    rng = random.Random(seed)
    outputs = [min(256, max(16, round(rng.lognormvariate(math.log(64), 0.8)))) for _ in range(num_requests)]
    return chat_requests(rng, tokenizer, TextSource(tokenizer), outputs, (32, 96), system_len)


def poisson_arrivals(n: int, rate: float, seed: int) -> list[float]:
    rng = random.Random(seed ^ 0x5EED)  # its own stream: the workload's draws stay those of build_workload
    t, out = 0.0, []
    for _ in range(n):
        out.append(t)
        t += rng.expovariate(rate)
    return out


def simulate(policy: str, requests: list[BenchRequest], arrivals: list[float], num_workers: int = 3,
             num_blocks: int = 256, block_size: int = 16, max_num_batched_tokens: int = 512,
             max_num_seqs: int = 64) -> PolicyResult:
    """Discrete-event run: each worker runs steps back to back while it has work; each arrival is routed at its
    time on the live scheduler states, so the kv router sees exactly what the real one would."""
    cfg = SchedulerConfig(num_blocks=num_blocks, max_model_len=MAX_MODEL_LEN, max_num_seqs=max_num_seqs,
                          max_num_batched_tokens=max_num_batched_tokens, block_size=block_size)
    seq_ids = itertools.count()  # shared, like the engine's: a seq_id names one sequence across the fleet
    workers = [SimWorker(f"w{i}", Scheduler(cfg, seq_ids)) for i in range(num_workers)]
    router = Router(policy)
    by_seq: dict[int, Request] = {}  # SequenceDelta carries no context length: read it off the Request
    reqs: dict[str, Request] = {}
    first_token: dict[str, float] = {}
    finished: dict[str, float] = {}
    num_outputs: dict[str, int] = {}
    steps: list[tuple[float, int, int]] = []  # (end time, tie-break, worker index) of the steps in flight
    order = itertools.count()

    def start_step(k: int, now: float) -> None:
        w = workers[k]
        w.step = w.scheduler.schedule()
        if w.step is None:
            return  # idle until the next request routed here
        plan = w.step.plan
        context, sampled = 0, {}
        for e in plan.new_seqs:
            ctx = e.num_computed_tokens + e.num_scheduled_tokens
            context += ctx
            sampled[e.seq_id] = (e.seq_id * 40503 + ctx) % 40000 + 100  # deterministic; EOS is ignored anyway
        for e in plan.running:
            ctx = by_seq[e.seq_id].num_computed_tokens + e.num_scheduled_tokens
            context += ctx
            sampled[e.seq_id] = (e.seq_id * 40503 + ctx) % 40000 + 100
        # NOTE: a token for every scheduled sequence; update() ignores those still in prefill.
        w.sampled = sampled
        scheduled = plan.num_scheduled_tokens
        d = step_seconds(scheduled, context)
        w.busy_s += d
        w.prefill_tokens += scheduled
        heapq.heappush(steps, (now + d, next(order), k))

    i = 0
    while i < len(requests) or steps:
        if i < len(requests) and (not steps or arrivals[i] < steps[0][0]):
            now, br = arrivals[i], requests[i]
            prompt = list(br.prompt_token_ids)
            rid = f"r{i}"
            i += 1
            d = router.choose(workers, prompt)
            k = next(j for j, w in enumerate(workers) if w.worker_id == d.worker_id)
            w = workers[k]
            req = Request(rid, prompt, SamplingParams(max_tokens=br.max_tokens, ignore_eos=True, seed=0),
                          arrival_time=now)
            w.scheduler.add_request(req)
            by_seq[req.seq_id], reqs[rid] = req, req
            w.num_routed += 1
            router.routed(rid, w.worker_id, prompt, block_size)
            if w.step is None:
                start_step(k, now)
            continue
        now, _, k = heapq.heappop(steps)
        w = workers[k]
        for out in w.scheduler.update(w.step, w.sampled):
            rid = out.request_id
            if rid not in first_token:
                first_token[rid] = now
                router.prefilled(rid)  # its prompt is in that worker's cache now
            num_outputs[rid] = num_outputs.get(rid, 0) + len(out.new_token_ids)
            w.prefill_tokens -= len(out.new_token_ids)  # a sampled token was a decode, not prefill work
            if out.finish_reason is not None:
                finished[rid] = now
        start_step(k, now)

    kvs = [w.scheduler.kv for w in workers]
    queries = sum(kv.prefix_query_tokens for kv in kvs)
    prompt_tokens = sum(len(r.prompt_token_ids) for r in reqs.values())
    return PolicyResult(
        policy, workers, num_outputs, {rid: r.sampling.max_tokens for rid, r in reqs.items()},
        hit_rate=sum(kv.prefix_hit_tokens for kv in kvs) / queries if queries else 0.0,
        request_hit_rate=sum(r.num_cached_prompt_tokens for r in reqs.values()) / prompt_tokens,
        completion_s=max(finished.values()) - arrivals[0],
        mean_ttft_s=statistics.fmean(first_token[rid] - r.arrival_time for rid, r in reqs.items()),
        mean_e2e_s=statistics.fmean(finished[rid] - r.arrival_time for rid, r in reqs.items()),
        num_preemptions=sum(w.scheduler.num_preemptions for w in workers))


def report(r: PolicyResult) -> None:
    ws = r.workers
    print(f"[{r.policy}] hit_rate={r.hit_rate:.3f} (per request {r.request_hit_rate:.3f}) "
          f"completion_s={r.completion_s:.1f} mean_ttft_s={r.mean_ttft_s:.2f} mean_e2e_s={r.mean_e2e_s:.2f} "
          f"preemptions={r.num_preemptions}")
    print(f"  busy_s={[round(w.busy_s, 1) for w in ws]} prefill_tokens={[w.prefill_tokens for w in ws]} "
          f"routed={[w.num_routed for w in ws]} max/mean busy={r.max_over_mean_load:.2f}")


def run_chat(args, tok) -> None:
    """Every request shares one system prefix (issue 48): kv routing must still spread them over the workers."""
    requests = chat_workload(tok, args.chat_requests, args.seed, args.chat_system_len)
    arrivals = poisson_arrivals(len(requests), args.chat_rate, args.seed)
    shared = len(os.path.commonprefix([r.prompt_token_ids for r in requests]))
    print(f"chat: {len(requests)} requests sharing a {shared}-token system prefix, {args.chat_workers} workers x "
          f"{args.num_blocks} KV blocks, rate {args.chat_rate}/s, last arrival {arrivals[-1]:.1f} s")
    shares = {}
    for policy in ("kv", "round-robin", "least-loaded"):
        r = simulate(policy, requests, arrivals, args.chat_workers, args.num_blocks, args.block_size,
                     args.max_num_batched_tokens, args.max_num_seqs)
        r.policy = f"chat {policy}"
        report(r)
        shares[policy] = r.max_worker_share
    print(f"max_worker_share={shares['kv']:.3f} (kv on chat; round-robin {shares['round-robin']:.3f}, "
          f"least-loaded {shares['least-loaded']:.3f})")


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__)
    ap.add_argument("--num-requests", type=int, default=600)
    ap.add_argument("--num-tenants", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--workers", type=int, default=3)
    ap.add_argument("--rate", type=float, default=2.0, help="Poisson arrivals, requests/s")
    ap.add_argument("--num-blocks", type=int, default=256, help="KV blocks per worker (default: cache pressure)")
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--model", default=DEFAULT_MODEL, help="only its tokenizer is used")
    ap.add_argument("--chat-requests", type=int, default=200, help="the chat workload's requests (0: skip it)")
    ap.add_argument("--chat-workers", type=int, default=2)
    ap.add_argument("--chat-rate", type=float, default=2.0, help="chat arrivals, requests/s (Poisson)")
    ap.add_argument("--chat-system-len", type=int, default=0,
                    help="tokens of the chat workload's one system message (0: the template's default system prompt)")
    args = ap.parse_args()

    from scheduler_svc.frontend.tokenizer import Tokenizer
    from worker_svc.model_store import resolve_model
    tok = Tokenizer.from_model_dir(resolve_model(args.model))
    if args.chat_requests:
        run_chat(args, tok)  # NOTE: first, so the multi-tenant lines stay the output's last, as parsers expect
    requests = build_workload("multi-tenant", tok, args.num_requests, args.seed, num_tenants=args.num_tenants,
                              max_model_len=MAX_MODEL_LEN)
    arrivals = poisson_arrivals(len(requests), args.rate, args.seed)
    # The system prompts are the leading tokens every request of a tenant shares.
    systems = {r.prompt_token_ids[:400] for r in requests}
    system_blocks = len(systems) * 500 // args.block_size
    print(f"multi-tenant: {len(requests)} requests, {len(systems)} tenants (~{system_blocks} blocks of system "
          f"prompts), {args.workers} workers x {args.num_blocks} KV blocks "
          f"({args.num_blocks / system_blocks:.2f}x all system prompts), rate {args.rate}/s, "
          f"last arrival {arrivals[-1]:.1f} s")
    results = {}
    for policy in ("kv", "round-robin", "least-loaded"):
        t0 = time.perf_counter()
        results[policy] = r = simulate(policy, requests, arrivals, args.workers, args.num_blocks, args.block_size,
                                       args.max_num_batched_tokens, args.max_num_seqs)
        report(r)
        print(f"  (simulated in {time.perf_counter() - t0:.1f} s)")
    kv, rr = results["kv"], results["round-robin"]
    print(f"max_over_mean_load_kv={kv.max_over_mean_load:.3f}")
    print(f"completion_s_kv={kv.completion_s:.1f} completion_s_rr={rr.completion_s:.1f}")
    print(f"hit_rate_kv={kv.hit_rate:.3f} hit_rate_rr={rr.hit_rate:.3f} "
          f"ratio={kv.hit_rate / rr.hit_rate if rr.hit_rate else float('inf'):.3f}")


if __name__ == "__main__":
    main()
