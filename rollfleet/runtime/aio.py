"""Stopping asyncio tasks within a bound, for every side's shutdown; bounded blocking calls."""

from __future__ import annotations

import asyncio
import contextlib
import threading
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

T = TypeVar("T")


async def stop_tasks(tasks: Iterable[asyncio.Task[Any]], timeout: float = 5.0) -> None:
    """Cancel ``tasks`` and wait for them, but never longer than ``timeout``."""
    tasks = [t for t in tasks if not t.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=timeout)


class StuckThread(TimeoutError):
    """A call on a daemon thread did not return in time; ``thread`` is still running it."""

    def __init__(self, message: str, thread: threading.Thread) -> None:
        super().__init__(message)
        self.thread = thread


async def call_bounded(fn: Callable[..., T], *args: Any, timeout: float, name: str = "rf-bounded") -> T:
    """``fn(*args)`` on a fresh daemon thread, awaited for at most ``timeout`` seconds.

    Unlike ``asyncio.to_thread`` (the loop's default executor, which the interpreter joins at
    exit), a call stuck in a read that never returns is abandoned: :class:`StuckThread` is
    raised and the process can still exit.
    """
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not future.done():
            future.set_result(value) if ok else future.set_exception(value)

    def run() -> None:
        try:
            result: Any = (True, fn(*args))
        except BaseException as exc:
            result = (False, exc)
        with contextlib.suppress(RuntimeError):  # the loop may be closed by now
            loop.call_soon_threadsafe(settle, *result)

    thread = threading.Thread(target=run, name=name, daemon=True)
    thread.start()
    try:
        return await asyncio.wait_for(asyncio.shield(future), timeout)
    except TimeoutError:
        raise StuckThread(f"{name} did not return within {timeout:g} s", thread) from None
