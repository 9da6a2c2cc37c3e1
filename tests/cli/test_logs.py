"""pagedserve_cli.logs: long values cut short, JSON lines for every logger, no progress bars in JSON logs."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from pagedserve_cli.logs import MAX_TRACEBACK_CHARS, MAX_VALUE_CHARS, cut, truncate_long_values


def test_long_strings_are_cut_and_say_how_much_was_left_off():
    assert cut("abc", 5) == "abc"
    assert cut("x" * 6, 5) == "xxxxx…(+1 chars)"
    huge = "r" * 100_000
    out = truncate_long_values(None, "info", {"event": "request rejected", "request_id": huge, "n": 3,
                                              "ok": True, "ratio": 0.5, "worker": None})
    assert out["request_id"] == "r" * MAX_VALUE_CHARS + f"…(+{100_000 - MAX_VALUE_CHARS} chars)"
    assert (out["event"], out["n"], out["ok"], out["ratio"], out["worker"]) == ("request rejected", 3, True, 0.5, None)


def test_a_whole_request_id_stays_whole():
    """Admitted request ids have up to 256 characters (frontend.limits): their end lines must keep them."""
    rid = "i" * 256
    assert truncate_long_values(None, "info", {"request_id": rid})["request_id"] == rid


def test_containers_are_cut_as_their_repr_and_tracebacks_keep_their_end():
    out = truncate_long_values(None, "info", {"stop": ["s" * 10_000], "ids": list(range(5))})
    assert out["stop"].startswith("['sss") and out["stop"].endswith("chars)")
    assert len(out["stop"]) < MAX_VALUE_CHARS + 30
    assert out["ids"] == [0, 1, 2, 3, 4]  # short: left as it is
    tb = "Traceback (most recent call last):\n" + "  frame\n" * 5000 + "ValueError: the cause"
    cut_tb = truncate_long_values(None, "error", {"exception": tb})["exception"]
    assert cut_tb.endswith("ValueError: the cause") and len(cut_tb) < MAX_TRACEBACK_CHARS + 50


CONFIGURED = """
import logging, sys
import structlog
from pagedserve_cli.logs import configure
configure()
structlog.get_logger("t").info("big", request_id="x" * 1_000_000)
logging.getLogger("asyncio").error("Task was destroyed but it is pending! %s", "y" * 1_000_000)
try:
    1 / 0
except ZeroDivisionError:
    structlog.get_logger("t").exception("failed")
import warnings
warnings.warn("an old API", FutureWarning)
from transformers.utils import logging as tlogging
print(tlogging.is_progress_bar_enabled())
"""


def test_json_logs_bound_every_line_route_stdlib_loggers_and_have_no_progress_bars():
    """stderr is a pipe here, as under a supervisor: JSON lines."""
    out = subprocess.run([sys.executable, "-c", CONFIGURED], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"  # transformers' bars (model loading) are off
    lines = out.stderr.splitlines()
    assert len(lines) == 4 and all(len(line) < 2000 for line in lines), [len(line) for line in lines]
    big, stdlib, failed, warned = map(json.loads, lines)
    assert (warned["logger"], warned["level"]) == ("py.warnings", "warning") and "an old API" in warned["event"]
    assert big["event"] == "big" and big["request_id"].endswith("chars)")
    assert (stdlib["logger"], stdlib["level"]) == ("asyncio", "error")
    assert stdlib["event"].startswith("Task was destroyed but it is pending! yyy")
    assert failed["level"] == "error" and failed["exception"].endswith("ZeroDivisionError: division by zero")


def test_the_log_format_can_be_chosen():
    """PAGEDSERVE_LOG_FORMAT=console: readable lines though stderr is a pipe (`up` sets it for its children when
    its own stderr is a terminal); json: JSON lines."""
    env = {**os.environ, "PAGEDSERVE_LOG_FORMAT": "console"}
    out = subprocess.run([sys.executable, "-c", CONFIGURED], capture_output=True, text=True, timeout=300, env=env)
    assert out.returncode == 0 and not out.stderr.startswith("{") and "big" in out.stderr, out.stderr
    env["PAGEDSERVE_LOG_FORMAT"] = "yaml"
    out = subprocess.run([sys.executable, "-m", "pagedserve_cli.main", "scheduler"], capture_output=True, text=True,
                         timeout=300, env=env)
    assert (out.returncode, out.stderr.strip()) == (2, "pagedserve scheduler: error: environment variable "
                                                       "PAGEDSERVE_LOG_FORMAT: expected json or console, got 'yaml'")


LEVELLED = """
import structlog
from pagedserve_cli.logs import configure
configure()
structlog.get_logger("t").debug("linear layout timed", ms={256: [0.1, 0.2]})
structlog.get_logger("t").info("worker ready")
"""


def test_debug_lines_show_only_when_pagedserve_log_level_asks_for_them():
    """Detail a user cannot act on (per-shape timings) is logged at debug: hidden by default,
    PAGEDSERVE_LOG_LEVEL=debug shows it; a bad level is a usage error naming the variable."""
    env = {k: v for k, v in os.environ.items() if k != "PAGEDSERVE_LOG_LEVEL"}

    def events(**extra: str) -> list[tuple[str, str]]:
        out = subprocess.run([sys.executable, "-c", LEVELLED], capture_output=True, text=True, timeout=300,
                             env={**env, **extra})
        assert out.returncode == 0, out.stderr
        return [(e["level"], e["event"]) for e in map(json.loads, out.stderr.splitlines())]

    assert events() == [("info", "worker ready")]
    assert events(PAGEDSERVE_LOG_LEVEL="debug") == [("debug", "linear layout timed"), ("info", "worker ready")]
    assert events(PAGEDSERVE_LOG_LEVEL="WARNING") == []
    out = subprocess.run([sys.executable, "-m", "pagedserve_cli.main", "scheduler"], capture_output=True, text=True,
                         timeout=300, env={**env, "PAGEDSERVE_LOG_LEVEL": "loud"})
    assert (out.returncode, out.stderr.strip()) == (2, "pagedserve scheduler: error: environment variable "
                                                       "PAGEDSERVE_LOG_LEVEL: expected debug, info, warning, error, "
                                                       "got 'loud'")
