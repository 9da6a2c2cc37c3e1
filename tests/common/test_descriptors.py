"""The open files limit raised at start, and errors that recur logged once per interval with their count."""

from __future__ import annotations

import errno
import resource

from pagedserve_common.descriptors import ACCEPT_OUT_OF_RESOURCE, AcceptErrors, EveryInterval, raise_open_files_limit


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_recurring_event_is_logged_at_once_then_once_per_interval_with_its_count():
    clock, lines = Clock(), []
    limit = EveryInterval(interval=10.0, clock=clock)
    for second in range(25):  # 4 a second for 25 s
        clock.now = float(second)
        for _ in range(4):
            limit.note("EMFILE", lines.append)
    assert lines == [1, 40, 40]  # at 0 s, 10 s and 20 s: each with the count since the line before
    limit.note("ENOMEM", lines.append)  # another key has its own interval
    assert lines[-1] == 1


class Loop:
    def __init__(self) -> None:
        self.passed_on = []

    def default_exception_handler(self, context) -> None:
        self.passed_on.append(context)


def test_accept_errors_are_counted_and_anything_else_goes_to_the_default_handler():
    lines = []

    class Recording(EveryInterval):
        def note(self, key, emit) -> None:
            lines.append(key)

    handler, loop = AcceptErrors(Recording()), Loop()
    for _ in range(1000):
        handler(loop, {"message": ACCEPT_OUT_OF_RESOURCE, "exception": OSError(errno.EMFILE, "Too many open files"),
                       "socket": object()})
    other = {"message": "Task exception was never retrieved", "exception": ValueError("x")}
    handler(loop, other)
    assert handler.num_errors == 1000 and set(lines) == {"EMFILE"} and loop.passed_on == [other]


def test_the_soft_open_files_limit_is_raised_to_the_hard_one():
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 512), hard))
        raised = raise_open_files_limit("test")
        assert resource.getrlimit(resource.RLIMIT_NOFILE)[0] == raised
        assert raised == (hard if hard != resource.RLIM_INFINITY else max(512, 1 << 20)) or raised == 512
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
