"""The CPU path a worker's kernels take: the best this CPU has (native), or a lesser one forced so that one machine
runs, and tests, what a lesser CPU would (`--cpu-path`, PAGEDSERVE_CPU_PATH).

The kernels choose their code two ways, and a path caps both: at build time by -march (the attention kernel's
AVX-512, AVX2 and VNNI code: cpu_build builds a library per path), and at run time by CPUID (AMX, AVX512-BF16 dot
products, the AVX-512 and AVX2 panel matmuls: cpu_path.cpp's cap, set when the library loads). A worker started
with a path also caps torch's own kernels (oneDNN's ISA, ATen's vector code) before torch loads, unless the user set
those variables, and `--dtype auto` sees only the path's features.
"""

from __future__ import annotations

import os
from collections.abc import Collection
from dataclasses import dataclass

ENV = "PAGEDSERVE_CPU_PATH"


@dataclass(frozen=True, slots=True)
class CpuPath:
    name: str
    cap: int  # cpu_path.cpp's level: run-time features above it are not used
    target: str  # the -march a library for it is built with
    needs: tuple[str, ...]  # /proc/cpuinfo flags a CPU must have to run it
    hides: tuple[str, ...]  # flag prefixes `--dtype auto` and the feature checks no longer see on it
    onednn_isa: str | None  # ONEDNN_MAX_CPU_ISA under it
    aten: str | None  # ATEN_CPU_CAPABILITY under it


# Best first. NOTE: "native" caps nothing; the others name the CPUs this project runs on: Intel with AMX, AMD with
# AVX512-BF16 and VNNI but no AMX, AVX-512 without BF16 (older Xeons), AVX2 only.
PATHS = {p.name: p for p in (
    CpuPath("native", 99, "native", (), (), None, None),
    CpuPath("amx", 4, "native", ("amx_bf16", "amx_tile", "avx512_bf16"), (), "AVX512_CORE_AMX", "avx512"),
    CpuPath("avx512-bf16", 3, "native", ("avx512_bf16", "avx512f", "avx512bw", "avx512vl"), ("amx",),
            "AVX512_CORE_BF16", "avx512"),
    CpuPath("avx512", 2, "x86-64-v4", ("avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"),
            ("amx", "avx512_bf16", "avx512_vnni", "avx_vnni", "avx512_fp16"), "AVX512_CORE", "avx512"),
    CpuPath("avx2", 1, "x86-64-v3", ("avx2", "fma", "f16c", "bmi2"), ("amx", "avx512", "avx_vnni"), "AVX2", "avx2"),
)}


def current() -> CpuPath:
    """This process's path: PAGEDSERVE_CPU_PATH (set by `--cpu-path` at a worker's start), else native."""
    name = os.environ.get(ENV, "native") or "native"
    if name not in PATHS:
        raise ValueError(f"{ENV}={name!r}: expected one of {', '.join(PATHS)}")
    return PATHS[name]


def supported(flags: Collection[str]) -> list[str]:
    """The paths a CPU with these /proc/cpuinfo flags can run, best first (native always)."""
    return [p.name for p in PATHS.values() if set(p.needs) <= set(flags)]


def visible(flags: Collection[str], path: CpuPath | None = None) -> frozenset[str]:
    """The flags a path lets the process see: a CPU's own, less what the path hides."""
    path = path or current()
    return frozenset(f for f in flags if not f.startswith(path.hides)) if path.hides else frozenset(flags)


def apply(name: str, environ=os.environ) -> None:
    """Makes `name` this process's path (and its children's): before torch loads, so that oneDNN and ATen are capped
    too (a variable the user set stands)."""
    path = PATHS[name]
    environ[ENV] = name
    if path.onednn_isa and name != "native":
        environ.setdefault("ONEDNN_MAX_CPU_ISA", path.onednn_isa)
    if path.aten and name != "native":
        environ.setdefault("ATEN_CPU_CAPABILITY", path.aten)
