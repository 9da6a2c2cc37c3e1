"""The bfloat16 decode matmuls, AMX kernel (worker_svc/amx_gemm.cpp) against oneDNN's prepacked weight.

The default model's 121 matmuls of one step (30 layers of QKV 576 -> 960, O 576 -> 576, gate/up 576 -> 3,072,
down 1,536 -> 576, then the lm_head 576 -> 49,152), each with its own random weight so that they are read from
memory as in a real step (270 MB, past the L2), back to back at each row count; best of 4 passes. Needs a CPU with
AMX-BF16.

usage: python bench/amx_chain.py [--threads 2] [--rows 1,8,16,32,48,64,96,128,192,256] [--float32]

--float32: the float32 layer matmuls (the 120 of the layers) instead: torch.mm over the transposed weight, oneDNN's
prepacked float32 weight and, where the CPU has AVX-512, our panel kernel (worker_svc/f32_gemm.cpp), what
worker_svc/linear.py chooses between (F32_PANEL_ROWS, F32_ONEDNN_ROWS). Needs no AMX.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker_svc.cpu_ops import shared_ops  # noqa: E402

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)] * 30 + [(49152, 576)]


def main() -> None:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rows", default="1,8,16,32,48,64,96,128,192,256")
    ap.add_argument("--float32", action="store_true", help="float32 layer matmuls: torch.mm, oneDNN, our panels")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.float32:
        return float32_chain(args)
    ops = shared_ops()
    if ops is None or not ops.amx_available():
        sys.exit("this CPU (or kernel) gives no AMX-BF16 to this process: nothing to compare")
    gen = torch.Generator().manual_seed(0)
    weights = []
    for n, k in SHAPES:
        w = (torch.randn(n, k, generator=gen) * 0.05).bfloat16()
        weights.append((torch.ops.mkldnn._reorder_linear_weight(w, 64), ops.amx_pack(w), n, k))
    print(f"threads {args.threads}, {sum(n * k for n, k in SHAPES) * 2 / 1e6:.0f} MB of weights; ms per step")
    with torch.inference_mode():
        for m in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(m, k, generator=gen).bfloat16() for k in (576, 1536)}
            best = {}
            for name in ("onednn", "amx"):
                best[name] = float("inf")
                for _ in range(4):
                    t0 = time.perf_counter()
                    for packed, amx, n, k in weights:
                        if name == "onednn":
                            torch.ops.mkldnn._linear_pointwise(xs[k], packed, None, "none", [], "")
                        else:
                            ops.amx_linear(xs[k], amx, n, None)
                    best[name] = min(best[name], time.perf_counter() - t0)
            print(f"rows {m:4d}  onednn {best['onednn'] * 1e3:7.2f}  amx {best['amx'] * 1e3:7.2f}  "
                  f"onednn/amx {best['onednn'] / best['amx']:.2f}", flush=True)


def float32_chain(args) -> None:
    ops = shared_ops()
    names = ("mm", "onednn", "panels") if ops is not None and ops.f32_panels_available() else ("mm", "onednn")
    gen = torch.Generator().manual_seed(0)
    weights = []
    for n, k in SHAPES[:-1]:
        w = torch.randn(n, k, generator=gen) * 0.05
        weights.append((w.t().contiguous(), torch.ops.mkldnn._reorder_linear_weight(w, 32),
                        ops.f32_pack(w) if "panels" in names else None, n, k))
    print(f"threads {args.threads}, {sum(n * k for n, k in SHAPES[:-1]) * 4 / 1e6:.0f} MB of float32 weights; "
          "ms per step")
    with torch.inference_mode():
        for m in (int(r) for r in args.rows.split(",")):
            xs = {k: torch.randn(m, k, generator=gen) for k in (576, 1536)}
            best = {}
            for name in names:
                best[name] = float("inf")
                for _ in range(4):
                    t0 = time.perf_counter()
                    for wt, packed, panels, n, k in weights:
                        if name == "mm":
                            torch.mm(xs[k], wt)
                        elif name == "onednn":
                            torch.ops.mkldnn._linear_pointwise(xs[k], packed, None, "none", [], "")
                        else:
                            ops.f32_linear(xs[k], panels, n, None)
                    best[name] = min(best[name], time.perf_counter() - t0)
            line = "  ".join(f"{name} {best[name] * 1e3:7.2f}" for name in names)
            ratios = "  ".join(f"{name}/panels {best[name] / best['panels']:.2f}" for name in names[:2]
                               if "panels" in best)
            print(f"rows {m:4d}  {line}  {ratios}", flush=True)


if __name__ == "__main__":
    main()
