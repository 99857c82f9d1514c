"""Whose turn it is to reach the vLLM server: a deterministic request runs alone.

A request alone waits until nothing else is sent and keeps others from being sent until it is
answered; others wait only while a request alone runs or waits (it is at the head of the queue).
vLLM 0.32's CPU build returns the same tokens and bit-identical log-probs for a seeded request
only when nothing runs beside it (``vllm``'s module docstring: Replay).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator


class Turns:
    def __init__(self) -> None:
        self._turns = asyncio.Condition()
        self._sent = 0  # requests sent and not yet answered
        self._alone_waiting = 0
        self._alone_running = False

    @contextlib.asynccontextmanager
    async def turn(self, alone: bool) -> AsyncIterator[None]:
        """Held while one request is sent and answered (``alone``: nothing beside it)."""
        async with self._turns:
            if alone:
                self._alone_waiting += 1
                try:
                    await self._turns.wait_for(lambda: self._sent == 0 and not self._alone_running)
                finally:
                    self._alone_waiting -= 1
                self._alone_running = True
            else:
                await self._turns.wait_for(lambda: not self._alone_running and not self._alone_waiting)
            self._sent += 1
        try:
            yield
        finally:
            async with self._turns:
                self._sent -= 1
                if alone:
                    self._alone_running = False
                self._turns.notify_all()
