"""File descriptors: the soft limit raised to the hard one at start, and running out of them logged once a while."""

from __future__ import annotations

import errno
import resource
import time
from dataclasses import dataclass, field

import structlog

log = structlog.get_logger("pagedserve.descriptors")

# asyncio's own message for an accept() that failed for want of descriptors or memory (selector_events)
ACCEPT_OUT_OF_RESOURCE = "socket.accept() out of system resource"
OUT_OF_RESOURCE_ERRNOS = frozenset((errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM))
LOG_INTERVAL = 10.0  # seconds between two lines about the same recurring event


def raise_open_files_limit(process: str) -> int:
    """Raises this process's soft RLIMIT_NOFILE to its hard limit, logs both; returns the soft limit now.

    NOTE: every connection is a descriptor; the usual soft default (1024) is reached by a thousand idle clients,
    while the hard limit (often 2^19 or more) is there for the asking."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    raised = soft
    if hard == resource.RLIM_INFINITY or soft < hard:
        want = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
            raised = want
        except (ValueError, OSError) as e:  # NOTE: e.g. beyond fs.nr_open; the old limit holds
            log.warning("cannot raise the open files limit", soft=soft, hard=hard, error=str(e))
    log.info("open files limit", process=process, soft_was=soft, soft=raised,
             hard="unlimited" if hard == resource.RLIM_INFINITY else hard)
    return raised


@dataclass(slots=True)
class EveryInterval:
    """Logs a recurring event at most once per `interval` seconds per key, with how many times it happened since
    the last line (`count`). NOTE: a flood of identical errors otherwise fills the disk, not the operator's eyes."""

    interval: float = LOG_INTERVAL
    clock: object = time.monotonic
    _counts: dict = field(default_factory=dict)  # key -> occurrences not logged yet
    _logged_at: dict = field(default_factory=dict)  # key -> when its last line went out

    def note(self, key: str, emit) -> None:
        """Counts one occurrence of `key`; calls emit(count) when its interval is over (the first one at once)."""
        now = self.clock()
        self._counts[key] = self._counts.get(key, 0) + 1
        last = self._logged_at.get(key)
        if last is None or now - last >= self.interval:
            emit(self._counts.pop(key))
            self._logged_at[key] = now


class AcceptErrors:
    """An asyncio loop exception handler: accept() errors for want of descriptors or memory become one warning per
    LOG_INTERVAL with their count; anything else goes to the loop's default handler.

    NOTE: asyncio logs each failed accept() and retries a second later (selector_events._accept_connection);
    scheduler_svc.http.server stops its burst of retries, this stops the lines."""

    def __init__(self, limit: EveryInterval | None = None) -> None:
        self.limit = limit or EveryInterval()
        self.num_errors = 0

    def __call__(self, loop, context: dict) -> None:
        exc = context.get("exception")
        if context.get("message") != ACCEPT_OUT_OF_RESOURCE and not (
                isinstance(exc, OSError) and exc.errno in OUT_OF_RESOURCE_ERRNOS and "socket" in context):
            loop.default_exception_handler(context)
            return
        self.num_errors += 1
        error = errno.errorcode.get(getattr(exc, "errno", None) or 0, str(exc))
        self.limit.note(error, lambda count: log.warning(
            "cannot accept connections: out of descriptors or memory; retrying every second", error=error,
            count=count, interval_s=self.limit.interval, limit=resource.getrlimit(resource.RLIMIT_NOFILE)[0]))
