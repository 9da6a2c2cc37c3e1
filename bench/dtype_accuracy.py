"""What `--dtype auto` costs in accuracy: bfloat16 weights and cache against float32, on Newton's Opticks.

    python bench/dtype_accuracy.py --threads 1 --num-tokens 4096          # README "Which dtype `auto` picks"
    python bench/dtype_accuracy.py --num-tokens 50000 --threads 2         # the long version (tens of minutes)

Two workers' runners as `pagedserve worker` builds them, on the default model: `--dtype float32` (the exact path)
and each of --dtypes (default bfloat16, what `auto` picks on a CPU with AVX512-BF16 or AMX), each with its cache in
its own dtype (`--kv-cache-dtype auto`), through the real ModelRunner, paged pool and attention backend.
Teacher-forced perplexity of the first --num-tokens tokens of the corpus (windows of --window tokens prefilled
--chunk tokens per step), its change against float32, the mean KL(p_float32 || p_dtype) of the next-token
distributions, and greedy agreement: --num-prompts held-out prompts of --prompt-len tokens (spread over the text past
the scored slice) decoded --num-new tokens each, the share of positions whose token equals float32's and the mean
number of tokens before the first difference. Prints what `auto` picks on this CPU and why, a markdown table, then
one `dtype_accuracy dtype=...` line each.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedserve_cli.bench.accuracy import header, line, measure, row  # noqa: E402
from pagedserve_cli.bench.corpus import NAME, corpus_token_ids  # noqa: E402
from pagedserve_cli.bench.perplexity import scoring_runner  # noqa: E402
from worker_svc.cpu_features import NATIVE_BF16_FLAGS, cpu_flags  # noqa: E402
from worker_svc.model_store import resolve_model  # noqa: E402
from worker_svc.models import resolve_dtype  # noqa: E402

DTYPES = ("float32", "bfloat16", "float16")
REFERENCE = "float32"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--dtypes", default="bfloat16", help="comma-separated weight dtypes (float32 is added)")
    ap.add_argument("--num-tokens", type=int, default=4096, help="tokens scored for perplexity and KL")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk (tokens per step)")
    ap.add_argument("--num-prompts", type=int, default=64, help="0: perplexity and KL only")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--num-new", type=int, default=128, help="greedy tokens per prompt")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--kv-memory", type=int, default=640, metavar="MIB", help="each pool's size")
    args = ap.parse_args(argv)
    dtypes = [REFERENCE] + [d for d in args.dtypes.split(",") if d and d != REFERENCE]
    unknown = [d for d in dtypes if d not in DTYPES]
    if unknown:
        ap.error(f"--dtypes: unknown {unknown}; choose from {','.join(DTYPES)}")

    model_dir = str(resolve_model(args.model))
    auto = resolve_dtype("auto", "cpu", json.loads(Path(model_dir, "config.json").read_text()))
    flags = " ".join(f for f in NATIVE_BF16_FLAGS if f in cpu_flags()) or "none of " + " ".join(NATIVE_BF16_FLAGS)
    print(f"# auto here: {auto.name} ({auto.reason}); bfloat16 flags: {flags}", flush=True)
    text = corpus_token_ids(model_dir)
    if args.num_tokens >= len(text):
        ap.error(f"--num-tokens {args.num_tokens}: the corpus has {len(text)} tokens, some must be held out")
    runners = {d: scoring_runner(model_dir, "auto", kv_memory=args.kv_memory << 20, threads=args.threads, dtype=d)
               for d in dtypes}
    backends = ", ".join(f"{d}: {r.backend.name}" for d, r in runners.items())
    print(f"# {NAME}: tokens 0..{args.num_tokens} of {len(text)}; window {args.window}, chunk {args.chunk}; "
          f"threads {torch.get_num_threads()}; backends {backends}; {platform.processor() or platform.machine()}",
          flush=True)
    got = measure(runners, REFERENCE, text, args.num_tokens, args.window, args.chunk, args.num_prompts,
                  args.prompt_len, args.num_new)
    print("\n" + header("weights and cache", REFERENCE, args.num_prompts, args.num_new))
    print("\n".join(row(d, got[d]) for d in dtypes))
    print()
    print("\n".join(line("dtype_accuracy", d, got[d]) for d in dtypes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
