"""asyncio plumbing: stopping tasks within a bound; blocking work that never delays an exit."""

from __future__ import annotations

import asyncio
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


async def wait_event(event: asyncio.Event, timeout: float | None) -> bool:
    """Wait until ``event`` is set, at most ``timeout`` seconds (None: no limit); whether it was.
    Not ``asyncio.wait_for``: on Python 3.11 that can swallow a cancellation arriving as the event
    is set, and a loop around it then runs on after its task was stopped (until a stop time-out)."""
    try:
        async with asyncio.timeout(timeout):
            await event.wait()
        return True
    except TimeoutError:
        return False


async def in_daemon_thread(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run blocking ``fn`` in a daemon thread and await it. Unlike ``asyncio.to_thread``, a
    cancelled caller is not held up at exit by the thread: for crash-safe work (materializing a
    checkpoint) that a stop signal must not wait for."""
    loop = asyncio.get_running_loop()
    future: asyncio.Future[T] = loop.create_future()

    def settle(ok: bool, value: Any) -> None:
        if not future.done():
            (future.set_result if ok else future.set_exception)(value)

    def work() -> None:
        try:
            value = fn(*args, **kwargs)
        except BaseException as exc:  # handed to the awaiting task
            loop.call_soon_threadsafe(settle, False, exc)
        else:
            loop.call_soon_threadsafe(settle, True, value)

    threading.Thread(target=work, name=getattr(fn, "__name__", "work"), daemon=True).start()
    return await future
