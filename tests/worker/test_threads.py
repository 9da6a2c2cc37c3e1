"""ThreadGovernor: gives a compute thread up when its threads queue for CPUs, takes it back when a core idles."""

from __future__ import annotations

from worker_svc import threads as th
from worker_svc.threads import CpuSample, ThreadGovernor, decide, read_sample


def test_decide_from_one_window():
    assert decide(2, 2, waiting=0.7, idle=0.0) == 1  # a one-core neighbour: our two threads queue
    assert decide(1, 2, waiting=0.0, idle=0.0) == 1  # it is still there: the other core is busy
    assert decide(1, 2, waiting=0.0, idle=0.9) == 2  # it left
    assert decide(2, 2, waiting=0.1, idle=0.0) == 2  # our own scheduler's light load: keep both
    assert decide(1, 1, waiting=2.0, idle=0.0) == 1  # never below one
    assert decide(4, 4, waiting=0.0, idle=3.0) == 4  # never above the cores we may use


class FakeCpu:
    """Counters that advance by what the test says each second has: (waiting cores, idle cores)."""

    def __init__(self):
        self.sample = CpuSample(0.0, 0.0, 0.0)

    def advance(self, waiting: float, idle: float, seconds: float = 1.0):
        s = self.sample
        self.sample = CpuSample(s.at + seconds, s.idle_s + idle * seconds, s.run_delay_s + waiting * seconds)

    def read(self):
        return self.sample


def run(seconds_of: list[tuple[float, float]], max_threads: int = 2) -> tuple[list[int], list[int]]:
    cpu, calls = FakeCpu(), []
    gov = ThreadGovernor(max_threads, calls.append, read=cpu.read)
    history = []
    for waiting, idle in seconds_of:
        cpu.advance(waiting, idle)
        gov.tick()
        history.append(gov.threads)
    return history, calls


def test_a_neighbour_arrives_and_leaves():
    busy, quiet = (0.7, 0.0), (0.0, 0.9)
    history, calls = run([quiet, quiet, busy, (0.0, 0.0), (0.0, 0.0)] + [quiet] * 6)
    # Starts with every core, drops a thread in the first contended second, takes it back once the neighbour
    # has gone and the hold-off (HOLD_S = 5 s) has passed.
    assert history == [2, 2, 1, 1, 1, 1, 1, 2, 2, 2, 2]
    assert calls == [2, 1, 2]


def test_flapping_doubles_the_hold_off():
    busy, quiet = (0.7, 0.0), (0.0, 0.9)
    # A neighbour that returns every time we grow: the second drop comes right after a grow.
    history, _ = run([busy] + [quiet] * 5 + [busy] + [quiet] * 12)
    first_grow = history.index(2, 1)
    second_drop = first_grow + 1
    assert history[second_drop] == 1
    regrow = history.index(2, second_drop)
    assert regrow - second_drop == 2 * th.HOLD_S  # held twice as long


def test_ticks_within_a_second_change_nothing():
    cpu, calls = FakeCpu(), []
    gov = ThreadGovernor(2, calls.append, read=cpu.read)
    cpu.advance(0.9, 0.0, seconds=0.5)
    gov.tick()
    assert gov.threads == 2 and calls == [2]


def test_real_counters_are_read_on_linux():
    s = read_sample()
    assert s is not None and s.idle_s > 0 and s.run_delay_s >= 0


def test_one_core_means_no_governing():
    calls = []
    gov = ThreadGovernor(1, calls.append, read=FakeCpu().read)
    assert not gov.enabled and calls == [1]


def test_openmp_spin_is_bounded_unless_the_user_chose():
    env: dict[str, str] = {}
    assert th.bound_openmp_spin(env) is True
    assert env == {"GOMP_SPINCOUNT": str(th.OMP_SPIN_COUNT)}
    mine = {"GOMP_SPINCOUNT": "infinite"}
    assert th.bound_openmp_spin(mine) is False and mine == {"GOMP_SPINCOUNT": "infinite"}
    passive = {"OMP_WAIT_POLICY": "passive"}  # a spin count would override the user's policy
    assert th.bound_openmp_spin(passive) is False and passive == {"OMP_WAIT_POLICY": "passive"}


def test_the_worker_command_bounds_the_spin_before_torch_loads():
    """libgomp reads GOMP_SPINCOUNT once, when torch loads it: nothing the worker command imports before its call
    may import torch, and the variable is set when torch comes in."""
    import subprocess
    import sys

    code = ("import os, sys\n"
            "os.environ.pop('GOMP_SPINCOUNT', None); os.environ.pop('OMP_WAIT_POLICY', None)\n"
            "import pagedserve_cli.main, pagedserve_cli.serve_cmd, pagedserve_cli.access_args\n"
            "import pagedserve_common.descriptors, worker_svc.threads\n"
            "assert 'torch' not in sys.modules, 'torch came in before the spin count was set'\n"
            "worker_svc.threads.bound_openmp_spin()\n"
            "import worker_svc.client\n"
            "assert 'torch' in sys.modules\n"
            "print(os.environ['GOMP_SPINCOUNT'])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [str(th.OMP_SPIN_COUNT)]
    import inspect

    from pagedserve_cli.serve_cmd import run_worker

    source = inspect.getsource(run_worker)  # and the command calls it before it imports the worker
    assert source.index("bound_openmp_spin()") < source.index("from worker_svc.client import")
