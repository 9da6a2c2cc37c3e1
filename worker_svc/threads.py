"""Compute threads that follow the cores other processes leave free (the CPU worker's default).

Why: the forward is hundreds of OpenMP regions per step, each split evenly over the threads and ended by a barrier.
When another process keeps one of two cores busy, every region waits for the descheduled thread's next time
slice: measured 3.3x slower with 2 threads than with 1 beside a one-core hog, while on a quiet machine 2 threads are
1.3x faster. So the worker starts with every core it may use and, about once a second, reads how long its threads
waited for a CPU (/proc/self/task/*/schedstat run_delay) and how idle its cores were (/proc/stat): it gives up a
thread when its threads queue for CPUs, and takes one back when a core sits idle, with a growing hold-off so that
a steady neighbour does not make it flap.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

# libgomp's threads spin this many rounds at a barrier before they sleep. Its default, 300,000 (~3 ms here), kept the
# worker's second thread spinning through the ~3 ms between two steps, on the core the scheduler and both sides'
# gRPC threads needed then (float32, 64 requests: the worker waited 3.5 -> 1.7 ms a step, 0.48 -> 0.30 s a run);
# 20,000 (~0.2 ms) still outlasts the gaps between a step's own parallel regions (steps measured as fast).
OMP_SPIN_COUNT = 20000
SHRINK_WAITING = 0.35  # cores' worth of time our threads were runnable but not running: contended
GROW_IDLE = 0.6  # cores' worth of idle time on our CPUs: room for one more thread
INTERVAL_S = 1.0
HOLD_S, MAX_HOLD_S = 5.0, 120.0  # after giving a thread up, wait this long (doubling on flaps) before growing


def bound_openmp_spin(environ=os.environ) -> bool:
    """Sets GOMP_SPINCOUNT to OMP_SPIN_COUNT unless GOMP_SPINCOUNT or OMP_WAIT_POLICY is set already (the user's
    choice stands); True when it set it. NOTE: libgomp reads it once, as torch loads it: call before importing torch."""
    if "GOMP_SPINCOUNT" in environ or "OMP_WAIT_POLICY" in environ:
        return False
    environ["GOMP_SPINCOUNT"] = str(OMP_SPIN_COUNT)
    return True


@dataclass(slots=True, frozen=True)
class CpuSample:
    at: float  # monotonic seconds
    idle_s: float  # idle + iowait seconds summed over our CPUs since boot
    run_delay_s: float  # seconds our threads have spent waiting on a run queue, summed over them


def read_sample(cpus: frozenset[int] | None = None) -> CpuSample | None:
    """Now's counters, or None where /proc does not have them (not Linux, no schedstats)."""
    try:
        tick = os.sysconf("SC_CLK_TCK")
        idle = 0
        for line in Path("/proc/stat").read_text().splitlines():
            if not line.startswith("cpu") or line.startswith("cpu "):
                continue
            name, *fields = line.split()
            if cpus is None or int(name[3:]) in cpus:
                idle += int(fields[3]) + int(fields[4])
        delay = 0
        for task in Path("/proc/self/task").iterdir():
            try:
                delay += int((task / "schedstat").read_text().split()[1])
            except (OSError, IndexError, ValueError):
                continue  # the thread ended meanwhile
        return CpuSample(time.monotonic(), idle / tick, delay / 1e9)
    except (OSError, ValueError):
        return None


def decide(threads: int, max_threads: int, waiting: float, idle: float) -> int:
    """The next thread count from one window's contention (`waiting`) and spare capacity (`idle`), in cores."""
    if threads > 1 and waiting > SHRINK_WAITING:
        return threads - 1
    if threads < max_threads and idle > GROW_IDLE:
        return threads + 1
    return threads


class ThreadGovernor:
    """Call tick() once per step; it calls set_threads(n) when the thread count should change."""

    def __init__(self, max_threads: int, set_threads: Callable[[int], None],
                 read: Callable[[], CpuSample | None] | None = None, on_change=None) -> None:
        self.max_threads = max(1, max_threads)
        self.threads = self.max_threads
        self._set = set_threads
        cpus = frozenset(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        self._read = read or (lambda: read_sample(cpus))
        self._on_change = on_change or (lambda old, new, waiting, idle: None)
        self._last = self._read()
        self._hold_until = 0.0
        self._hold = HOLD_S
        self._last_grow = -1e9
        set_threads(self.threads)

    @property
    def enabled(self) -> bool:
        return self._last is not None and self.max_threads > 1

    def tick(self) -> None:
        if not self.enabled:
            return
        now = self._read()
        if now is None or now.at - self._last.at < INTERVAL_S:
            return
        window = now.at - self._last.at
        waiting = (now.run_delay_s - self._last.run_delay_s) / window
        idle = (now.idle_s - self._last.idle_s) / window
        self._last = now
        new = decide(self.threads, self.max_threads, waiting, idle)
        if new > self.threads and now.at < self._hold_until:
            return
        if new == self.threads:
            return
        if new < self.threads:
            # Giving up a thread right after taking it back is a flap: hold off longer before the next try.
            self._hold = min(self._hold * 2, MAX_HOLD_S) if now.at - self._last_grow < 3 * INTERVAL_S else HOLD_S
            self._hold_until = now.at + self._hold
        else:
            self._last_grow = now.at
        self._on_change(self.threads, new, waiting, idle)
        self.threads = new
        self._set(new)
