"""Runners against a reference runner on the corpus: greedy agreement, then perplexity and KL (bench/*_accuracy.py)."""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pagedserve_cli.bench.greedy import Agreement, agreement, greedy_tokens, held_out_prompts
from pagedserve_cli.bench.perplexity import Scored, compare


@dataclass(slots=True)
class Accuracy:
    """One runner's figures against the reference's (the reference's own: perplexity, KL 0, agreement 1)."""

    scored: Scored
    agreement: Agreement
    delta_pct: float  # 100 x (perplexity / the reference's - 1)


def add_arguments(ap: argparse.ArgumentParser, num_tokens: int, kv_memory_help: str) -> None:
    """The flags of the model, the corpus slice, the greedy prompts and the runners (args for corpus() and
    measure_args())."""
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-tokens", type=int, default=num_tokens, help="tokens scored for perplexity and KL")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=256, help="prefill chunk (tokens per step)")
    ap.add_argument("--num-prompts", type=int, default=64, help="0: perplexity and KL only")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--num-new", type=int, default=128, help="greedy tokens per prompt")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--kv-memory", type=int, default=640, metavar="MIB", help=kv_memory_help)


def dtypes_arg(ap: argparse.ArgumentParser, value: str, reference: str, known: Sequence[str]) -> list[str]:
    """--dtypes' comma-separated list, the reference first (added when missing); a usage error naming any unknown."""
    dtypes = [reference] + [d for d in value.split(",") if d and d != reference]
    unknown = [d for d in dtypes if d not in known]
    if unknown:
        ap.error(f"--dtypes: unknown {unknown}; choose from {','.join(known)}")
    return dtypes


def corpus(ap: argparse.ArgumentParser, args: argparse.Namespace, model_dir: str) -> list[int]:
    """The corpus' token ids; a usage error when --num-tokens leaves none held out for the greedy prompts."""
    from pagedserve_cli.bench.corpus import corpus_token_ids

    text = corpus_token_ids(model_dir)
    if args.num_tokens >= len(text):
        ap.error(f"--num-tokens {args.num_tokens}: the corpus has {len(text)} tokens, some must be held out")
    return text


def measure_args(runners: Mapping[str, object], reference: str, text: Sequence[int],
                 args: argparse.Namespace) -> dict[str, Accuracy]:
    """measure() with add_arguments()' flags, after a line saying what is measured on what."""
    import torch

    from pagedserve_cli.bench.corpus import NAME

    backends = ", ".join(f"{d}: {r.backend.name}" for d, r in runners.items())
    print(f"# {NAME}: tokens 0..{args.num_tokens} of {len(text)}; window {args.window}, chunk {args.chunk}; "
          f"threads {torch.get_num_threads()}; backends {backends}; {platform.processor() or platform.machine()}",
          flush=True)
    return measure(runners, reference, text, args.num_tokens, args.window, args.chunk, args.num_prompts,
                   args.prompt_len, args.num_new)


def measure(runners: Mapping[str, object], reference: str, text: Sequence[int], num_tokens: int, window: int = 1024,
            chunk: int = 256, num_prompts: int = 64, prompt_len: int = 64, num_new: int = 128) -> dict[str, Accuracy]:
    """Greedy first (num_prompts held-out prompts of the text past the scored slice, num_new tokens each, all at
    once), then the perplexity of text[:num_tokens], with running figures after every window printed: a run cut
    short still tells something."""
    t0 = time.perf_counter()
    prompts = held_out_prompts(text, num_tokens, num_prompts, prompt_len) if num_prompts else []
    runs = {name: greedy_tokens(r, prompts, num_new, batch=max(1, len(prompts))) for name, r in runners.items()}
    agreements = {name: agreement(runs[reference], runs[name]) for name in runners}
    print(f"# greedy done at {time.perf_counter() - t0:.0f} s: " + " ".join(
        f"{d}={a.share:.4f}/first_divergence={a.mean_first_divergence:.2f}" for d, a in agreements.items()),
        flush=True)

    def progress(so_far: dict) -> None:
        print(f"# {time.perf_counter() - t0:.0f} s, {so_far[reference].num_tokens} tokens: " + " ".join(
            f"{d}={s.perplexity:.4f}/kl={s.mean_kl:.3e}" for d, s in so_far.items()), flush=True)

    scored = compare(runners, reference, text[:num_tokens], window, chunk, progress)
    print(f"# scored at {time.perf_counter() - t0:.0f} s", flush=True)
    base = scored[reference].perplexity
    return {name: Accuracy(scored[name], agreements[name], 100.0 * (scored[name].perplexity / base - 1.0))
            for name in runners}


def row(name: str, a: Accuracy, *extra: str) -> str:
    """A markdown row: name, perplexity, its change, mean KL, greedy agreement, mean first divergence, extra cells."""
    return (f"| {name} | {a.scored.perplexity:.4f} | {a.delta_pct:+.3f}% | {a.scored.mean_kl:.3e} | "
            f"{a.agreement.share:.4f} | {a.agreement.mean_first_divergence:.2f} |" + "".join(f" {c} |" for c in extra))


def header(first: str, reference: str, num_prompts: int, num_new: int, *extra: str) -> str:
    """row()'s header and the markdown rule under it."""
    cells = [first, "perplexity", f"vs {reference}", f"mean KL vs {reference}",
             f"greedy agreement ({num_prompts} x {num_new})", "tokens before first divergence (mean)", *extra]
    return "| " + " | ".join(cells) + " |\n|" + "---|" * len(cells)


def line(prefix: str, name: str, a: Accuracy) -> str:
    """One machine-readable line: `PREFIX dtype=NAME ppl=... greedy_agreement=...`."""
    return (f"{prefix} dtype={name} ppl={a.scored.perplexity:.4f} ppl_delta_pct={a.delta_pct:.3f} "
            f"kl={a.scored.mean_kl:.4e} greedy_agreement={a.agreement.share:.4f} "
            f"first_divergence_mean={a.agreement.mean_first_divergence:.2f} tokens={a.scored.num_tokens} "
            f"positions={a.agreement.num_positions}")
