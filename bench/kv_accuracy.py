"""Accuracy of each KV cache dtype against the float32 cache, on Newton's Opticks, through the worker's runner.

    python bench/kv_accuracy.py --threads 2                      # every dtype, 50,000 tokens (tens of minutes)
    python bench/kv_accuracy.py --dtypes float32,int8 --num-tokens 4096

For each cache dtype, on the default model (SmolLM2-135M-Instruct, float32 weights) with one paged pool per dtype
(the weights shared): teacher-forced perplexity of the first --num-tokens tokens of the corpus (windows of
--window tokens, each one sequence prefilled --chunk tokens per step, so every chunk attends to the KV the
earlier ones left in the pool), its change against float32, the mean KL(p_float32 || p_dtype) of the next-token
distributions over the same tokens, and greedy agreement: 64 held-out prompts of 64 tokens (spread over the text
past the scored slice) decoded 128 tokens each through ModelRunner.step, the share of the 64 x 128 positions whose
token equals float32's and the mean number of tokens before the first difference.

Bounds the default choice must meet (issue 25): int8 perplexity within 1% of float32, fp8_e4m3 within 3%; the
other dtypes are reported without a bound. Prints a markdown table, then one `kv_accuracy dtype=...` line each.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedserve_cli.bench.accuracy import (add_arguments, corpus, dtypes_arg, header, line,  # noqa: E402
                                           measure_args, row)
from pagedserve_cli.bench.perplexity import scoring_runner, sibling_runner  # noqa: E402
from worker_svc.model_store import resolve_model  # noqa: E402

DTYPES = ("float32", "bfloat16", "float16", "int8", "fp8_e4m3", "fp8_e5m2")
REFERENCE = "float32"
BOUNDS_PCT = {"int8": 1.0, "fp8_e4m3": 3.0}  # perplexity within this % of float32's


def verdict(dtype: str, delta_pct: float) -> str:
    bound = BOUNDS_PCT.get(dtype)
    if bound is None:
        return "-"
    return f"{'PASS' if abs(delta_pct) <= bound else 'FAIL'} (<= {bound:g}%)"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default=",".join(DTYPES), help="comma-separated cache dtypes (float32 is added)")
    ap.add_argument("--attention-backend", default="auto", choices=("auto", "cpu", "torch", "cupy"))
    add_arguments(ap, 50_000, "the float32 pool's size")
    args = ap.parse_args(argv)
    dtypes = dtypes_arg(ap, args.dtypes, REFERENCE, DTYPES)

    model_dir = str(resolve_model(args.model))
    text = corpus(ap, args, model_dir)
    # NOTE: every pool gets the float32 pool's block count (--kv-memory of float32: 640 MiB holds 910 blocks of
    # the default model), enough for a window or all the prompts decoded at once; both say so if it is not.
    ref = scoring_runner(model_dir, REFERENCE, args.attention_backend, kv_memory=args.kv_memory << 20,
                         threads=args.threads)
    runners = {REFERENCE: ref, **{d: sibling_runner(ref, d, args.attention_backend) for d in dtypes[1:]}}
    got = measure_args(runners, REFERENCE, text, args)
    print("\n" + header("cache dtype", REFERENCE, args.num_prompts, args.num_new, "bound"))
    print("\n".join(row(d, got[d], verdict(d, got[d].delta_pct)) for d in dtypes))
    print()
    print("\n".join(f"{line('kv_accuracy', d, got[d])} bound={verdict(d, got[d].delta_pct).split(' ')[0]}"
                    for d in dtypes))
    return 1 if any(verdict(d, got[d].delta_pct).startswith("FAIL") for d in dtypes) else 0


if __name__ == "__main__":
    sys.exit(main())
