"""The worker's glibc heap settings: a step's freed tensors stay mapped for the next step instead of faulting in again.

Why: torch's CPU allocator takes every step's activations (a 512-token chunk's: megabytes) from glibc's malloc, and
with glibc's defaults most of it goes back to the kernel when freed (a free heap top past 128 KiB is trimmed, large
chunks are mmapped and unmapped), so each step faults in and zeroes the same pages again: a 512-token bfloat16
prefill step of the default model took 7,000-10,000 minor faults and ~150 ms, and 0 faults and ~124 ms with
the heap kept. The cost: the worker keeps its largest step's transient memory resident between steps.
A user's own malloc settings (GLIBC_TUNABLES glibc.malloc.*, MALLOC_*_ environment variables) are left to stand.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
from dataclasses import dataclass

M_TRIM_THRESHOLD = -1  # mallopt parameters (malloc.h)
M_MMAP_THRESHOLD = -3
TRIM_THRESHOLD = 1 << 30  # a free heap top below this stays mapped
MMAP_THRESHOLD = 32 << 20  # glibc's ceiling for it on 64-bit; chunks below come from the heap, so they are reused
USER_SETTINGS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_", "MALLOC_MMAP_MAX_")


@dataclass(slots=True, frozen=True)
class HeapSetting:
    applied: bool
    reason: str  # why not, or what was set


def keep_heap_mapped(environ: dict[str, str] | None = None) -> HeapSetting:
    """Raise glibc's trim and mmap thresholds for this process (once, at worker start)."""
    env = os.environ if environ is None else environ
    user = [name for name in USER_SETTINGS if name in env]
    if "glibc.malloc." in env.get("GLIBC_TUNABLES", ""):
        user.append("GLIBC_TUNABLES")
    if user:
        return HeapSetting(False, f"the user's malloc settings stand ({', '.join(user)})")
    if not sys.platform.startswith("linux"):
        return HeapSetting(False, "not Linux")
    libc = _glibc()
    if libc is None:
        return HeapSetting(False, "not glibc")
    libc.mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    if not (libc.mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD) and libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)):
        return HeapSetting(False, "mallopt refused the thresholds")
    return HeapSetting(True, f"trim threshold {TRIM_THRESHOLD >> 20} MiB, mmap threshold {MMAP_THRESHOLD >> 20} MiB")


def release_free_heap() -> bool:
    """Hand the heap's free pages back to the kernel, once (glibc's malloc_trim(0); False where there is none).

    Why: with the thresholds above, what loading freed stays resident for the process's life: the checkpoint's
    quantised blocks once packed into the kernels' panels (91 MB of the default model's), the float copies a fused
    matmul replaced. Called after the model is built and before the warm-up, so the steps' own memory is kept."""
    libc = _glibc()
    if libc is None or not sys.platform.startswith("linux"):
        return False
    libc.malloc_trim.argtypes, libc.malloc_trim.restype = (ctypes.c_size_t,), ctypes.c_int
    return bool(libc.malloc_trim(0))


def _glibc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # NOTE: glibc only: musl's mallopt is a stub that does nothing
    except (OSError, AttributeError):
        return None
    return libc
