"""Where bench/gemm_peak.py keeps this machine's GEMM peak, and reading it back (the CPU named by a key)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16")  # NOTE: without one of them torch emulates bfloat16 matmuls


def cpu_info() -> dict:
    """The first processor's model name and flags (/proc/cpuinfo), and the cores this process may use."""
    name, flags = "unknown", []
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and name == "unknown":
                    name = value.strip()
                elif key == "flags":
                    flags = value.split()
                    break
    except OSError:
        pass
    return {"model_name": name, "flags": flags, "num_cores": len(os.sched_getaffinity(0)),
            "native_bf16": [f for f in NATIVE_BF16_FLAGS if f in flags]}


def cpu_key(info: dict | None = None) -> str:
    """`<cores>c-<12 hex of the model name and flags>`: the same on every machine of one kind."""
    info = info or cpu_info()
    digest = hashlib.sha256((info["model_name"] + "|" + " ".join(sorted(info["flags"]))).encode()).hexdigest()
    return f"{info['num_cores']}c-{digest[:12]}"


def default_path(info: dict | None = None) -> Path:
    """$PAGEDSERVE_CACHE (else ~/.cache/pagedserve)/gemm_peak-<cpu key>.json."""
    root = os.environ.get("PAGEDSERVE_CACHE")
    base = Path(root).expanduser() if root else Path.home() / ".cache" / "pagedserve"
    return base / f"gemm_peak-{cpu_key(info)}.json"


def load(path: str | Path) -> dict:
    return json.loads(Path(path).read_text(encoding="utf-8"))


def peak_of(doc: dict, dtype: str, threads: int | None = None) -> tuple[float, int] | None:
    """(GFLOP/s, threads) of the dtype's peak at `threads` (default: the most measured); None when not measured."""
    by_threads = doc.get("peak", {}).get(dtype) or {}
    key = max(by_threads, key=int) if threads is None and by_threads else str(threads)
    if key not in by_threads:
        return None
    return float(by_threads[key]["gflops_s"]), int(key)
