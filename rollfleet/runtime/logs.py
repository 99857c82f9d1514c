"""structlog set-up: JSON lines when not on a terminal, readable console output when on one."""

from __future__ import annotations

import logging
import os
import sys

import structlog


def configure(level: str | None = None, json: bool | None = None) -> None:
    """Configure logging once per process. ROLLFLEET_LOG_LEVEL / ROLLFLEET_LOG_JSON override."""
    level = (level or os.environ.get("ROLLFLEET_LOG_LEVEL") or "info").upper()
    if json is None:
        env = os.environ.get("ROLLFLEET_LOG_JSON")
        json = env == "1" if env is not None else not sys.stderr.isatty()
    renderer: structlog.typing.Processor = (
        structlog.processors.JSONRenderer() if json else structlog.dev.ConsoleRenderer(colors=False)
    )
    structlog.configure(
        processors=[
            structlog.contextvars.merge_contextvars,
            structlog.processors.add_log_level,
            structlog.processors.TimeStamper(fmt="iso", utc=True),
            structlog.processors.format_exc_info,
            renderer,
        ],
        wrapper_class=structlog.make_filtering_bound_logger(getattr(logging, level, logging.INFO)),
        logger_factory=structlog.PrintLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def get_logger(name: str, **bound: object) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger(name).bind(**bound)


def configure_default() -> None:
    """Library default: warnings and up, unless the application configured structlog itself."""
    if not structlog.is_configured():
        configure(os.environ.get("ROLLFLEET_LOG_LEVEL") or "warning")
