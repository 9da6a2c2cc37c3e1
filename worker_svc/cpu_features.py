"""What this machine's CPU can do, read from Linux's /proc/cpuinfo (nothing where there is none)."""

from __future__ import annotations

import platform
from collections.abc import Collection
from pathlib import Path

from worker_svc import cpu_path

CPUINFO = Path("/proc/cpuinfo")
# NOTE: Linux's names for the x86 features under which a bfloat16 matmul runs in hardware (AVX512-BF16 dot
# products, AMX tiles), best first. Without either, torch's bfloat16 GEMM widens to float32 and narrows back in
# software: 0.14-0.29x float32's own speed (this CPU capped to AVX-512 and to AVX2; docs/performance.md, "What
# was tried").
NATIVE_BF16_FLAGS = ("amx_bf16", "avx512_bf16")


def _lines(path: Path) -> list[str]:
    """The first CPU's "model name" and "flags" lines (both absent off x86 or without /proc)."""
    try:
        info = path.read_text()
    except OSError:
        return []
    return [ln for ln in info.splitlines() if ln.startswith(("model name", "flags"))][:2]


def cpu_signature(path: Path = CPUINFO) -> str:
    """What -march=native depends on: the machine, the CPU's model and its flags."""
    return platform.machine() + "\n" + "\n".join(_lines(path))


def cpu_flags(path: Path = CPUINFO) -> frozenset[str]:
    """The CPU's feature flags as Linux names them (avx2, avx512f, avx512_bf16, amx_bf16, ...), less those the
    process's CPU path hides (cpu_path.py); empty off x86 (an ARM /proc/cpuinfo says "Features") or without /proc."""
    line = next((ln for ln in _lines(path) if ln.startswith("flags")), "")
    return cpu_path.visible(line.partition(":")[2].split())


def native_bf16_flags(flags: Collection[str]) -> tuple[str, ...]:
    """The flags among NATIVE_BF16_FLAGS in `flags`: empty where bfloat16 arithmetic would be emulated."""
    return tuple(f for f in NATIVE_BF16_FLAGS if f in flags)
