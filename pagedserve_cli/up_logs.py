"""`pagedserve up`'s stderr: its children's lines relayed with the name of the process that wrote each (`process`),
as JSON lines when stderr is not a terminal (up's own lines included), and each child's last error kept."""

from __future__ import annotations

import datetime
import json
import os
import re
import sys
import threading
from dataclasses import dataclass, field

from pagedserve_cli.logs import FORMAT_VARIABLE, json_wanted

UP = "up"  # the `process` of up's own lines
# NOTE: lines no logger of ours wrote: gRPC's C++ core (glog: "E1201 22:01:33.92 7656 file.cc:56] ..."), a start-up
# failure (`pagedserve worker: error: ...`), a traceback, a library's warning
GLOG = re.compile(r"^([EWIF])\d{4} ")
GLOG_LEVELS = {"E": "error", "W": "warning", "I": "info", "F": "critical"}
ERROR_LINE = re.compile(r"^pagedserve [\w-]+: error: (.*)$")
MAX_LINE_BYTES = 1 << 16  # a longer line (none of ours: logs.truncate_long_values) is relayed in pieces


def json_lines() -> bool:
    """Whether up's stderr gets JSON lines: when it is not a terminal (a file, a pipe, a supervisor), unless
    PAGEDSERVE_LOG_FORMAT says otherwise (a bad value raises StartupError, which pagedserve_cli.main reports)."""
    return json_wanted()


def now() -> str:
    """structlog's TimeStamper(fmt="iso") format: UTC, microseconds, Z."""
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


@dataclass
class Relay:
    """Writes up's lines and its children's to up's stderr, one write() per line (lines never run together)."""

    json: bool = field(default_factory=json_lines)
    lock: threading.Lock = field(default_factory=threading.Lock)
    last_error: dict[str, str] = field(default_factory=dict)  # child name -> its last error line's message

    def child_env(self) -> dict[str, str]:
        """A child's environment: its log format is up's (its stderr is a pipe to up, not up's terminal), and no
        progress bars (carriage returns within one line, which the relay would show as one garbled line)."""
        return {"HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1", **os.environ,
                FORMAT_VARIABLE: "json" if self.json else "console"}

    def say(self, message: str, level: str = "info", **fields) -> None:
        """One of up's own lines: `pagedserve up: MESSAGE` on a terminal, JSON otherwise."""
        if self.json:
            self._write(json.dumps({"process": UP, "event": message, **fields, "level": level,
                                    "timestamp": now()}, ensure_ascii=False))
        else:
            shown = f"error: {message}" if level == "error" else message
            extra = "".join(f" {k}={v}" for k, v in fields.items())
            self._write(f"pagedserve up: {shown}{extra}")

    def follow(self, name: str, pipe) -> threading.Thread:
        """Relays the child `name`'s stderr (`pipe`, binary) line by line until it closes, in a thread."""
        thread = threading.Thread(target=self._pump, args=(name, pipe), name=f"relay {name}", daemon=True)
        thread.start()
        return thread

    def _pump(self, name: str, pipe) -> None:
        with pipe:
            while chunk := pipe.readline(MAX_LINE_BYTES):
                self.line(name, chunk.decode("utf-8", "replace").rstrip("\r\n"))

    def line(self, name: str, text: str) -> None:
        """A line the child `name` wrote: tagged with `process` (JSON), or prefixed with it (a terminal)."""
        record = parse(text)
        if record is not None and record.get("level") in ("error", "critical"):
            # NOTE: with its details, when it has some: a refusal's reason (the worker's "the scheduler refused this
            # worker") is there, and up's last line should say it
            details = record.get("details")
            self.last_error[name] = str(record.get("event", text)) + (f": {details}" if details else "")
        elif record is None and (m := ERROR_LINE.match(text)):
            self.last_error[name] = m.group(1)
        if not self.json:
            self._write(f"{name:<9} | {text}")
        elif record is not None:
            record.pop("process", None)  # NOTE: up's name for it is the more precise (worker-1, not worker)
            self._write(json.dumps({"process": name, **record}, ensure_ascii=False))
        elif text.strip():
            self._write(json.dumps({"process": name, "event": text, "level": level_of(text), "timestamp": now()},
                                   ensure_ascii=False))

    def _write(self, line: str) -> None:
        data = memoryview((line + "\n").encode("utf-8", "backslashreplace"))
        with self.lock:
            try:
                while data:  # NOTE: a signal may cut a write short
                    data = data[os.write(sys.stderr.fileno(), data):]
            except OSError:  # NOTE: nobody reads up's stderr any more (a closed pipe): the children go on
                pass


def parse(text: str) -> dict | None:
    """The JSON object a line holds, or None (a plain line)."""
    if not text.startswith("{"):
        return None
    try:
        record = json.loads(text)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def level_of(text: str) -> str:
    """The level of a plain line: glog's letter, error for a start-up failure or a traceback, else warning (none of
    our loggers wrote it: worth a look)."""
    if m := GLOG.match(text):
        return GLOG_LEVELS[m.group(1)]
    if ERROR_LINE.match(text) or text.startswith("Traceback"):
        return "error"
    return "warning"
