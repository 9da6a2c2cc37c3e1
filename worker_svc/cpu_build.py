"""The CPU kernel library: every C++ source of the CPU worker (the attention kernel, the fused ops, the AMX and panel
matmuls, the CPU path's cap) compiled into one shared library with g++, once per source, flags, compiler, CPU and
CPU path, and loaded through ctypes. Each backend declares the functions it calls (attention/cpu_backend.py,
cpu_ops.py); this module only builds, finds and opens the file.

Without a compiler (the container image) the best prebuilt portable build this CPU runs is loaded:
`python -m worker_svc.cpu_build --prebuild [DIR]` (or `python -m worker_svc.attention.cpu_backend --prebuild`) makes
them. PAGEDSERVE_CACHE is where builds are cached, PAGEDSERVE_KERNEL_DIR where prebuilt ones are looked for.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from worker_svc import cpu_features, cpu_path

# NOTE: read at each build (tests point it at a copy of the tree with one line broken): the sources live below it.
SOURCE_ROOT = Path(__file__).parent
# The translation units, one library: the attention kernel (its parts are kernels/attention/*.h), the fused
# bfloat16 and float32 ops, the bfloat16 AMX matmuls, the float32 / bfloat16 panel matmuls, the quantised-weight
# matmuls (float and int8 activations), the lean forward's layer loop, the CPU path's cap.
UNITS = ("attention/paged_attention_cpu.cpp", "cpu_ops.cpp", "amx_gemm.cpp", "f32_gemm.cpp", "f32_ops.cpp",
         "q_gemm.cpp", "q8a_gemm.cpp", "lean_stack.cpp", "cpu_path.cpp")
HEADERS = "kernels"  # the headers the units include (relative includes: no -I), below SOURCE_ROOT
LIBRARY = "paged_attention_cpu"  # the library files' name (cache and prebuilt)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-shared", "-fPIC", "-std=c++17")

# Portable builds for machines without a compiler (the container image), best first, with the /proc/cpuinfo
# flags each needs. NOTE: the kernel branches on AVX-512 f/bw/vl (x86-64-v4) and AVX2 + FMA + F16C (x86-64-v3);
# its int8 Q.K path needs VNNI, which neither level implies: only a native build on such a CPU has it.
_V2 = ("sse4_1", "sse4_2", "ssse3", "popcnt", "cx16")
_V3 = (*_V2, "avx", "avx2", "fma", "bmi1", "bmi2", "f16c", "movbe")
PORTABLE_TARGETS = {
    "x86-64-v4": (*_V3, "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"),
    "x86-64-v3": _V3,
    "x86-64-v2": _V2,
}


def units() -> tuple[Path, ...]:
    """The files g++ compiles into the library."""
    return tuple(SOURCE_ROOT / unit for unit in UNITS)


def sources() -> tuple[Path, ...]:
    """Every file the library is built from (the units and the headers they include): what ships as package data,
    and what a build's cache key reads."""
    return (*units(), *sorted((SOURCE_ROOT / HEADERS).rglob("*.h")))


def _sources_text() -> str:
    return "\0".join(path.read_text() for path in sources())


def cache_dir() -> Path:
    return Path(os.environ.get("PAGEDSERVE_CACHE", Path.home() / ".cache" / "pagedserve")) / "kernels"


def prebuilt_dir() -> Path:
    return Path(os.environ.get("PAGEDSERVE_KERNEL_DIR", Path(__file__).parent / "attention" / "prebuilt"))


def _compile(cxx: str, flags: tuple[str, ...], out: Path) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    # NOTE: build beside the target, then rename: workers starting together never load a half-written file.
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        res = subprocess.run([cxx, *flags, "-o", tmp, *map(str, units())], capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"building {LIBRARY} ({', '.join(UNITS)}) failed:\n{res.stderr[-2000:]}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def _portable_flags(target: str) -> tuple[str, ...]:
    return tuple(f"-march={target}" if f == "-march=native" else f for f in FLAGS)


def _prebuilt_name(target: str) -> str:
    key = hashlib.sha256("\0".join([_sources_text(), *_portable_flags(target)]).encode()).hexdigest()[:16]
    return f"{LIBRARY}-{target}-{key}.so"


def prebuild(out_dir: Path | None = None, compiler: str = "g++") -> list[Path]:
    """Compiles every portable target into `out_dir` (an image build does this, then drops the compiler)."""
    cxx = shutil.which(compiler)
    if cxx is None:
        raise RuntimeError(f"{compiler} is not installed")
    out_dir = out_dir or prebuilt_dir()
    return [_compile(cxx, _portable_flags(t), out_dir / _prebuilt_name(t)) for t in PORTABLE_TARGETS]


def prebuilt_library(cpu_flags: set[str] | None = None) -> Path | None:
    """The best prebuilt library for this source that this CPU can run, if one was built."""
    if cpu_flags is None:
        cpu_flags = cpu_features.cpu_flags()
    for target, needed in PORTABLE_TARGETS.items():
        path = prebuilt_dir() / _prebuilt_name(target)
        if cpu_flags.issuperset(needed) and path.is_file():
            return path
    return None


def build_library(compiler: str = "g++", path: cpu_path.CpuPath | None = None) -> Path:
    """The compiled kernel library for `path` (default: the process's CPU path): built for this CPU, or the path's
    -march, on first use (cached by source, flags, compiler and CPU); without a compiler, the best prebuilt portable
    build.

    NOTE: each path has a file of its own, even where two share the flags (amx, avx512-bf16 and native): a file is
    loaded once per process, and the cap load_library sets lives in it."""
    path = path or cpu_path.current()
    cxx = shutil.which(compiler)
    if cxx is None:
        prebuilt = prebuilt_library()
        if prebuilt is not None:
            return prebuilt
        raise RuntimeError(f"{compiler} is not installed and no prebuilt kernel fits this CPU in {prebuilt_dir()}")
    flags = FLAGS if path.target == "native" else _portable_flags(path.target)
    version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    key = hashlib.sha256("\0".join([_sources_text(), *flags, version, cpu_features.cpu_signature()]).encode())
    digest = key.hexdigest()[:16]
    out = cache_dir() / (f"{LIBRARY}-{digest}.so" if path.name == "native" else f"{LIBRARY}-{path.name}-{digest}.so")
    if out.exists():
        return out
    same_build = cache_dir() / f"{LIBRARY}-{digest}.so"
    if path.target == "native" and same_build.exists():  # the native build's bits under another name (see NOTE)
        tmp = out.with_suffix(f".{os.getpid()}.tmp")
        shutil.copyfile(same_build, tmp)
        os.replace(tmp, out)
        return out
    return _compile(cxx, flags, out)


def load_library(path: Path | None = None, cpu: cpu_path.CpuPath | None = None) -> ctypes.CDLL:
    """The kernel library at `path` (default: build_library's for `cpu`, the process's CPU path), its run-time
    feature checks capped to `cpu`. The caller declares the signatures of the functions it calls."""
    cpu = cpu or cpu_path.current()
    lib = ctypes.CDLL(str(path or build_library(path=cpu)))
    lib.ps_set_cpu_path_cap.argtypes, lib.ps_set_cpu_path_cap.restype = [ctypes.c_int], None
    lib.ps_set_cpu_path_cap(cpu.cap)
    return lib


def main(argv: list[str]) -> None:
    if argv[:1] != ["--prebuild"]:
        raise SystemExit("usage: python -m worker_svc.cpu_build --prebuild [DIR]")
    for built in prebuild(Path(argv[1]) if len(argv) > 1 else None):
        print(built)


if __name__ == "__main__":  # python -m worker_svc.cpu_build --prebuild [DIR]
    import sys

    main(sys.argv[1:])
