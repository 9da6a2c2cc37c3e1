"""`pagedserve kv-plan`: KV-cache bytes per token, block and sequence for a model, and what fits in memory."""

from __future__ import annotations

import argparse
import json

from pagedserve_common.defaults import DEFAULT_BLOCK_SIZE
from pagedserve_common.model_spec import MODEL_HELP
from pagedserve_common.units import parse_bytes
from pagedserve_common.config import KV_CACHE_DTYPES
from pagedserve_common.kv_geometry import DTYPE_BYTES, SCALE_BYTES, KVGeometry
from scheduler_svc.kv.capacity import max_model_len_of, plan, read_config


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("kv-plan", help="KV-cache capacity planning from a model's config.json")
    p.add_argument("--model", required=True, help=MODEL_HELP + " (at its default branch)")
    p.add_argument("--seq-len", type=int, required=True, help="sequence length S (prompt + output tokens)")
    p.add_argument("--dtype", choices=("float32", "float16", "bfloat16"),
                   help="the model's dtype, which --kv-cache-dtype auto follows (default: the checkpoint's)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="the KV cache's element type (default auto: --dtype); int8 and fp8 add one float32 scale "
                        "per token and kv head")
    p.add_argument("--block-size", type=int, default=DEFAULT_BLOCK_SIZE, metavar="N",
                   help="tokens per KV block (default: %(default)s)")
    p.add_argument("--memory", type=parse_bytes, help="KV memory budget: bytes, or e.g. 80GiB")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.set_defaults(func=run)


def _model_dir(spec: str) -> str:
    from pathlib import Path
    if (Path(spec) / "config.json").is_file():
        return spec
    from worker_svc.model_store import resolve_model  # NOTE: only for what is not a directory: pulls it once
    return str(resolve_model(spec))


def run(args: argparse.Namespace) -> int:
    config = read_config(_model_dir(args.model))
    cache_dtype = None if args.kv_cache_dtype == "auto" else args.kv_cache_dtype
    geometry = KVGeometry.from_config(config, cache_dtype or args.dtype, args.block_size)
    kv = plan(geometry, args.seq_len, args.memory, max_model_len_of(config))
    if args.json:
        print(json.dumps(kv.to_dict()))
        return 0
    print(f"model: {kv.num_layers} layers x {kv.num_kv_heads} kv heads x head_dim {kv.head_dim}, {kv.dtype}")
    scales = f" + 2 x {kv.num_layers} x {kv.num_kv_heads} x {SCALE_BYTES} scale bytes" if kv.scale_bytes_per_token \
        else ""
    print(f"KV bytes per token:    {kv.bytes_per_token:,}  (2 x {kv.num_layers} x {kv.num_kv_heads} x "
          f"{kv.head_dim} x {DTYPE_BYTES[kv.dtype]}{scales})")
    groups = geometry.groups
    of_layers = f" of {groups.layers_per_group} layers: one of {groups.num_groups} KV groups, windows " \
        f"{', '.join(str(w) if w else 'full' for w in groups.windows)}" if groups.num_groups > 1 else ""
    print(f"bytes per block:       {kv.bytes_per_block:,}  ({kv.block_size} tokens{of_layers})")
    print(f"bytes per sequence:    {kv.bytes_per_sequence:,}  ({kv.blocks_per_sequence} blocks for "
          f"S={kv.seq_len})")
    if kv.memory is not None:
        print(f"in {kv.memory:,} bytes:  {kv.num_blocks:,} blocks = {kv.num_tokens:,} tokens")
        print(f"  paged:      {kv.num_sequences:,} concurrent sequences of {kv.seq_len} tokens")
        print(f"  contiguous: {kv.contiguous_num_sequences:,} sequences preallocated at max length "
              f"{kv.max_model_len}")
    return 0
