"""asyncio plumbing: stopping tasks within a bound; blocking work that never delays an exit."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import AsyncIterator, Callable, Iterable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

T = TypeVar("T")


async def stop_tasks(tasks: Iterable[asyncio.Task[Any]], timeout: float = 5.0) -> None:
    """Cancel ``tasks`` and wait for them, but never longer than ``timeout``."""
    tasks = [t for t in tasks if not t.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=timeout)


async def cancel_until_done(task: asyncio.Task[Any], timeout: float, every_s: float = 0.5) -> bool:
    """Cancel ``task`` and wait up to ``timeout`` for it to end, cancelling it again every
    ``every_s`` while it runs: Python 3.11's ``asyncio.wait_for`` (under every nats-py request)
    swallows a cancel that lands as its answer arrives (CPython gh-86296), and a task that loops
    on requests then runs on as if never cancelled. For a task with no cleanup that must finish
    once cancelled (a start abandoned). True if it ended."""
    until = time.monotonic() + timeout
    while not task.done():
        left = until - time.monotonic()
        if left <= 0:
            return False
        task.cancel()
        await asyncio.wait([task], timeout=min(every_s, left))
    return True


class KeyedLocks:
    """One lock per key, kept only while someone holds or waits for it: a long-lived server that
    serializes work per session id keeps no lock for every id it ever saw."""

    def __init__(self) -> None:
        self._locks: dict[str, tuple[asyncio.Lock, list[int]]] = {}  # key -> (its lock, [users])

    def __len__(self) -> int:
        return len(self._locks)

    @asynccontextmanager
    async def hold(self, key: str) -> AsyncIterator[None]:
        lock, users = self._locks.setdefault(key, (asyncio.Lock(), [0]))
        users[0] += 1
        try:
            async with lock:
                yield
        finally:
            users[0] -= 1
            if not users[0]:
                del self._locks[key]


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
