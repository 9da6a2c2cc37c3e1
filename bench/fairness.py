"""Scheduler-only simulation of two tenants on one fake worker: a flood against a light stream, fcfs against fair.

Tenant A sends --flood long requests at once; tenant B one short request every --light-interval seconds. The real
Scheduler runs each step; a step takes bench/routing.py's calibrated cost model's time. Reported: B's TTFT alone
(no flood), under fcfs and under fair, and its floor on a step engine (the rest of the step in flight at its
arrival, then the whole next step: no scheduler can answer sooner); each tenant's share of the service over time;
the total throughput; and, with both tenants flooding, the largest difference of service received while both are
backlogged (requests waiting) against VTC's bound (2x the largest request cost: prefill_weight * prompt +
decode_weight * max_tokens).

    python bench/fairness.py [--flood 200] [--light 500]
"""

from __future__ import annotations

import argparse
import itertools
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere without installing
sys.path.insert(0, str(Path(__file__).resolve().parent))

from routing import step_seconds  # noqa: E402

from pagedserve_common.sampling import SamplingParams  # noqa: E402
from scheduler_svc.core.request import Request  # noqa: E402
from scheduler_svc.core.config import SchedulerConfig  # noqa: E402
from scheduler_svc.core.scheduler import Scheduler  # noqa: E402
from scheduler_svc.core.waiting import ServiceCounter  # noqa: E402


@dataclass
class Run:
    policy: str
    ttft: dict[str, list[float]] = field(default_factory=dict)  # tenant -> TTFTs
    # tenant -> each request's TTFT floor on a step engine: the rest of the step in flight at its arrival, then the
    # whole next step (the earliest one that can compute its prompt)
    floor: dict[str, list[float]] = field(default_factory=dict)
    served: list[tuple[float, dict[str, float]]] = field(default_factory=list)  # (time, tenant -> cumulative service)
    backlogged: list[tuple[float, frozenset[str]]] = field(default_factory=list)  # (time, tenants with some waiting)
    num_tokens: int = 0  # output tokens
    end_s: float = 0.0
    max_cost: float = 0.0  # the largest request's cost: prefill_weight * prompt + decode_weight * max_tokens
    num_policy_preemptions: int = 0


def simulate(policy: str, flood: int, light: int, interval: float, *, num_blocks: int, max_num_seqs: int,
             budget: int, flood_prompt: int, flood_output: int, light_prompt: int, light_output: int,
             second_flood: bool = False) -> Run:
    """Tenant A's `flood` requests at t=0 against tenant B's `light`, one every `interval` s; `second_flood`: tenant
    B floods like A instead (both backlogged: what VTC's bound is about)."""
    counter = ServiceCounter()
    s = Scheduler(SchedulerConfig(num_blocks=num_blocks, max_model_len=4096, max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=budget, block_size=16, scheduling_policy=policy),
                  service=counter)
    sizes = {"A": (flood_prompt, flood_output), "B": (flood_prompt, flood_output) if second_flood
             else (light_prompt, light_output)}
    arrivals = [(0.0, "A", i) for i in range(flood)]
    arrivals += ([(0.0, "B", k) for k in range(flood)] if second_flood
                 else [(0.05 + k * interval, "B", k) for k in range(light)])
    arrivals.sort()
    run = Run(policy)
    reqs: dict[str, Request] = {}
    first: set[str] = set()
    tokens = itertools.count(1000)
    served = {"A": 0.0, "B": 0.0}
    now, i = 0.0, 0
    w_p, w_d = counter.prefill_weight, counter.decode_weight
    run.max_cost = max(w_p * n_p + w_d * n_o for t, (n_p, n_o) in sizes.items() if (flood if t == "A" else
                                                                                    flood if second_flood else light))
    step_start, step_end = 0.0, 0.0
    arrived_in_step: dict[str, float] = {}  # request id -> the end of the step in flight when it arrived
    while i < len(arrivals) or s.has_unfinished_requests():
        while i < len(arrivals) and arrivals[i][0] <= now:
            at, tenant, k = arrivals[i]
            n_prompt, n_out = sizes[tenant]
            rid = f"{tenant}{k}"
            base = (i * 4099) % 40000  # NOTE: distinct first tokens: no prefix hits; the same on every run
            prompt = [(base + j) % 40000 + 100 for j in range(n_prompt)]
            reqs[rid] = r = Request(rid, prompt, SamplingParams(max_tokens=n_out, ignore_eos=True), arrival_time=at,
                                    tenant=tenant)
            s.add_request(r)
            # NOTE: the sim steps run back to back, so an arrival during a step waits for its end (`now`)
            arrived_in_step[rid] = now
            i += 1
        step = s.schedule()
        if step is None:  # idle until the next arrival
            now = arrivals[i][0]
            continue
        plan = step.plan
        by_seq = {r.seq_id: r for r in s.running}
        context = 0
        for e in (*plan.new_seqs, *plan.running):
            seq = by_seq[e.seq_id]
            context += seq.num_computed_tokens + e.num_scheduled_tokens
            # the work each tenant got this step, weighted as the fair policy counts it
            known = len(seq.all_token_ids) - seq.num_computed_tokens - 1
            pre = min(e.num_scheduled_tokens, max(0, known))
            served[seq.tenant] += w_p * pre + w_d * (e.num_scheduled_tokens - pre)
        step_start, now = now, now + step_seconds(plan.num_scheduled_tokens, context)
        sampled = {e.seq_id: next(tokens) for e in (*plan.new_seqs, *plan.running)}
        for out in s.update(step, sampled):
            run.num_tokens += len(out.new_token_ids)
            if out.request_id not in first:
                first.add(out.request_id)
                req = reqs[out.request_id]
                run.ttft.setdefault(req.tenant, []).append(now - req.arrival_time)
        for rid, t_free in list(arrived_in_step.items()):  # the floor: the step after the one in flight, whole
            if step_start >= t_free:
                req = reqs[rid]
                run.floor.setdefault(req.tenant, []).append(now - req.arrival_time)
                del arrived_in_step[rid]
        run.served.append((now, dict(served)))
        run.backlogged.append((now, frozenset(r.tenant for r in s.waiting)))
    run.end_s = now
    run.num_policy_preemptions = s.num_policy_preemptions
    return run


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def max_gap_while_backlogged(run: Run) -> float:
    """The largest |service A - service B| received since both turned backlogged, over every such interval."""
    gap, start = 0.0, None
    for (_, got), (_, waiting) in zip(run.served, run.backlogged):
        both = {"A", "B"} <= waiting
        if both and start is None:
            start = dict(got)
        if not both:
            start = None
        if start is not None:
            gap = max(gap, abs((got["A"] - start["A"]) - (got["B"] - start["B"])))
    return gap


def shares(run: Run, num_windows: int = 8) -> list[str]:
    """A's share of the service in each of num_windows equal windows of the run."""
    out, prev = [], {"A": 0.0, "B": 0.0}
    for w in range(1, num_windows + 1):
        t_end = run.end_s * w / num_windows
        cur = next((got for t, got in run.served if t >= t_end), run.served[-1][1])
        da, db = cur["A"] - prev["A"], cur["B"] - prev["B"]
        out.append(f"{da / (da + db):.2f}" if da + db else "-")
        prev = cur
    return out


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flood", type=int, default=200, help="tenant A's requests, all at t=0")
    ap.add_argument("--light", type=int, default=500,
                    help="tenant B's requests, one every --light-interval s (the default spans most of the flood)")
    ap.add_argument("--light-interval", type=float, default=2.0)
    ap.add_argument("--flood-prompt", type=int, default=1024)
    ap.add_argument("--flood-output", type=int, default=256)
    ap.add_argument("--light-prompt", type=int, default=64)
    ap.add_argument("--light-output", type=int, default=32)
    ap.add_argument("--num-blocks", type=int, default=8192)
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--max-num-batched-tokens", type=int, default=512)
    args = ap.parse_args()
    kw = dict(num_blocks=args.num_blocks, max_num_seqs=args.max_num_seqs, budget=args.max_num_batched_tokens,
              flood_prompt=args.flood_prompt, flood_output=args.flood_output, light_prompt=args.light_prompt,
              light_output=args.light_output)
    alone = simulate("fcfs", 0, args.light, args.light_interval, **kw)
    runs = {p: simulate(p, args.flood, args.light, args.light_interval, **kw) for p in ("fcfs", "fair")}
    # both tenants flood (half the requests each): VTC's bound is about backlogged tenants, which B alone rarely is
    floods = {p: simulate(p, max(1, args.flood // 2), 0, 0.0, second_flood=True, **kw) for p in ("fcfs", "fair")}
    b_alone = quantile(alone.ttft["B"], 0.9)
    print(f"tenant A: {args.flood} x ({args.flood_prompt} prompt + {args.flood_output} output) at t=0; tenant B: "
          f"{args.light} x ({args.light_prompt} + {args.light_output}), one every {args.light_interval} s")
    print(f"B alone: TTFT p50 {quantile(alone.ttft['B'], 0.5):.2f} s, p90 {b_alone:.2f} s")
    for p, r in runs.items():
        b = r.ttft.get("B", [])
        print(f"[{p}] B's TTFT p50 {quantile(b, 0.5):.2f} s, p90 {quantile(b, 0.9):.2f} s (its floor on a step engine: "
              f"p90 {quantile(r.floor.get('B', []), 0.9):.2f} s, the rest of the step in flight + the next step); "
              f"A's TTFT p50 {quantile(r.ttft['A'], 0.5):.1f} s; {r.num_tokens / r.end_s:.1f} output tok/s over "
              f"{r.end_s:.0f} s; A's share of the service by eighths of the run: {' '.join(shares(r))}; "
              f"{r.num_policy_preemptions} policy preemptions")
    for p, r in floods.items():
        print(f"[{p}, A and B both flood {max(1, args.flood // 2)}] A's share by eighths: {' '.join(shares(r))}; "
              f"max service gap while both backlogged {max_gap_while_backlogged(r):.0f} (VTC's bound "
              f"{2 * r.max_cost:.0f}); {r.num_tokens / r.end_s:.1f} output tok/s")
    fcfs, fair = runs["fcfs"], runs["fair"]
    over_bound = max(max_gap_while_backlogged(r) / (2 * r.max_cost) for r in (fair, floods["fair"]))
    print(f"ttft_p90_light_alone_s={b_alone:.3f} ttft_p90_light_fcfs_s={quantile(fcfs.ttft['B'], 0.9):.3f} "
          f"ttft_p90_light_fair_s={quantile(fair.ttft['B'], 0.9):.3f} "
          f"throughput_ratio_fair_vs_fcfs={(fair.num_tokens / fair.end_s) / (fcfs.num_tokens / fcfs.end_s):.3f} "
          f"max_service_gap_over_bound={over_bound:.3f}")


if __name__ == "__main__":
    main()
