"""structlog set-up: JSON lines when stderr is not a terminal, readable lines when it is (PAGEDSERVE_LOG_FORMAT
decides instead when set); info and above unless PAGEDSERVE_LOG_LEVEL says otherwise; long values cut short."""

from __future__ import annotations

import logging
import os
import sys

import structlog

from pagedserve_common.startup import USAGE, StartupError

# A longer value (a client's huge request_id, an error message quoting it) is cut to this. NOTE: above the 256
# characters an admitted request_id may have (scheduler_svc.frontend.limits), so end lines keep whole ids.
FORMAT_VARIABLE, FORMATS = "PAGEDSERVE_LOG_FORMAT", ("json", "console")
MAX_VALUE_CHARS = 300
MAX_EVENT_CHARS = 1000  # the message itself (the standard library's loggers put their data in it)
MAX_TRACEBACK_CHARS = 8000  # a traceback keeps its end: the frames that raised and the exception itself
# NOTE: debug holds detail a user cannot act on (the worker's per-shape layout timings: worker_svc/linear.py);
# `up`'s children inherit the variable with the rest of its environment.
LEVEL_VARIABLE, LEVELS = "PAGEDSERVE_LOG_LEVEL", ("debug", "info", "warning", "error")


def cut(text: str, limit: int = MAX_VALUE_CHARS) -> str:
    """`text` if it fits in `limit` characters, else its head and how much was left off."""
    return text if len(text) <= limit else f"{text[:limit]}…(+{len(text) - limit} chars)"


def truncate_long_values(logger, method_name: str, event_dict: dict) -> dict:
    """structlog processor: no value makes a line longer than about MAX_VALUE_CHARS. NOTE: a client controls
    request ids, prompts and stop strings, so any value may be huge; containers are cut as their repr."""
    for key, value in event_dict.items():
        if key == "exception" and isinstance(value, str):
            if len(value) > MAX_TRACEBACK_CHARS:
                event_dict[key] = f"…({len(value) - MAX_TRACEBACK_CHARS} chars before)" \
                                  f"{value[-MAX_TRACEBACK_CHARS:]}"
        elif isinstance(value, str):
            event_dict[key] = cut(value, MAX_EVENT_CHARS if key == "event" else MAX_VALUE_CHARS)
        elif value is not None and not isinstance(value, (bool, int, float)):
            text = repr(value)
            if len(text) > MAX_VALUE_CHARS:
                event_dict[key] = cut(text)
    return event_dict


def disable_progress_bars() -> None:
    """No tqdm bars (model loading, downloads) in JSON logs: a bar is a stream of carriage returns, not a line.
    NOTE: set before transformers and huggingface_hub are imported, which read it once; this process's children
    (a model pull) inherit it. An explicit HF_HUB_DISABLE_PROGRESS_BARS=0 still wins."""
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TQDM_DISABLE", "1")
    if "transformers" in sys.modules:  # imported already (a test, or an import ahead of this call)
        import transformers

        transformers.utils.logging.disable_progress_bar()


class _Stderr:
    """stderr for the log, dropping a line it cannot write because nobody reads it any more (`up`, which reads its
    children's, was killed: they still drain and stop on their SIGTERM rather than die of a logging error)."""

    def write(self, text: str) -> None:
        try:
            sys.stderr.write(text)
        except BrokenPipeError:
            pass

    def flush(self) -> None:
        try:
            sys.stderr.flush()
        except BrokenPipeError:
            pass


def json_wanted() -> bool:
    """JSON lines unless stderr is a terminal; PAGEDSERVE_LOG_FORMAT (json or console) decides instead when set
    (`up` sets it for its children, whose stderr is a pipe to it)."""
    chosen = os.environ.get(FORMAT_VARIABLE, "").strip().lower()
    if chosen not in ("", *FORMATS):
        raise StartupError(f"environment variable {FORMAT_VARIABLE}: expected json or console, got {chosen!r}", USAGE)
    return chosen == "json" if chosen else not sys.stderr.isatty()


def level_wanted(default: str = "info") -> str:
    """PAGEDSERVE_LOG_LEVEL (debug, info, warning or error), else `default`."""
    chosen = os.environ.get(LEVEL_VARIABLE, "").strip().lower()
    if chosen not in ("", *LEVELS):
        raise StartupError(f"environment variable {LEVEL_VARIABLE}: expected {', '.join(LEVELS)}, got {chosen!r}",
                           USAGE)
    return chosen or default


def configure(level: str | None = None) -> None:
    """structlog's and the standard library's logging, at `level` (default: level_wanted())."""
    level = level_wanted() if level is None else level
    json_lines = json_wanted()
    if json_lines:
        disable_progress_bars()
    shared = [structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
              structlog.processors.TimeStamper(fmt="iso")]
    if json_lines:  # NOTE: the console renderer formats exc_info itself (prettier); JSON needs it as a field
        shared.append(structlog.processors.format_exc_info)
    shared.append(truncate_long_values)
    renderer = structlog.processors.JSONRenderer() if json_lines else structlog.dev.ConsoleRenderer()
    # NOTE: WriteLogger writes each line and its newline in one write(): `up`'s children share one stderr, and
    # print() (two writes) let two processes' lines run together.
    structlog.configure(processors=[*shared, renderer],
                        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
                        logger_factory=structlog.WriteLoggerFactory(_Stderr()), cache_logger_on_first_use=True)
    # The standard library's loggers (asyncio, grpc, uvicorn, transformers) and warnings write through the same
    # renderer, so that every line of a JSON log is JSON. As before, only their warnings and errors are shown.
    handler = logging.StreamHandler(_Stderr())
    handler.setFormatter(structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.add_logger_name, *shared],
        processors=[structlog.stdlib.ProcessorFormatter.remove_processors_meta, renderer]))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.WARNING)
    logging.captureWarnings(True)  # NOTE: a library's warnings.warn() too (logger py.warnings), not a bare line
