"""structlog set-up: JSON lines when not on a terminal, readable console output when on one."""

from __future__ import annotations

import logging
import os
import sys

import structlog


class LineLogger(structlog.PrintLogger):
    """A PrintLogger whose failed writes are dropped, never raised into the code that logs.

    A log line that cannot be written (its file on a disk that is full or failing: ENOSPC, EFBIG,
    EROFS, EIO) must not break what was being logged: a worker whose disk fills up would
    otherwise fail every step that logs (its failed prepare included, before it says
    ``degraded``) while it could still serve. What was dropped is counted, and said on the
    first line written after.
    """

    dropped = 0  # lines not written since the last one that was (per process: one stderr)
    json = True

    def msg(self, message: str) -> None:
        f = self._file if self._file is not sys.stdout else None
        with self._lock:
            try:
                if LineLogger.dropped:
                    print(self._dropped_line(LineLogger.dropped), file=f, flush=True)
                    LineLogger.dropped = 0
                print(message, file=f, flush=True)
            except OSError:
                LineLogger.dropped += 1

    @staticmethod
    def _dropped_line(count: int) -> str:
        import json
        from datetime import UTC, datetime

        event = {"event": "log lines dropped", "count": count, "level": "warning"}
        event["timestamp"] = datetime.now(UTC).isoformat().replace("+00:00", "Z")
        return json.dumps(event) if LineLogger.json else f"[warning  ] log lines dropped count={count}"

    log = debug = info = warn = warning = msg
    fatal = failure = err = error = critical = exception = msg


class LineLoggerFactory(structlog.PrintLoggerFactory):
    def __call__(self, *args: object) -> LineLogger:
        return LineLogger(self._file)


def configure(level: str | None = None, json: bool | None = None) -> None:
    """Configure logging once per process. ROLLFLEET_LOG_LEVEL / ROLLFLEET_LOG_JSON override."""
    level = (level or os.environ.get("ROLLFLEET_LOG_LEVEL") or "info").upper()
    if json is None:
        env = os.environ.get("ROLLFLEET_LOG_JSON")
        json = env == "1" if env is not None else not sys.stderr.isatty()
    LineLogger.json = json
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
        logger_factory=LineLoggerFactory(file=sys.stderr),
        cache_logger_on_first_use=False,
    )


def get_logger(name: str, **bound: object) -> structlog.typing.FilteringBoundLogger:
    return structlog.get_logger(name).bind(**bound)


def debug_enabled(logger: object) -> bool:
    """Whether ``logger`` writes debug lines, for a hot path that builds a debug line's fields only
    then. A structlog logger's level is fixed when it is made (its class filters); one that
    cannot say is taken to write them."""
    enabled = getattr(logger, "is_enabled_for", None)
    return enabled is None or bool(enabled(logging.DEBUG))


def configure_default() -> None:
    """Library default: warnings and up, unless the application configured structlog itself."""
    if not structlog.is_configured():
        configure(os.environ.get("ROLLFLEET_LOG_LEVEL") or "warning")
