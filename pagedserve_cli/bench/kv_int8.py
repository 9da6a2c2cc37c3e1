"""`--compare kv-int8`: a float32 KV cache vs an int8 one in the same pool bytes: capacity, concurrency, perplexity."""

from __future__ import annotations

import json
import math
import sys
from dataclasses import dataclass
from pathlib import Path

from pagedserve_common.kv_geometry import KVGeometry

# The cache dtypes whose capacity the comparison prints (issue 25's "Capacity" figures).
CAPACITY_DTYPES = ("float32", "bfloat16", "int8", "fp8_e4m3")
BASE, QUANT = "float32", "int8"  # the two sides, as --kv-cache-dtype spells them
CAPACITY_KV_MEMORY = 512 << 20  # the issue's capacity figures are at --kv-memory 512MiB, whatever the run's


@dataclass(slots=True, frozen=True)
class Capacity:
    """One cache dtype's pool at a byte budget."""

    dtype: str
    bytes_per_token: int
    num_blocks: int
    block_size: int

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size


def capacities(config: dict, kv_memory: int, dtypes: tuple[str, ...] = CAPACITY_DTYPES) -> list[Capacity]:
    """Blocks per cache dtype for a HuggingFace config.json at `kv_memory` bytes (as the worker sizes its pool)."""
    out = []
    for dtype in dtypes:
        g = KVGeometry.from_config(config, dtype)
        out.append(Capacity(dtype, g.bytes_per_token, g.num_blocks_for(kv_memory), g.block_size))
    return out


def model_capacities(model_dir: str, kv_memory: int) -> list[Capacity]:
    return capacities(json.loads((Path(model_dir) / "config.json").read_text(encoding="utf-8")), kv_memory)


def capacity_lines(budgets: dict[str, list[Capacity]]) -> list[str]:
    """One row per cache dtype: bytes per token, then blocks (and x float32's) at each budget (name -> capacities)."""
    head = "| KV cache | bytes per token |" + "".join(f" blocks at {b} | x float32 |" for b in budgets)
    rows = [head, "|" + " --- |" * (2 + 2 * len(budgets))]
    columns = list(budgets.values())
    for i, c in enumerate(columns[0]):
        cells = "".join(f" {caps[i].num_blocks:,} | {_ratio(caps[i].num_blocks, caps[0].num_blocks):.2f} |"
                        for caps in columns)
        rows.append(f"| {c.dtype} | {c.bytes_per_token:,} |{cells}")
    return rows


def _ratio(a: float | None, b: float | None) -> float:
    return a / b if a is not None and b else float("nan")


def _f(value: float | None, fmt: str) -> str:
    return "n/a" if value is None or (isinstance(value, float) and math.isnan(value)) else format(value, fmt)


def last_line(blocks: tuple[int, int], mean_running: tuple[float | None, float | None],
              output_tok_s: tuple[float, float], ppl: tuple[float, float]) -> str:
    """Each pair is (float32, int8): the ratios are int8 over float32; ppl_delta_pct = 100 x (int8 / float32 - 1)."""
    return (f"blocks_ratio={_ratio(blocks[1], blocks[0]):.4f} "
            f"concurrency_ratio={_ratio(mean_running[1], mean_running[0]):.2f} "
            f"throughput_ratio={_ratio(output_tok_s[1], output_tok_s[0]):.2f} "
            f"ppl_delta_pct={100 * (_ratio(ppl[1], ppl[0]) - 1):.2f}")


def measure_perplexity(model_dir: str, num_tokens: int, threads: int | None, dtype: str = "float32") -> dict:
    """Teacher-forced perplexity of the same corpus slice through a float32-cache and an int8-cache worker runner
    with the servers' weights `dtype` (run in this process after the servers stopped, so it never shares the CPU
    with them)."""
    import gc

    from pagedserve_cli.bench.corpus import NAME, corpus_token_ids
    from pagedserve_cli.bench.perplexity import perplexity, scoring_runner

    token_ids = corpus_token_ids(model_dir, num_tokens)
    out = {"corpus": NAME, "num_tokens": len(token_ids)}
    for cache in (BASE, QUANT):
        print(f"pagedserve bench: perplexity with the {cache} cache over {len(token_ids):,} tokens",
              file=sys.stderr, flush=True)
        runner = scoring_runner(model_dir, cache, threads=threads, dtype=dtype)
        out[cache] = perplexity(runner, token_ids).perplexity
        del runner
        gc.collect()
    return out


def side_lines(results: list, ppl: dict) -> tuple[list[str], str]:
    """The sides' table and the last line (results: the float32 side, then the int8 side)."""
    rows = ["| side | KV cache | blocks | mean running | peak running | preemptions | output tok/s | TTFT p50 | "
            "wall | perplexity |", "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in results:
        u, s, m = r.usage, r.summary, r.summary.get("server") or {}
        dtype = ",".join(w["dtype"] for w in r.workers) or "n/a"
        rows.append(f"| {r.side.name} | {dtype} | {_f(r.num_blocks, ',')} | {_f(u['mean_running'], '.1f')} | "
                    f"{u['peak_running']} | {_f(m.get('preemptions'), '.0f')} | {s['output_tok_s']:.1f} | "
                    f"{_f(s['ttft_s']['p50'], '.3f')} s | {s['wall_s']:.1f} s | {_f(ppl.get(r.side.name), '.3f')} |")
    base, quant = results
    last = last_line((base.num_blocks, quant.num_blocks),
                     (base.usage["mean_running"], quant.usage["mean_running"]),
                     (base.summary["output_tok_s"], quant.summary["output_tok_s"]),
                     (ppl.get(base.side.name, float("nan")), ppl.get(quant.side.name, float("nan"))))
    return rows, last


def report(args, model_dir: str, results: list) -> tuple[list[str], str, dict]:
    """After the servers stopped: perplexity per cache dtype, then the tables and the last line."""
    from pagedserve_common.units import format_bytes, parse_bytes

    ppl = measure_perplexity(model_dir, args.ppl_tokens, args.threads, args.dtype)
    kv_memory = parse_bytes(args.kv_memory)
    budgets = {format_bytes(b): model_capacities(model_dir, b)
               for b in dict.fromkeys((CAPACITY_KV_MEMORY, kv_memory))}
    table, last = side_lines(results, ppl)
    ppl_note = (f"perplexity: {ppl['num_tokens']:,} tokens of {ppl['corpus']}, teacher-forced through the worker's "
                f"runner (1,024-token windows)")
    extra = {"perplexity": ppl, "capacity": {name: [{"dtype": c.dtype, "bytes_per_token": c.bytes_per_token,
                                                     "num_blocks": c.num_blocks} for c in caps]
                                              for name, caps in budgets.items()}}
    return capacity_lines(budgets) + [""] + table + ["", ppl_note], last, extra
