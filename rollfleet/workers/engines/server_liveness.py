"""Whether the inference server is alive: its exit noticed at once, ``/health`` asked on a timer.

A launched server that exits is noticed at once (a task waits on the process); with
``health_interval_s`` the adapter also asks ``/health`` that often, and a server that does not
answer within ``health_timeout_s`` counts as hung. Either way the engine is *down*
(``_mark_down``): requests in flight fail at once (they wait on ``_down_changed``), new ones are
refused, and ``health()`` says why in one line, until the server answers again. Down *for good*
(``_broken``) is not cleared by an answer. Part of ``HTTPServerEngine`` (``http_server``).
"""

from __future__ import annotations

import asyncio

import httpx


class ServerLiveness:
    """Watching the server, and the engine's down state (``_down``: why; None while it serves)."""

    def _init_liveness(self) -> None:
        self._down: str | None = None  # why the server counts as dead or hung; None while it serves
        self._broken = False  # down for good: its answering /health again does not clear it
        self._down_changed = asyncio.Event()  # set whenever _down becomes set
        self._watchers: list[asyncio.Task[None]] = []

    def _start_watching(self) -> None:
        """After start: notice a launched server's exit at once, and poll ``/health`` if asked to."""
        if self.process is not None:
            self._watchers.append(asyncio.create_task(self._watch_exit(self.process), name="server-exit"))
        if self.health_interval_s > 0:
            self._watchers.append(asyncio.create_task(self._watch_health(), name="server-health"))

    async def _watch_exit(self, process: asyncio.subprocess.Process) -> None:
        await process.wait()
        if not self._closed:
            exited = await self._exited() or f"{self.server_name} server exited"
            if self._down is None:
                self._mark_down(exited)
            else:
                self._down = exited  # the most precise account of what happened

    async def _watch_health(self) -> None:
        while not self._closed:
            await asyncio.sleep(self.health_interval_s)
            if self.process is not None and self.process.returncode is not None:
                continue  # (said by _watch_exit; a launched server does not come back)
            problem = await self._diagnose()
            if problem is not None:
                self._mark_down(problem)
            elif not self._broken and await self._check_served() is None:
                self._down = None  # an attached server that answers again, at the live version, serves

    async def _diagnose(self) -> str | None:
        """What is wrong with the server (one line), None if it serves: its exit, or else its
        answer to ``/health``; a server that just died is given a moment to say so by its exit."""
        problem = await self._exited() or await self._probe()
        if problem is not None:
            problem = await self._exited(0.5) or problem
        return problem

    async def _probe(self) -> str | None:
        """One ``/health`` question: None if the server answers 200, else what is wrong. A
        connection the server dropped (it closes idle ones on its own schedule, later under load)
        is asked again once on a fresh one: a dropped connection is not a dead server."""
        for attempt in range(2):
            try:
                r = await self._http.get(self.health_path, timeout=self.health_timeout_s)
                break
            except httpx.TimeoutException:
                return (
                    f"{self.server_name} server gave no answer to {self.health_path} in "
                    f"{self.health_timeout_s:g} s (hung?)"
                )
            except httpx.HTTPError as exc:
                if attempt == 0 and isinstance(exc, httpx.RemoteProtocolError):
                    continue
                return f"{self.server_name} server unreachable at {self.url} ({type(exc).__name__})"
        if r.status_code != 200:
            return f"{self.server_name} {self.health_path}: HTTP {r.status_code}"
        return None

    def _mark_down(self, detail: str, *, for_good: bool = False) -> None:
        self._broken = self._broken or for_good
        if for_good:
            self._down = None  # (this account replaces any earlier one)
        if self._down is None:
            self._down = detail
            self._down_changed.set()
            self._down_changed = asyncio.Event()

    @property
    def down(self) -> str | None:
        """Why the server counts as dead or hung (one line); None while it serves."""
        return self._down
