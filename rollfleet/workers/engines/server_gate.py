"""The request gate: during an activation no new request reaches the server.

During an activation (``pause`` .. ``resume``) no new request reaches the server, so every
request starts on the weights the adapter last made live. A pause the server refused reopens the
gate at once (and asks the server to continue); a server that may still be paused outside an
activation (a failed ``resume``, which does not undo the activation) makes the engine not healthy
and refuses requests until a later ask (each health look and each request asks) gets it to
continue (``gate_decision``). A request waiting at the gate can be aborted there (an
activation's drain gives up on it). Part of ``HTTPServerEngine`` (``http_server``).
"""

from __future__ import annotations

import asyncio
import contextlib
from typing import Literal

from rollfleet.schemas.errors import EngineFailure

GateVerdict = Literal["send", "wait", "refuse"]


def gate_decision(activating: bool, server_paused: bool) -> tuple[GateVerdict, str | None]:
    """What the request gate does with a new request, and what is wrong (for ``health``).

    ``activating``: between the adapter's ``pause`` and ``resume``: the request waits (an
    activation is bounded by its control calls, and ``resume`` always reopens the gate).
    ``server_paused``: a pause reached, or may have reached, the server and no resume has
    succeeded since. Outside an activation such a server would hold a request forever, so it is
    refused and the engine is not healthy until the server continues."""
    if activating:
        return "wait", None
    if server_paused:
        return "refuse", "server may still be paused: asking it to continue failed"
    return "send", None


class ActivationGate:
    """``pause``/``resume`` of the server, and the gate new requests wait at meanwhile."""

    def _init_gate(self) -> None:
        self._running = asyncio.Event()  # cleared from pause to resume: no new request is sent
        self._running.set()
        self._server_paused = False  # a pause may hold the server and no resume has succeeded since
        self._control_lock = asyncio.Lock()  # pause, resume and health's retry of resume, one at a time
        self._gate_waiters: dict[str, asyncio.Event] = {}  # request id -> set when aborted at the gate
        self._activation = asyncio.Lock()  # held from pause to resume: a reload after a restart waits

    async def pause(self) -> None:
        await self._activation.acquire()
        async with self._control_lock:
            self._running.clear()
            self._server_paused = True  # from the moment the call is sent it may land, answered or not
            try:
                await self._pause_server()
            except BaseException:
                # A refused pause is no activation: reopen the gate at once (version sync calls no
                # resume after a pause that raised), and ask the server to continue in case it paused.
                with contextlib.suppress(Exception):
                    await self._resume_server()
                    self._server_paused = False
                self._running.set()
                self._activation.release()
                raise

    async def resume(self) -> None:
        """Reopen the gate and ask the server to continue. A server that refuses to continue does
        not undo the activation (the new weights are live, and must be announced as such): the
        engine then refuses requests and is not healthy until a later ask succeeds (health and
        every request ask again: ``_unpause_server``)."""
        async with self._control_lock:
            try:
                with contextlib.suppress(EngineFailure):
                    await self._resume_server()
                    self._server_paused = False
            finally:
                self._running.set()
                if self._activation.locked():
                    self._activation.release()

    async def _pause_server(self) -> None:
        """Ask the server to stop advancing requests (in-flight ones stay); raise if it refused."""

    async def _resume_server(self) -> None:
        """Ask the server to continue generation; raise if it refused."""

    async def _unpause_server(self) -> str | None:
        """Outside an activation, ask a server that may still be paused to continue; what is still
        wrong with the gate (None when nothing)."""
        if gate_decision(not self._running.is_set(), self._server_paused)[0] != "refuse":
            return None  # (without waiting for a pause or resume under way)
        async with self._control_lock:
            verdict, problem = gate_decision(not self._running.is_set(), self._server_paused)
            if verdict != "refuse":
                return None
            with contextlib.suppress(EngineFailure):
                await self._resume_server()
                self._server_paused = False
                return None
            return problem

    async def _pass_gate(self, request_id: str) -> tuple[bool, GateVerdict]:
        """Wait out an activation at the gate: (whether ``request_id`` was aborted meanwhile, the
        gate's verdict on it then)."""
        while (decision := gate_decision(not self._running.is_set(), self._server_paused))[0] == "wait":
            aborted = self._gate_waiters[request_id] = asyncio.Event()
            opened, gave_up = asyncio.ensure_future(self._running.wait()), asyncio.ensure_future(aborted.wait())
            try:
                await asyncio.wait({opened, gave_up}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                opened.cancel()
                gave_up.cancel()
                self._gate_waiters.pop(request_id, None)
            if aborted.is_set():
                return True, decision[0]
        return False, decision[0]

    def _abort_at_gate(self, request_id: str) -> bool:
        """Abort ``request_id`` if it waits at the gate (it then returns aborted, never sent)."""
        waiting = self._gate_waiters.get(request_id)
        if waiting is None:
            return False
        waiting.set()
        return True
