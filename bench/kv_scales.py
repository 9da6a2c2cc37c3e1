"""The measurement behind the 8-bit cache's scale granularity: per tensor, per (token, kv head), per channel.

    python bench/kv_scales.py --threads 2            # ~8k tokens x 10 configurations

Perplexity (and mean KL against float32) of the default model on the first --num-tokens tokens of Newton's
Opticks, through the worker's runner and a float32 paged pool, with a fake-quantising torch backend: every K and V
row is quantised and dequantised as it is written (the pool then holds exactly the values a real cache would
dequantise to), under three scale schemes:

  tensor         one static scale per layer for K and one for V (absmax over --calib-tokens tokens of calibration
                 text from elsewhere in the book / QUANT_MAX, like vLLM's per-tensor fp8 scales); outliers saturate
  token          ours: one scale per (token, kv head) row, for K and for V (exactly the int8 / fp8 cache's codes:
                 the real int8 cache is run beside it as a check, and must score the same)
  kchan_vtoken   KIVI-style: K one scale per (block, kv head, channel) over the block's 16 rows, V per token

EMULATED for kchan_vtoken: the channel scales of a block are the absmax over ALL of its rows. Windows start at a
block boundary and every prefill chunk (--chunk, a multiple of the block size) covers whole blocks, so each block
is written by one write_kv call and quantised with its final scales: as if a block were quantised when its last
row arrives, with the queries of that same chunk already reading the quantised keys. A real append-only cache
cannot do that for the block still filling (its scales change as rows arrive, so earlier codes would have to be
rewritten, or kept in float as KIVI's residual): this is the scheme's best case.

int8 and fp8_e4m3, plus 4-bit integer codes (qmax 7) per token vs K per channel, where per-channel keys should
matter. Also prints the storage overhead of each scheme's scales and whether a block stays immutable once its
tokens are written.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from pagedserve_cli.bench.corpus import NAME, corpus_token_ids  # noqa: E402
from pagedserve_cli.bench.perplexity import compare, scoring_runner, sibling_runner, window_logits  # noqa: E402
from pagedserve_common.kv_geometry import QUANT_MAX  # noqa: E402
from worker_svc.attention.quant import STORAGE, dequantize, quantize  # noqa: E402
from worker_svc.attention.torch_backend import TorchAttentionBackend  # noqa: E402
from worker_svc.model_store import resolve_model  # noqa: E402

QMAX = {**QUANT_MAX, "int4": 7.0}
BITS = {"int8": 8, "fp8_e4m3": 8, "int4": 4}
CONFIGS = [("int8", "tensor"), ("int8", "token"), ("int8", "kchan_vtoken"), ("fp8_e4m3", "tensor"),
           ("fp8_e4m3", "token"), ("fp8_e4m3", "kchan_vtoken"), ("int4", "token"), ("int4", "kchan_vtoken")]
IMMUTABLE = {"tensor": "yes (static scales)", "token": "yes (a row's scale is written with it)",
             "kchan_vtoken": "no: a block's K scales change as rows arrive (re-quantise, or a float residual)"}


def codes_of(y: torch.Tensor, fmt: str) -> torch.Tensor:
    """y (already divided by its scale) rounded to `fmt`'s grid, as float32: int8/int4 round half to even and
    clamp to +-qmax; fp8 rounds to nearest even, saturating."""
    qmax = QMAX[fmt]
    if fmt.startswith("int"):
        return torch.round(y).clamp_(-qmax, qmax)
    return y.clamp(-qmax, qmax).to(STORAGE[fmt]).float()


def per_token(x: torch.Tensor, fmt: str) -> torch.Tensor:
    if fmt in STORAGE:  # NOTE: the cache's own quantize(): the real codes, bit for bit
        return dequantize(*quantize(x, STORAGE[fmt]))
    scales = (x.abs().amax(dim=-1, keepdim=True) / QMAX[fmt]).clamp_min(1e-30)
    return codes_of(x / scales, fmt) * scales


def per_channel_in_blocks(x: torch.Tensor, slots: torch.Tensor, block_size: int, fmt: str) -> torch.Tensor:
    """x [n, kvh, hd]: one scale per (block, kv head, channel), the absmax over the rows of that block in x."""
    _, inverse = torch.unique(slots // block_size, return_inverse=True)
    index = inverse.view(-1, 1, 1).expand_as(x)
    absmax = torch.zeros((int(inverse.max()) + 1, *x.shape[1:])).scatter_reduce_(0, index, x.abs(), "amax")
    scales = (absmax / QMAX[fmt]).clamp_min(1e-30)[inverse]
    return codes_of(x / scales, fmt) * scales


class FakeQuantBackend(TorchAttentionBackend):
    """The torch backend over a float32 pool, K and V rounded through a scale scheme as they are written.
    scheme None records each layer's K and V absmax instead (calibration for the per-tensor scales)."""

    name = "torch-fakequant"

    def __init__(self, pool: torch.Tensor, fmt: str = "", scheme: str | None = None,
                 absmax: torch.Tensor | None = None) -> None:
        super().__init__()
        self.pool, self.fmt, self.scheme = pool, fmt, scheme
        self.absmax = torch.zeros(pool.shape[0], 2) if absmax is None else absmax

    def _layer(self, kv_layer: torch.Tensor) -> int:
        return (kv_layer.data_ptr() - self.pool.data_ptr()) // (kv_layer.numel() * kv_layer.element_size())

    def write_kv(self, kv_layer, key, value, slot_mapping, kv_scales=None) -> None:
        layer, slots = self._layer(kv_layer), slot_mapping.long()
        key, value = key.float(), value.float()
        if self.scheme is None:
            for i, x in enumerate((key, value)):
                self.absmax[layer, i] = max(float(self.absmax[layer, i]), float(x.abs().max()))
        elif self.scheme == "tensor":
            key, value = (codes_of(x / s, self.fmt) * s for x, s in
                          zip((key, value), (self.absmax[layer] / QMAX[self.fmt]).tolist()))
        elif self.scheme == "token":
            key, value = per_token(key, self.fmt), per_token(value, self.fmt)
        else:
            key, value = per_channel_in_blocks(key, slots, kv_layer.shape[2], self.fmt), per_token(value, self.fmt)
        super().write_kv(kv_layer, key, value, slot_mapping)


@dataclass(slots=True)
class Overhead:
    """Scale bytes per token and kv head, against the codes' bytes, for K and V."""

    k: float
    v: float

    def pct(self, fmt: str, head_dim: int) -> float:
        return 100.0 * (self.k + self.v) / (2 * head_dim * BITS[fmt] / 8)


def overhead(scheme: str, head_dim: int, block_size: int) -> Overhead:
    if scheme == "tensor":
        return Overhead(0.0, 0.0)  # NOTE: 2 floats per layer, whatever the length
    if scheme == "token":
        return Overhead(4.0, 4.0)
    return Overhead(4.0 * head_dim / block_size, 4.0)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(allow_abbrev=False, description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--num-tokens", type=int, default=8192)
    ap.add_argument("--calib-tokens", type=int, default=2048)
    ap.add_argument("--calib-offset", type=int, default=100_000, help="where the calibration text starts")
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--threads", type=int, default=None)
    args = ap.parse_args(argv)
    model_dir = str(resolve_model(args.model))
    t0 = time.perf_counter()
    text = corpus_token_ids(model_dir)
    calib = text[args.calib_offset:args.calib_offset + args.calib_tokens]
    if args.calib_offset < args.num_tokens or len(calib) < args.calib_tokens:
        ap.error("--calib-offset: the calibration text must lie inside the corpus, past the scored tokens")
    ref = scoring_runner(model_dir, "float32", "torch", kv_memory=80 << 20, threads=args.threads)
    geometry = ref.pool.geometry
    if args.chunk % geometry.block_size or args.window % geometry.block_size:
        ap.error("--chunk and --window must be multiples of the block size (the per-channel emulation needs it)")

    recorder = sibling_runner(ref, "float32")
    recorder.backend = FakeQuantBackend(recorder.pool.kv)
    for _ in window_logits(recorder, calib, args.window, args.chunk):
        pass
    absmax = recorder.backend.absmax
    del recorder
    runners = {"float32": ref, "int8 cache (real)": sibling_runner(ref, "int8", "torch")}
    for fmt, scheme in CONFIGS:
        r = sibling_runner(ref, "float32")
        r.backend = FakeQuantBackend(r.pool.kv, fmt, scheme, absmax)
        runners[f"{fmt} {scheme}"] = r
    print(f"# {NAME}: tokens 0..{args.num_tokens}, window {args.window}, chunk {args.chunk}; calibration tokens "
          f"{args.calib_offset}..{args.calib_offset + args.calib_tokens}; threads {torch.get_num_threads()}; "
          f"K absmax over layers {float(absmax[:, 0].min()):.2f}..{float(absmax[:, 0].max()):.2f}, "
          f"V {float(absmax[:, 1].min()):.2f}..{float(absmax[:, 1].max()):.2f}", flush=True)
    def progress(so_far: dict) -> None:  # NOTE: running figures, so a run cut short still tells something
        print(f"# {time.perf_counter() - t0:.0f} s, {so_far['float32'].num_tokens} tokens: " + " ".join(
            f"{n.replace(' ', '/')}={s.perplexity:.4f}" for n, s in so_far.items()), flush=True)

    scored = compare(runners, "float32", text[:args.num_tokens], args.window, args.chunk, progress)
    print(f"# scored at {time.perf_counter() - t0:.0f} s\n")
    base = scored["float32"].perplexity
    print("| codes | scales | perplexity | vs float32 | mean KL vs float32 | scale bytes per token-head (K + V) "
          "| overhead vs codes | block immutable once written |")
    print("|---|---|---|---|---|---|---|---|")
    lines = []
    for name, s in scored.items():
        delta = 100.0 * (s.perplexity / base - 1.0)
        fmt, scheme = name.split(" ", 1) if name in {f"{f} {c}" for f, c in CONFIGS} else (name, None)
        if scheme is None:
            cost = "4 + 4" if name.startswith("int8") else "-"
            pct, imm = ("6.25%", IMMUTABLE["token"]) if name.startswith("int8") else ("-", "-")
        else:
            o = overhead(scheme, geometry.head_dim, geometry.block_size)
            cost, pct, imm = f"{o.k:g} + {o.v:g}", f"{o.pct(fmt, geometry.head_dim):.2f}%", IMMUTABLE[scheme]
        print(f"| {fmt} | {scheme or '-'} | {s.perplexity:.4f} | {delta:+.3f}% | {s.mean_kl:.3e} | {cost} | {pct} "
              f"| {imm} |")
        lines.append(f"kv_scales config={name.replace(' ', '/')} ppl={s.perplexity:.4f} ppl_delta_pct={delta:.3f} "
                     f"kl={s.mean_kl:.4e}")
    print()
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
