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
