"""The lean forward's GEMM layouts side by side (worker_svc/linear.py's choice): GFLOP/s at the default model's shapes.

    python bench/gemm_layouts.py [--threads 1] [--rows 1,16,64,512] [--iters 20]

For each weight (the fused QKV, o_proj, fused gate/up, down, lm_head) and row count M: F.linear over the [out, in]
weight (what transformers runs), torch.mm over the weight stored transposed ([in, out] contiguous), and oneDNN's
linear over the weight reordered once (`mkldnn._reorder_linear_weight`), in float32 and bfloat16 (bfloat16 only
where the CPU computes it natively). Best of --iters calls; CPU time at one thread (other processes only add wall
time), wall time otherwise. Last line: `gemm_layouts dtype=D rows=M best=KIND ...` per dtype and row count.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker_svc.model_store import DEFAULT_MODEL, resolve_model  # noqa: E402


def shapes(model_dir: Path) -> dict[str, tuple[int, int]]:
    cfg = json.loads((model_dir / "config.json").read_text())
    h, inter, hd = cfg["hidden_size"], cfg["intermediate_size"], cfg.get("head_dim") or \
        cfg["hidden_size"] // cfg["num_attention_heads"]
    qkv = (cfg["num_attention_heads"] + 2 * cfg["num_key_value_heads"]) * hd
    return {"qkv": (qkv, h), "o_proj": (h, cfg["num_attention_heads"] * hd), "gate_up": (2 * inter, h),
            "down": (h, inter), "lm_head": (cfg["vocab_size"], h)}


def best_of(fn, iters: int, clock) -> float:
    fn()
    best = float("inf")
    for _ in range(iters):
        t = clock()
        fn()
        best = min(best, clock() - t)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.split("\n\n")[0])
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,16,64,512")
    ap.add_argument("--iters", type=int, default=20)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    clock = time.process_time if args.threads == 1 else time.perf_counter
    flags = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    dtypes = [torch.float32] + ([torch.bfloat16] if ("avx512_bf16" in flags or "amx_bf16" in flags) else [])
    gen = torch.Generator().manual_seed(0)
    summary = []
    for dtype in dtypes:
        name = str(dtype).removeprefix("torch.")
        for m in (int(r) for r in args.rows.split(",")):
            totals = {"linear": 0.0, "mm": 0.0, "onednn": 0.0}
            cells = []
            for wname, (n, k) in shapes(resolve_model(DEFAULT_MODEL)).items():
                w = torch.randn(n, k, generator=gen).to(dtype)
                x = torch.randn(m, k, generator=gen).to(dtype)
                wt = w.t().contiguous()
                packed = torch.ops.mkldnn._reorder_linear_weight(w, m)
                flop = 2 * m * n * k
                secs = {"linear": best_of(lambda: F.linear(x, w), args.iters, clock),
                        "mm": best_of(lambda: torch.mm(x, wt), args.iters, clock),
                        "onednn": best_of(lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
                                          args.iters, clock)}
                for kind, s in secs.items():
                    totals[kind] += s
                cells.append(f"{wname} " + " ".join(f"{kind} {flop / s / 1e9:7.1f}" for kind, s in secs.items()))
            print(f"{name:8s} M={m:4d} GFLOP/s | " + " | ".join(cells), flush=True)
            best = min(totals, key=totals.get)
            summary.append(f"gemm_layouts dtype={name} rows={m} best={best} " + " ".join(
                f"{kind}_ms={s * 1e3:.3f}" for kind, s in totals.items()))
    print("\n".join(summary))


if __name__ == "__main__":
    main()
