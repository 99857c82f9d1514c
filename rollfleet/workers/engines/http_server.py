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

Subclasses say how to start their server (``_launch_command``), how to abort (``_send_abort``)
and everything about generation and weights.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import os
import signal
import socket
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import httpx

from rollfleet.policy_store import read_marker
from rollfleet.schemas import Completion, VersionSpan
from rollfleet.schemas.errors import EngineFailure, InvalidRequest
from rollfleet.workers.engines.base import Engine, EngineHealth, Generation

# Every request goes on a fresh connection. A kept-alive one can be closed by the server just as a
# request goes out on it (uvicorn's keep-alive timer, 5 s for vLLM and SGLang alike, fires when
# the server's event loop comes back from a long reload, ahead of the bytes already waiting), and
# the request then fails with ReadError, which reads as the engine failing it: no expiry on the
# client's side closes that race, whose clock is the server's. On loopback a connection costs
# about a tenth of a millisecond; a generation costs far more.
_POOL_LIMITS = httpx.Limits(max_keepalive_connections=0)
SESSIONS_REMEMBERED = 65_536  # sessions whose last salt is remembered (oldest forgotten first)


def free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def parse_version(value: object) -> int | None:
    """A rollfleet version from a server's weight-version label; None for anything else."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value if value >= 0 else None
    if isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)
    return None


def parse_spans(raw: object, n_tokens: int) -> list[VersionSpan]:
    """A server's ``weight_versions`` (``{version, start, end}`` over output tokens) as rollfleet
    spans; [] when absent, not rollfleet versions, or inconsistent with the tokens (they must tile
    ``[0, n_tokens)`` in order)."""
    if not isinstance(raw, list) or not raw:
        return []
    spans: list[VersionSpan] = []
    for item in raw:
        if not isinstance(item, Mapping):
            return []
        version = parse_version(item.get("version"))
        start, end = item.get("start"), item.get("end")
        if version is None or not isinstance(start, int) or not isinstance(end, int):
            return []
        if start != (spans[-1].end if spans else 0) or end < start:
            return []
        if spans and spans[-1].version == version:  # one version's tokens split in two: one span
            spans[-1] = VersionSpan(version=version, start=spans[-1].start, end=end)
        elif end > start or n_tokens == 0:
            spans.append(VersionSpan(version=version, start=start, end=end))
    if (spans[-1].end if spans else 0) != n_tokens:
        return []
    return spans


def span_labels(raw: object) -> list[object]:
    """The version labels a server's ``weight_versions`` spans name, as it sent them."""
    return [item.get("version") for item in raw if isinstance(item, Mapping)] if isinstance(raw, list) else []


def response_json(r: httpx.Response) -> dict[str, Any]:
    try:
        value = r.json()
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def error_message(r: httpx.Response) -> str:
    body = response_json(r)
    err = body.get("error") or body.get("detail")
    if isinstance(err, Mapping):
        return str(err.get("message", err))
    if isinstance(err, list | str):
        return str(err)[:500]
    return str(body.get("message") or r.text[:500])


def generation_versions(
    outputs: Sequence[Completion], sent_on: int, served: Sequence[int], fallback: int
) -> tuple[int, int]:
    """(version_start, version_end) of a request: from the completions' spans where every one has
    them; otherwise the version the request was sent on (requests wait during activations, so it is
    exact or conservatively older) and the newest version the server reported (``served``)."""
    firsts = [o.weight_versions[0].version for o in outputs if o.weight_versions]
    lasts = [o.weight_versions[-1].version for o in outputs if o.weight_versions] + list(served)
    version_end = max(lasts) if lasts else fallback
    if outputs and len(firsts) == len(outputs):
        return min(firsts), version_end
    return min([sent_on, version_end, *firsts]), version_end


def restart_suspected(believed: int, reported: object) -> bool:
    """Whether a server whose version label the adapter set to ``believed`` no longer holds those
    weights: it reports another label (a restarted server reports its launch label)."""
    return parse_version(reported) != believed


def reload_refusal(loaded: int | None, now: int | None) -> str | None:
    """Why a directory must not be reloaded as the live version after a server restart (None: it
    may be): its version marker (``policy_store.read_marker``: the version materialized in it) is
    ``now``, no longer ``loaded``, what it was when the live version was loaded from it. A plain
    checkpoint directory, which has no marker, may be."""
    if now == loaded:
        return None
    if now is None:
        return "is being rewritten (its version marker is gone)"
    return f"now holds version {now}"


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


class HTTPServerEngine(Engine, abc.ABC):
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
        self._running = asyncio.Event()  # cleared from pause to resume: no new request is sent
        self._running.set()
        self._server_paused = False  # a pause may hold the server and no resume has succeeded since
        self._control_lock = asyncio.Lock()  # pause, resume and health's retry of resume, one at a time
        self._gate_waiters: dict[str, asyncio.Event] = {}  # request id -> set when aborted at the gate
        self._activation = asyncio.Lock()  # held from pause to resume: a reload after a restart waits
        # Whether the server's version label is this adapter's ``version`` (set by start and every
        # load): a server reporting another one lost the weights made live here.
        self._labelled = False
        self._loaded_from: Path | None = None  # where the live version was loaded from (``_loaded_dir``)
        self._loaded_marker: int | None = None  # that directory's version marker when it was loaded
        self._stale = False  # a reload read a directory that moved on meanwhile: down until a new load
        self._recovering: asyncio.Task[None] | None = None
        self._inflight: dict[str, list[str]] = {}  # request id -> the server's ids for it
        self._aborted: set[str] = set()
        self._closed = False
        self._down: str | None = None  # why the server counts as dead or hung; None while it serves
        self._broken = False  # down for good: its answering /health again does not clear it
        self._down_changed = asyncio.Event()  # set whenever _down becomes set
        self._watchers: list[asyncio.Task[None]] = []
        # The version each recent session's last turn was salted with: a later version means the
        # server's cache for it is salted away, so the next turn is prefilled anew.
        self._session_versions: OrderedDict[str, int] = OrderedDict()

    # -- the server process ----------------------------------------------------------------------

    @abc.abstractmethod
    def _launch_command(self, model_path: str, version: int, port: int) -> list[str]:
        """The command line that starts a server for ``model_path`` on ``self.host:port``."""

    def _launch_env(self) -> dict[str, str] | None:
        """The environment of a launched server (None: this process's)."""
        return {**os.environ, **self.env} if self.env else None

    async def _launch(self, model_path: str, version: int) -> None:
        port = self.port or free_port(self.host)
        cmd = self._launch_command(model_path, version, port)
        out: Any = asyncio.subprocess.DEVNULL
        if self.log_file is not None:
            self.log_file.parent.mkdir(parents=True, exist_ok=True)
            out = self.log_file.open("ab")
        # Own session, so close() stops the server's engine and worker children too.
        self.process = await asyncio.create_subprocess_exec(
            *cmd, stdout=out, stderr=asyncio.subprocess.STDOUT, env=self._launch_env(), start_new_session=True
        )
        if out is not asyncio.subprocess.DEVNULL:
            out.close()
        self.url = f"http://{self.host}:{port}"

    async def _connect(self, checkpoint_dir: Path | None, version: int, model_path: str | None) -> None:
        """Launch (without a URL) or attach, then wait until the server answers ``/health``."""
        if self.url is None:
            if model_path is None:
                raise InvalidRequest(f"launching {self.server_name} needs a model path or a checkpoint dir")
            await self._launch(model_path, version)
        self._client = httpx.AsyncClient(base_url=self.url or "", timeout=self.control_timeout_s, limits=_POOL_LIMITS)
        await self._wait_healthy()

    async def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            if self.process is not None and self.process.returncode is not None:
                raise EngineFailure(
                    f"{self.server_name} server exited with code {self.process.returncode} while starting"
                    + (f" (log: {self.log_file})" if self.log_file else "")
                )
            try:
                r = await self._http.get(self.health_path, timeout=5.0)
                if r.status_code == 200:
                    return
                last = f"HTTP {r.status_code}"
            except httpx.HTTPError as exc:
                last = type(exc).__name__
            await asyncio.sleep(0.5)
        raise EngineFailure(
            f"{self.server_name} server at {self.url} not healthy after {self.startup_timeout_s:.0f}s ({last})"
        )

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
        if self.process is not None and self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(self.process.wait(), 30)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self.process.pid, signal.SIGKILL)
                await self.process.wait()
        if self.process is not None:
            with contextlib.suppress(ProcessLookupError):  # children that outlived their parent
                os.killpg(self.process.pid, signal.SIGKILL)

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

    @property
    def _loaded_dir(self) -> Path | None:
        return self._loaded_from

    @_loaded_dir.setter
    def _loaded_dir(self, directory: Path | None) -> None:
        """Every load records where from and that directory's version marker then: a worker
        materializes the next version into the same directory while it serves, so the directory
        may later hold other bytes than the live version's (``reload_refusal``)."""
        self._loaded_from = Path(directory) if directory is not None else None
        self._loaded_marker = read_marker(self._loaded_from) if self._loaded_from is not None else None
        self._stale = False

    async def _check_served(self) -> str | None:
        """None when the server holds the version made live here, as far as its label says (or
        the adapter set no label to compare); else why not, with a reload of the live version
        started where the adapter knows its directory (the engine stays down until it succeeded)."""
        if self._recovering is not None and not self._recovering.done():
            return self._down or f"reloading version {self.version}"
        if self._stale and not self._activation.locked():
            self._lost(f"was reloaded from {self._loaded_dir} while it changed")  # (its label says nothing)
            return self._down
        if not self._labelled or self._activation.locked():
            return None  # (during an activation the label is moving)
        believed = self.version
        try:
            reported = await asyncio.wait_for(self._read_label(), self.health_timeout_s)
        except (httpx.HTTPError, EngineFailure, TimeoutError):
            return self._down  # unconfirmed: one serving keeps serving, one that was down stays so
        if self._activation.locked() or self.version != believed or not restart_suspected(believed, reported):
            return None  # (an activation began meanwhile: the label read may be from either side of it)
        self._lost(f"reports weight version {reported!r}, not {self.version}")
        return self._down

    def _lost(self, what: str) -> None:
        """The server does not hold the version made live here (``what`` says how that showed):
        down at once (requests in flight fail, none is sent), and the live version reloaded."""
        if self._recovering is not None and not self._recovering.done():
            return
        detail = f"{self.server_name} server {what} (restarted on its launch checkpoint?)"
        if self._loaded_dir is None:
            detail += f"; nothing to reload version {self.version} from: not serving until it reports it"
        else:
            detail += f"; reloading version {self.version} from {self._loaded_dir}"
        self._down = None  # (this account replaces any earlier one)
        self._mark_down(detail)
        if self._loaded_dir is not None:
            self._recovering = asyncio.create_task(self._reload_live(self._loaded_dir), name="server-reload")

    async def _reload_live(self, directory: Path) -> None:
        """Make the live version the server's again (an activation to the same version); the
        engine serves again only once that succeeded. Only from a directory that still holds what
        the live version was loaded from (its marker unchanged, before and after the load): one a
        newer version was materialized into since holds that version's bytes, which labelled with
        the live version would be served as it; the engine then stays down until an activation
        loads a version (the version sync's next one, or its retry of one that failed)."""
        expected = self._loaded_marker
        refused = reload_refusal(expected, await asyncio.to_thread(read_marker, directory))
        if refused is not None:
            if not self._broken:
                self._down = (
                    f"{self.server_name} server lost version {self.version}, and {directory} {refused}: "
                    "not reloaded; not serving until a version is activated"
                )
            return
        try:
            await self.pause()
            try:
                await self.load_weights(directory, (), self.version)
                self._loaded_marker = expected  # (what the live version is, whatever the load read)
            finally:
                await self.resume()
        except Exception as exc:  # stays down; the next health look tries again
            if not self._broken:
                self._down = f"{self.server_name} server lost version {self.version} and reloading it failed: {exc}"
            return
        moved = reload_refusal(expected, await asyncio.to_thread(read_marker, directory))
        if moved is not None:  # (a version materialized into it during the load: mixed bytes, maybe)
            self._stale = True
            if not self._broken:
                self._down = (
                    f"{self.server_name} server reloaded version {self.version} from {directory}, which {moved}"
                )
            return
        if not self._broken:
            self._down = None

    @abc.abstractmethod
    async def _read_label(self) -> object:
        """The server's weight-version label, as it reports it; raises when it cannot be read."""

    def _refuse_foreign(self, labels: Sequence[object]) -> None:
        """Tokens a labelled server attributes to a label that is no rollfleet version (vLLM's
        ``default`` after a restart) did not come from the weights made live here: refused, never
        relabelled with the adapter's own version."""
        foreign = [label for label in labels if parse_version(label) is None]
        if self._labelled and foreign:
            self._lost(f"attributes tokens to weight version {foreign[0]!r}")
            raise EngineFailure(f"{self.server_name} attributes tokens to weight version {foreign[0]!r}: {self._down}")

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

    async def _exited(self, wait_s: float = 0.0) -> str | None:
        """A launched server's exit, as one line (None while it runs or for an attached server);
        ``wait_s``: give a process that is dying that long to be reaped."""
        if self.process is None:
            return None
        if self.process.returncode is None and wait_s > 0:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self.process.wait()), wait_s)
        if self.process.returncode is None:
            return None
        return f"{self.server_name} server exited with code {self.process.returncode}"

    # -- requests --------------------------------------------------------------------------------

    async def _admit(self, request_id: str) -> bool:
        """Before a request: wait out an activation (no new work reaches the server during one);
        refuse while the engine is closed or down, or while the server may still be paused outside
        an activation. True: the request was aborted while it waited (it is not sent)."""
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
                return True
        if self._closed:
            raise EngineFailure(f"the {self.name} engine is closed")
        if self._down is not None:
            raise EngineFailure(f"{self.server_name} server is down: {self._down}")
        if decision[0] == "refuse" and (problem := await self._unpause_server()) is not None:
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

    @abc.abstractmethod
    async def _send_abort(self, ids: list[str]) -> None:
        """Ask the server to stop these of its requests (best effort)."""

    async def abort(self, request_id: str) -> None:
        waiting = self._gate_waiters.get(request_id)
        if waiting is not None:  # not sent yet: it returns aborted without reaching the server
            waiting.set()
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

    # -- activation gate ---------------------------------------------------------------------------

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

    # -- plumbing ----------------------------------------------------------------------------------

    @property
    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(
                base_url=self.url or "", timeout=self.control_timeout_s, limits=_POOL_LIMITS
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
