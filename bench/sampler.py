"""Sampler.sample's time per call: seeded rows at temperature 0.8, and with top_p 0.9, over a 49,152-token vocab.

    python bench/sampler.py [--rows 64] [--vocab 49152] [--calls 200] [--warmup 20] [--threads N] [--device cpu]

Each call is one decode step: the same fixed logits, every row with its own seed (as the scheduler assigns),
positions one further each call. The logits are Zipf-like (a random token order per row, logit -1.2 ln(rank)):
at temperature 0.8 the top 256 tokens hold ~95% of the mass, as in a language model's next-token distribution,
so top_p 0.9 takes the candidate path, not the full-sort fallback of a near-flat row. Prints the mean and median ms per call for each variant, and the ms of the
seeded uniforms alone (worker_svc.uniforms.seeded_uniforms). time.perf_counter around each call; on CUDA the
call is synchronised before the clock stops.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere without installing

from pagedserve_common.sampling import SamplingParams  # noqa: E402
from worker_svc.sampling import Sampler  # noqa: E402
from worker_svc.uniforms import seeded_uniforms  # noqa: E402

VARIANTS = {"temperature 0.8": {"temperature": 0.8}, "temperature 0.8, top_p 0.9": {"temperature": 0.8, "top_p": 0.9}}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_calls(fn, calls: int, warmup: int, device: torch.device) -> list[float]:
    """ms of each of `calls` calls of fn(call_index), after `warmup` untimed ones."""
    for i in range(warmup):
        fn(i)
    _sync(device)
    out = []
    for i in range(warmup, warmup + calls):
        t0 = time.perf_counter()
        fn(i)
        _sync(device)
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def zipf_logits(num_rows: int, vocab: int) -> torch.Tensor:
    """[num_rows, vocab] logits -1.2 ln(rank), each row's ranks a random permutation of the vocab."""
    g = torch.Generator().manual_seed(0)
    by_rank = -1.2 * torch.log(torch.arange(1, vocab + 1, dtype=torch.float32))
    return torch.stack([by_rank[torch.randperm(vocab, generator=g)] for _ in range(num_rows)])


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n")[0])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--vocab", type=int, default=49_152)  # the default model's (SmolLM2)
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--warmup", type=int, default=20)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    logits = zipf_logits(args.rows, args.vocab).to(device)
    seed_ids = [(0x9E3779B97F4A7C15 * (i + 1)) % 2**63 for i in range(args.rows)]  # 63-bit, like the scheduler's
    starts = [100 + 7 * i for i in range(args.rows)]
    sampler = Sampler()
    print(f"rows={args.rows} vocab={args.vocab} calls={args.calls} warmup={args.warmup} device={device} "
          f"threads={torch.get_num_threads()}")
    for name, settings in VARIANTS.items():
        opts = [SamplingParams(seed=seed, **settings) for seed in seed_ids]

        def call(step: int) -> None:
            sampler.sample(logits, opts, [start + step for start in starts])

        ms = time_calls(call, args.calls, args.warmup, device)
        print(f"sample [{name}]: mean {statistics.fmean(ms):.3f} ms/call, median {statistics.median(ms):.3f}")
    ms = time_calls(lambda step: seeded_uniforms(seed_ids, [start + step for start in starts]),
                    args.calls, args.warmup, device)
    print(f"seeded_uniforms alone: mean {statistics.fmean(ms):.4f} ms/call, median {statistics.median(ms):.4f}")


if __name__ == "__main__":
    main()
