"""Stopping asyncio tasks within a bound, for every side's shutdown."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from typing import Any


async def stop_tasks(tasks: Iterable[asyncio.Task[Any]], timeout: float = 5.0) -> None:
    """Cancel ``tasks`` and wait for them, but never longer than ``timeout``."""
    tasks = [t for t in tasks if not t.done()]
    for task in tasks:
        task.cancel()
    if tasks:
        await asyncio.wait(tasks, timeout=timeout)
