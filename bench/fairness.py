"""Scheduler-only simulation of two tenants on one fake worker: a flood against a light stream, fcfs against fair.

Tenant A sends --flood long requests at once; tenant B one short request every --light-interval seconds. The real
Scheduler runs each step; a step takes bench/routing.py's calibrated cost model's time. Reported: B's TTFT alone
(no flood), under fcfs and under fair; each tenant's share of the service over time; the total throughput; and the
largest difference of service received by the two while both are backlogged (requests waiting), against VTC's bound
(2x the largest request cost: prefill_weight * prompt + decode_weight * max_tokens).

    python bench/fairness.py [--flood 200] [--light 40]
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
from scheduler_svc.core.scheduler import Scheduler, SchedulerConfig  # noqa: E402
from scheduler_svc.core.waiting import ServiceCounter  # noqa: E402


@dataclass
class Run:
    policy: str
    ttft: dict[str, list[float]] = field(default_factory=dict)  # tenant -> TTFTs
    served: list[tuple[float, float, float]] = field(default_factory=list)  # (time, A's, B's cumulative service)
    backlogged: list[tuple[float, bool]] = field(default_factory=list)  # (time, both tenants have requests waiting)
    num_tokens: int = 0  # output tokens
    end_s: float = 0.0
    max_cost: float = 0.0


def simulate(policy: str, flood: int, light: int, interval: float, *, num_blocks: int, max_num_seqs: int,
             budget: int, flood_prompt: int, flood_output: int, light_prompt: int, light_output: int) -> Run:
    counter = ServiceCounter()
    s = Scheduler(SchedulerConfig(num_blocks=num_blocks, max_model_len=4096, max_num_seqs=max_num_seqs,
                                  max_num_batched_tokens=budget, block_size=16, scheduling_policy=policy),
                  service=counter)
    arrivals = [(0.0, "A", i) for i in range(flood)] + [(0.05 + k * interval, "B", k) for k in range(light)]
    arrivals.sort()
    run = Run(policy)
    reqs: dict[str, Request] = {}
    first: set[str] = set()
    tokens = itertools.count(1000)
    served = {"A": 0.0, "B": 0.0}
    now, i = 0.0, 0
    w_p, w_d = counter.prefill_weight, counter.decode_weight
    run.max_cost = max(w_p * flood_prompt + w_d * flood_output if flood else 0.0,
                       w_p * light_prompt + w_d * light_output if light else 0.0)
    while i < len(arrivals) or s.has_unfinished_requests():
        while i < len(arrivals) and arrivals[i][0] <= now:
            at, tenant, k = arrivals[i]
            n_prompt, n_out = (flood_prompt, flood_output) if tenant == "A" else (light_prompt, light_output)
            rid = f"{tenant}{k}"
            base = (i * 4099) % 40000  # NOTE: distinct first tokens: no prefix hits; the same on every run
            prompt = [(base + j) % 40000 + 100 for j in range(n_prompt)]
            reqs[rid] = r = Request(rid, prompt, SamplingParams(max_tokens=n_out, ignore_eos=True), arrival_time=at,
                                    tenant=tenant)
            s.add_request(r)
            i += 1
        plan = s.schedule()
        if plan is None:  # idle until the next arrival
            now = arrivals[i][0]
            continue
        by_seq = {r.seq_id: r for r in s.running}
        context = 0
        for e in (*plan.new_seqs, *plan.running):
            seq = by_seq[e.seq_id]
            context += seq.num_computed_tokens + e.num_scheduled_tokens
            # the work each tenant got this step, weighted as the fair policy counts it
            known = len(seq.all_token_ids) - seq.num_computed_tokens - 1
            pre = min(e.num_scheduled_tokens, max(0, known))
            served[seq.tenant] += w_p * pre + w_d * (e.num_scheduled_tokens - pre)
        now += step_seconds(plan.num_scheduled_tokens, context)
        sampled = {e.seq_id: next(tokens) for e in (*plan.new_seqs, *plan.running)}
        for out in s.update(plan, sampled):
            run.num_tokens += len(out.new_token_ids)
            if out.request_id not in first:
                first.add(out.request_id)
                req = reqs[out.request_id]
                run.ttft.setdefault(req.tenant, []).append(now - req.arrival_time)
        waiting = {r.tenant for r in s.waiting}
        run.served.append((now, served["A"], served["B"]))
        run.backlogged.append((now, waiting == {"A", "B"}))
    run.end_s = now
    return run


def quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")


def max_gap_while_backlogged(run: Run) -> float:
    """The largest |service A - service B| received since both turned backlogged, over every such interval."""
    gap, start = 0.0, None
    for (t, a, b), (_, both) in zip(run.served, run.backlogged):
        if both and start is None:
            start = (a, b)
        if not both:
            start = None
        if start is not None:
            gap = max(gap, abs((a - start[0]) - (b - start[1])))
    return gap


def shares(run: Run, num_windows: int = 8) -> list[str]:
    """A's share of the service in each of num_windows equal windows of the run."""
    out, prev = [], (0.0, 0.0, 0.0)
    for w in range(1, num_windows + 1):
        t_end = run.end_s * w / num_windows
        cur = next(((t, a, b) for t, a, b in run.served if t >= t_end), run.served[-1])
        da, db = cur[1] - prev[1], cur[2] - prev[2]
        out.append(f"{da / (da + db):.2f}" if da + db else "-")
        prev = cur
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--flood", type=int, default=200, help="tenant A's requests, all at t=0")
    ap.add_argument("--light", type=int, default=40, help="tenant B's requests, one every --light-interval s")
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
    b_alone = quantile(alone.ttft["B"], 0.9)
    print(f"tenant A: {args.flood} x ({args.flood_prompt} prompt + {args.flood_output} output) at t=0; tenant B: "
          f"{args.light} x ({args.light_prompt} + {args.light_output}), one every {args.light_interval} s")
    print(f"B alone: TTFT p50 {quantile(alone.ttft['B'], 0.5):.2f} s, p90 {b_alone:.2f} s")
    for p, r in runs.items():
        b = r.ttft.get("B", [])
        print(f"[{p}] B's TTFT p50 {quantile(b, 0.5):.2f} s, p90 {quantile(b, 0.9):.2f} s; A's TTFT p50 "
              f"{quantile(r.ttft['A'], 0.5):.1f} s; {r.num_tokens / r.end_s:.1f} output tok/s over {r.end_s:.0f} s; "
              f"A's share of the service by eighths of the run: {' '.join(shares(r))}; "
              f"max service gap while both backlogged {max_gap_while_backlogged(r):.0f} (bound {2 * r.max_cost:.0f})")
    fcfs, fair = runs["fcfs"], runs["fair"]
    print(f"ttft_p90_light_alone_s={b_alone:.3f} ttft_p90_light_fcfs_s={quantile(fcfs.ttft['B'], 0.9):.3f} "
          f"ttft_p90_light_fair_s={quantile(fair.ttft['B'], 0.9):.3f} "
          f"throughput_ratio_fair_vs_fcfs={(fair.num_tokens / fair.end_s) / (fcfs.num_tokens / fcfs.end_s):.3f} "
          f"max_service_gap_over_bound={max_gap_while_backlogged(fair) / (2 * fair.max_cost):.3f}")


if __name__ == "__main__":
    main()
