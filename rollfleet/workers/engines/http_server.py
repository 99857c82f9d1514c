"""What the HTTP engines share: an inference server the worker launches or attaches to.

``HTTPServerEngine`` is the part of the ``sglang`` and ``vllm`` adapters that does not depend on
the server's API:

- the server process: launched in its own session (so closing stops its children too), its
  output appended to a log file, waited for until ``/health`` answers; or a URL to attach to;
- liveness: a launched server that exits is noticed at once (a task waits on the process); with
  ``health_interval_s`` the adapter also asks ``/health`` that often, and a server that does not
  answer within ``health_timeout_s`` counts as hung. Either way the engine is *down*: ``health()``
  says why in one line, requests in flight fail at once with ``EngineFailure`` (instead of
  waiting out ``request_timeout_s``) and new ones are refused until the server answers again;
- the request gate: during an activation (``pause`` .. ``resume``) no new request reaches the
  server, so every request starts on the weights the adapter last made live. A pause the server
  refused reopens the gate at once (and asks the server to continue); a server that may still be
  paused outside an activation (a failed ``resume``, which does not undo the activation) makes
  the engine not healthy and refuses requests until a later ask (each health look and each
  request asks) gets it to continue (``gate_decision``). A request waiting
  at the gate can be aborted there (an activation's drain gives up on it);
- in-flight bookkeeping for ``abort``, and a prefix-cache salt per weight version for sessions
  (a turn after an activation is prefilled anew and reported ``cache_rebuilt``);
- rollfleet versions as the integer strings the servers carry, and per-token version spans;
- a server that lost the weights made live here: once the adapter has set the server's version
  label, a server that reports another one (an attached server restarted on its launch
  checkpoint: vLLM's ``default``) is checked for at every health look, and tokens a server
  attributes to a label that is no rollfleet version are refused. The engine is then down (no
  request is sent) while the adapter reloads the live version from the directory it was loaded
  from, and serves again once that succeeded (``restart_suspected``). Only while that directory
  still holds it: a worker materializes the next version into the same directory while it serves,
  so after a failed activation (or during a prepare) it holds other bytes. Its version marker
  must be what it was at the load (``reload_refusal``), else the engine stays down until the
  version sync activates a version.

Each of these is a part of its own, mixed into ``HTTPServerEngine``: ``server_process``
(``ServerProcess``), ``server_liveness`` (``ServerLiveness``), ``server_gate``
(``ActivationGate``) and ``server_restart`` (``RestartRecovery``); the answers' versions and spans
are read by ``server_protocol``'s functions. This module keeps the request path (admission,
in-flight bookkeeping, aborts), the sessions' salts, ``health`` and ``close``.

Subclasses say how to start their server (``_launch_command``), how to abort (``_send_abort``)
and everything about generation and weights.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from rollfleet.schemas import Completion
from rollfleet.schemas.errors import EngineFailure, InvalidRequest
from rollfleet.workers.engines.base import Engine, EngineHealth, Generation
from rollfleet.workers.engines.server_gate import ActivationGate
from rollfleet.workers.engines.server_liveness import ServerLiveness
from rollfleet.workers.engines.server_process import POOL_LIMITS, ServerProcess
from rollfleet.workers.engines.server_protocol import error_message, response_json
from rollfleet.workers.engines.server_restart import RestartRecovery

SESSIONS_REMEMBERED = 65_536  # sessions whose last salt is remembered (oldest forgotten first)


class HTTPServerEngine(ServerProcess, ServerLiveness, ActivationGate, RestartRecovery, Engine, abc.ABC):
    """An engine behind an inference server's HTTP API, launched here or attached to by URL."""

    server_name = "server"  # in messages: "SGLang", "vLLM"

    def __init__(
        self,
        url: str | None = None,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        launch_args: Sequence[str] = (),
        log_file: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        startup_timeout_s: float = 900.0,
        request_timeout_s: float = 3600.0,
        control_timeout_s: float = 600.0,
        health_path: str = "/health",
        health_interval_s: float = 0.0,
        health_timeout_s: float = 10.0,
        version_cache_salt: bool = True,
    ) -> None:
        """``health_interval_s`` > 0: ask ``health_path`` that often and count a server that does
        not answer within ``health_timeout_s`` as hung (a launched server's exit is noticed at
        once either way). ``version_cache_salt``: namespace the server's prefix cache by weight
        version."""
        super().__init__()
        self.url = url.rstrip("/") if url else None
        self.host = host
        self.port = port
        self.launch_args = list(launch_args)
        self.log_file = Path(log_file) if log_file else None
        self.env = dict(env) if env else None
        self.startup_timeout_s = startup_timeout_s
        self.request_timeout_s = request_timeout_s
        self.control_timeout_s = control_timeout_s
        self.health_path = health_path
        self.health_interval_s = health_interval_s
        self.health_timeout_s = health_timeout_s
        self.version_cache_salt = version_cache_salt
        self.process: asyncio.subprocess.Process | None = None
        self._client: httpx.AsyncClient | None = None
        self._init_gate()
        self._init_liveness()
        self._init_restart_recovery()
        self._inflight: dict[str, list[str]] = {}  # request id -> the server's ids for it
        self._aborted: set[str] = set()
        self._closed = False
        # The version each recent session's last turn was salted with: a later version means the
        # server's cache for it is salted away, so the next turn is prefilled anew.
        self._session_versions: OrderedDict[str, int] = OrderedDict()

    # -- what a subclass says --------------------------------------------------------------------

    @abc.abstractmethod
    def _launch_command(self, model_path: str, version: int, port: int) -> list[str]:
        """The command line that starts a server for ``model_path`` on ``self.host:port``."""

    @abc.abstractmethod
    async def _read_label(self) -> object:
        """The server's weight-version label, as it reports it; raises when it cannot be read."""

    @abc.abstractmethod
    async def _send_abort(self, ids: list[str]) -> None:
        """Ask the server to stop these of its requests (best effort)."""

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._running.set()
        for task in [*self._watchers, *([self._recovering] if self._recovering is not None else [])]:
            task.cancel()
        if self._client is not None:
            for rid in list(self._inflight):
                with contextlib.suppress(Exception):
                    await self.abort(rid)
            await self._client.aclose()
        await self._stop_process()

    async def health(self) -> EngineHealth:
        if self._client is None or self._closed:
            return EngineHealth(ok=False, detail="closed" if self._closed else "not started")
        extra: dict[str, object] = {"version": self.version, "url": self.url, "paused": not self._running.is_set()}
        if self.process is not None:
            extra["pid"] = self.process.pid
        problem = await self._diagnose()
        if problem is not None:
            self._mark_down(problem)
            return EngineHealth(ok=False, detail=self._down or problem, extra=extra)
        if self._broken and self._down is not None:
            return EngineHealth(ok=False, detail=self._down, extra=extra)
        lost = await self._check_served()
        if lost is not None:
            return EngineHealth(ok=False, detail=lost, extra=extra)
        self._down = None
        gate_problem = await self._unpause_server()
        if gate_problem is not None:
            return EngineHealth(ok=False, detail=f"{self.server_name} {gate_problem}", extra=extra)
        return EngineHealth(ok=True, detail="serving", extra=extra)

    # -- requests --------------------------------------------------------------------------------

    async def _admit(self, request_id: str) -> bool:
        """Before a request: wait out an activation (no new work reaches the server during one);
        refuse while the engine is closed or down, or while the server may still be paused outside
        an activation. True: the request was aborted while it waited (it is not sent)."""
        aborted, verdict = await self._pass_gate(request_id)
        if aborted:
            return True
        if self._closed:
            raise EngineFailure(f"the {self.name} engine is closed")
        if self._down is not None:
            raise EngineFailure(f"{self.server_name} server is down: {self._down}")
        if verdict == "refuse" and (problem := await self._unpause_server()) is not None:
            raise EngineFailure(f"{self.server_name} {problem}")
        return False

    async def _post_request(
        self, request_id: str, ids: list[str], path: str, body: Any, headers: Mapping[str, str] | None = None
    ) -> httpx.Response | None:
        """POST one generation request, registered for ``abort``. None: it was aborted and the
        server gave no answer. A server that dies or hangs meanwhile fails it at once."""
        self._inflight[request_id] = ids
        down = asyncio.ensure_future(self._down_changed.wait())
        post = asyncio.ensure_future(self._http.post(path, json=body, headers=headers, timeout=self.request_timeout_s))
        try:
            await asyncio.wait({post, down}, return_when=asyncio.FIRST_COMPLETED)
            if not post.done():  # the server went down first: stop waiting for it
                post.cancel()
                with contextlib.suppress(asyncio.CancelledError, httpx.HTTPError):
                    await post
                raise EngineFailure(f"{self.server_name} server went down during the request: {self._down}")
            try:
                return post.result()
            except httpx.HTTPError as exc:
                if request_id in self._aborted:
                    return None
                exited = await self._exited(0.5)
                if exited is not None:
                    self._mark_down(exited)
                    raise EngineFailure(f"{exited} during the request") from exc
                raise EngineFailure(f"{self.server_name} {path} failed: {type(exc).__name__}: {exc}") from exc
        finally:
            down.cancel()
            if not post.done():
                post.cancel()
            self._inflight.pop(request_id, None)

    def _check_status(self, r: httpx.Response, path: str) -> None:
        """A refusal of the request (4xx) is the request's fault; anything else the server's."""
        if r.status_code < 400:
            return
        message = error_message(r)
        if 400 <= r.status_code < 500:
            raise InvalidRequest(f"{self.server_name} rejected the request: {message}")
        raise EngineFailure(f"{self.server_name} {path}: HTTP {r.status_code}: {message}")

    @staticmethod
    def _aborted_generation(n: int, version: int) -> Generation:
        outputs = [Completion(token_ids=[], finish_reason="abort", logprobs=[]) for _ in range(n)]
        return Generation(outputs, version, version)

    async def abort(self, request_id: str) -> None:
        if self._abort_at_gate(request_id):  # not sent yet: it returns aborted without reaching the server
            return
        ids = self._inflight.get(request_id)
        if not ids:
            return
        self._aborted.add(request_id)
        with contextlib.suppress(httpx.HTTPError):
            await self._send_abort(ids)
        # An abort that reaches the server before the request does is a no-op there: ask again
        # while the request is still out.
        task = asyncio.create_task(self._abort_again(request_id, ids))
        self._watchers.append(task)
        task.add_done_callback(self._watchers.remove)

    async def _abort_again(self, request_id: str, ids: list[str], every_s: float = 1.0, times: int = 10) -> None:
        for _ in range(times):
            await asyncio.sleep(every_s)
            if self._inflight.get(request_id) is not ids or self._closed:
                return
            with contextlib.suppress(httpx.HTTPError):
                await self._send_abort(ids)

    def _take_aborted(self, request_id: str) -> bool:
        aborted = request_id in self._aborted
        self._aborted.discard(request_id)
        return aborted

    # -- sessions ----------------------------------------------------------------------------------

    def _cache_salt(self) -> str | None:
        return f"rollfleet-v{self.version}" if self.version_cache_salt else None

    def _session_turn(self, session_id: str | None, salted: int) -> bool:
        """Remember the version the session's turn was salted with; True when its previous turn's
        was older (an activation in between), so the server prefilled this turn anew."""
        if session_id is None:
            return False
        before = self._session_versions.pop(session_id, None)
        self._session_versions[session_id] = salted
        while len(self._session_versions) > SESSIONS_REMEMBERED:
            self._session_versions.popitem(last=False)
        return self.version_cache_salt and before is not None and before < salted

    async def end_session(self, session_id: str) -> None:
        self._session_versions.pop(session_id, None)

    # -- plumbing ----------------------------------------------------------------------------------

    @property
    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                base_url=self.url or "", timeout=self.control_timeout_s, limits=POOL_LIMITS
            )
        return self._client

    async def _post_control(
        self, path: str, body: Any = None, *, params: Mapping[str, str] | None = None
    ) -> httpx.Response:
        try:
            return await self._http.post(path, json=body, params=params, timeout=self.control_timeout_s)
        except httpx.HTTPError as exc:
            raise EngineFailure(f"{self.server_name} {path} failed: {type(exc).__name__}: {exc}") from exc

    async def _control(self, path: str, body: Any = None, *, params: Mapping[str, str] | None = None) -> dict[str, Any]:
        """A control call that must succeed (HTTP 200); its JSON answer."""
        r = await self._post_control(path, body, params=params)
        if r.status_code != 200:
            raise EngineFailure(f"{self.server_name} {path}: HTTP {r.status_code}: {error_message(r)}")
        return response_json(r)
