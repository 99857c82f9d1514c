"""Waiting for a condition: one poll loop, bounded, for every test, benchmark and scenario."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")
_RAISE: Any = object()


class WaitTimeout(AssertionError):
    """A condition was not met in time (an AssertionError, so a test fails with it)."""


async def wait_until(
    check: Callable[[], Awaitable[T] | T],
    timeout: float = 10.0,
    *,
    what: str = "condition",
    interval: float = 0.05,
    retry_errors: bool = False,
    default: Any = _RAISE,
) -> T:
    """Call ``check`` (sync or async) every ``interval`` until it returns a truthy value, and
    return that value.

    ``retry_errors``: an exception from ``check`` counts as "not yet" (the last one is named at
    the time-out); otherwise it propagates. At the time-out, return ``default`` if one was
    given, else raise :class:`WaitTimeout`.
    """
    deadline = time.monotonic() + timeout
    last_error: BaseException | None = None
    while True:
        try:
            value = check()
            if inspect.isawaitable(value):
                value = await value
        except Exception as exc:
            if not retry_errors:
                raise
            last_error, value = exc, None
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() >= deadline:
            if default is not _RAISE:
                return default  # type: ignore[no-any-return]
            detail = f": last error {last_error!r}" if last_error is not None else ""
            raise WaitTimeout(f"{what} not met within {timeout:g}s{detail}") from last_error
        await asyncio.sleep(interval)
