"""Stopping a service process at once from a signal handler (model loading, start-up, a second Ctrl-C)."""

from __future__ import annotations

import os
import signal
import sys


def exit_now(signum: int = 0, frame=None) -> None:
    """A signal handler that ends the process at once, with status 0. NOTE: not sys.exit(): its SystemExit is
    raised wherever the main thread happens to be, and there (in a __del__, a callback, an import) it may only be
    printed ("Exception ignored in ...") while the process goes on."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # closed, or a broken pipe: nothing more to say anyway
            pass
    os._exit(0)


def exit_on_stop_signals() -> None:
    """Until the service installs its own handlers, SIGTERM and SIGINT just exit (no KeyboardInterrupt traceback
    from the middle of an import)."""
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, exit_now)
