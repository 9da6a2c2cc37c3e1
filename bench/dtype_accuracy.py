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
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedserve_cli.bench.accuracy import (add_arguments, corpus, dtypes_arg, header, line,  # noqa: E402
                                           measure_args, row)
from pagedserve_cli.bench.perplexity import scoring_runner  # noqa: E402
from worker_svc.cpu_features import NATIVE_BF16_FLAGS, cpu_flags  # noqa: E402
from worker_svc.model_store import resolve_model  # noqa: E402
from worker_svc.models import resolve_dtype  # noqa: E402

DTYPES = ("float32", "bfloat16", "float16")
REFERENCE = "float32"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--dtypes", default="bfloat16", help="comma-separated weight dtypes (float32 is added)")
    add_arguments(ap, 4096, "each pool's size")
    args = ap.parse_args(argv)
    dtypes = dtypes_arg(ap, args.dtypes, REFERENCE, DTYPES)

    model_dir = str(resolve_model(args.model))
    auto = resolve_dtype("auto", "cpu", json.loads(Path(model_dir, "config.json").read_text()))
    flags = " ".join(f for f in NATIVE_BF16_FLAGS if f in cpu_flags()) or "none of " + " ".join(NATIVE_BF16_FLAGS)
    print(f"# auto here: {auto.name} ({auto.reason}); bfloat16 flags: {flags}", flush=True)
    text = corpus(ap, args, model_dir)
    runners = {d: scoring_runner(model_dir, "auto", kv_memory=args.kv_memory << 20, threads=args.threads, dtype=d)
               for d in dtypes}
    got = measure_args(runners, REFERENCE, text, args)
    print("\n" + header("weights and cache", REFERENCE, args.num_prompts, args.num_new))
    print("\n".join(row(d, got[d]) for d in dtypes))
    print()
    print("\n".join(line("dtype_accuracy", d, got[d]) for d in dtypes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
