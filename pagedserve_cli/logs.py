"""structlog set-up: JSON lines when stderr is not a terminal, readable lines when it is."""

from __future__ import annotations

import logging
import sys

import structlog


def configure(level: str = "info") -> None:
    processors = [structlog.contextvars.merge_contextvars, structlog.processors.add_log_level,
                  structlog.processors.TimeStamper(fmt="iso")]
    renderer = (structlog.dev.ConsoleRenderer() if sys.stderr.isatty()
                else structlog.processors.JSONRenderer())
    structlog.configure(processors=[*processors, renderer],
                        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level.upper())),
                        logger_factory=structlog.PrintLoggerFactory(sys.stderr), cache_logger_on_first_use=True)
