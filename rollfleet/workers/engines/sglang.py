"""The sglang engine: an HTTP adapter for an SGLang server the worker launches or attaches to.

Routes used (SGLang's native HTTP API):

- ``POST /generate`` with ``input_ids`` (or ``text``), ``sampling_params``, ``return_logprob``
  and ``rid``; reads ``output_ids`` and ``meta_info`` (``finish_reason``,
  ``output_token_logprobs`` as ``[logprob, token_id, text]`` triples, ``weight_version`` and,
  from SGLang 0.5.23, ``weight_versions``: ``{version, start, end}`` spans of output tokens).
  ``n`` samples are sent as a batch of ``n`` copies of the prompt with one rid each.
- ``POST /pause_generation`` ``{"mode": "in_place"}``: requests stay in the running batch and
  continue on the new weights after ``POST /continue_generation``.
- ``POST /update_weights_from_disk`` ``{"model_path", "weight_version", "flush_cache": false}``:
  SGLang cannot flush its cache while an in-place pause holds running requests, so the
  adapter asks for no flush there and then calls ``/flush_cache`` itself, best effort (a
  refusal while requests run is expected and tolerated; the radix cache then still holds
  prefixes computed with the old weights until it can be flushed).
- ``POST /pull_weights`` ``{"local_checkpoint_dir", "source_dir", "target_version"}`` where the
  server has it (``pull_dir=``): SGLang then pulls the published version from the store itself
  (on every host it spans) while it serves, and the activation reloads ``pull_dir``. rollfleet
  still materializes and verifies the version first, so a bad one never reaches the server.
  SGLang's puller treats version 0 as the server's own ``--model-path``; a launched server is
  given the store's ``weight_v000000`` for that reason, an attached one must have been started
  on the same base checkpoint.
- ``POST /abort_request`` ``{"rid"}``, ``GET /health``, ``GET /model_info`` (``weight_version``;
  ``/get_model_info``, deprecated in 0.5.23, as a fallback).
- ``POST /close_session`` ``{"session_id"}`` when a session ends (best effort).

Sessions and the radix cache: a turn's prompt is the whole context so far, which SGLang's radix
cache already matches by content. A turn of a session also carries ``session_id`` (SGLang's
radix-native session: "unlike session_params, this does not alter or reconstruct the prompt";
with ``--enable-session-radix-cache`` the server tags the turn's KV with the session so eviction
takes unreferenced KV first, until ``/close_session`` releases it) and ``routing_key`` (the same
id: the ``routing-key`` schedule policy groups a session's requests). ``session_params`` is not
used: it rebuilds the prompt from the server's session history and needs ``/open_session``. Every
request also carries ``cache_salt`` naming the weight version it is sent on, so the radix cache
never matches a prefix computed with other weights (a flush refused under an in-place pause would
otherwise leave them reusable); the turn after an activation is prefilled on the new weights and
reported with ``cache_rebuilt``. ``cached_tokens`` is SGLang's ``meta_info.cached_tokens``.

Every body is checked in the contract tests against SGLang 0.5.23's own types
(``sglang/api/v1/api_types.py`` for ``/generate``, ``io_struct.py`` for the control routes).

Tolerances, because SGLang's shapes vary across releases: a ``/generate`` answer may be one
object or a list; token ids come from ``output_ids`` or, failing that, from the log-prob
triples; ``finish_reason`` may be an object with ``type`` or a bare string; a missing
``weight_version`` falls back to the adapter's own version. SGLang's log-probs are whatever
the server computes (see its ``SGLANG_RETURN_ORIGINAL_LOGPROB`` setting); the hf engine's
rule is temperature-scaled, untruncated.

Versions: rollfleet versions are integers; SGLang's ``weight_version`` is a string, so the
adapter sends ``str(version)`` and parses the served value back. With ``weight_versions`` spans
each completion says which tokens came from which version, and ``version_start``/``version_end``
are the first and last span's versions. Without spans (older servers), ``version_start`` is the
adapter's version when the request is sent (requests wait while paused, so it is exact unless an
activation lands before SGLang's first step, in which case it is conservatively older) and
``version_end`` is the ``weight_version`` SGLang reports. A version string that is not a
non-negative integer (SGLang's ``"default"``, or a label someone else set) is not a rollfleet
version: spans holding one are dropped (the completion's ``weight_versions`` is then empty,
meaning unknown) and the adapter's own version stands in for it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import socket
import sys
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from rollfleet.schemas import Completion, RolloutPayload, VersionSpan
from rollfleet.schemas.errors import EngineFailure, InvalidRequest
from rollfleet.schemas.limits import check_payload
from rollfleet.workers.engines.base import Engine, EngineHealth, Generation

_FINISH = {"stop": "stop", "length": "length", "abort": "abort"}
_SESSIONS_REMEMBERED = 65_536


def _free_port(host: str) -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return int(s.getsockname()[1])


def _parse_version(value: object) -> int | None:
    """A rollfleet version from SGLang's weight_version string; None for anything else."""
    if isinstance(value, int) and not isinstance(value, bool):
        return value if value >= 0 else None
    if isinstance(value, str) and value.isascii() and value.isdigit():
        return int(value)
    return None


def _parse_spans(raw: object, n_tokens: int) -> list[VersionSpan]:
    """SGLang's ``weight_versions`` as rollfleet spans; [] when absent, non-integer or inconsistent
    with the tokens (they must tile ``[0, n_tokens)`` in order)."""
    if not isinstance(raw, list) or not raw:
        return []
    spans: list[VersionSpan] = []
    for item in raw:
        if not isinstance(item, Mapping):
            return []
        version = _parse_version(item.get("version"))
        start, end = item.get("start"), item.get("end")
        if version is None or not isinstance(start, int) or not isinstance(end, int):
            return []
        if start != (spans[-1].end if spans else 0) or end < start:
            return []
        if end > start or n_tokens == 0:
            spans.append(VersionSpan(version=version, start=start, end=end))
    if (spans[-1].end if spans else 0) != n_tokens:
        return []
    return spans


class SGLangEngine(Engine):
    name = "sglang"

    def __init__(
        self,
        url: str | None = None,
        launch_args: Sequence[str] = (),
        model_path: str | None = None,
        *,
        host: str = "127.0.0.1",
        port: int | None = None,
        launch_cmd: Sequence[str] | None = None,
        pass_weight_version: bool = True,
        log_file: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        startup_timeout_s: float = 900.0,
        request_timeout_s: float = 3600.0,
        control_timeout_s: float = 600.0,
        pause_mode: str = "in_place",
        flush_cache: bool = True,
        load_format: str | None = None,
        health_path: str = "/health",
        pull_dir: str | Path | None = None,
        store_dir: str | Path | None = None,
        version_cache_salt: bool = True,
    ) -> None:
        """``pull_dir`` (with ``store_dir``, the policy store): activate through SGLang's own
        ``/pull_weights`` into this host-local directory instead of reloading the worker's.
        ``version_cache_salt``: namespace the server's prefix cache by weight version."""
        super().__init__()
        if pull_dir is not None and store_dir is None:
            raise InvalidRequest("pulling weights (pull_dir) needs the store to pull from (store_dir)")
        self.pull_dir = Path(pull_dir) if pull_dir is not None else None
        self.store_dir = Path(store_dir) if store_dir is not None else None
        self._pulled: int | None = None  # the version /pull_weights last brought pull_dir to
        self.url = url.rstrip("/") if url else None
        self.launch_args = list(launch_args)
        self.model_path = model_path
        self.host = host
        self.port = port
        # The command that starts a server; the flags --model-path/--host/--port follow it.
        self.launch_cmd = list(launch_cmd) if launch_cmd else [sys.executable, "-m", "sglang.launch_server"]
        self.pass_weight_version = pass_weight_version
        self.log_file = Path(log_file) if log_file else None
        self.env = dict(env) if env else None
        self.startup_timeout_s = startup_timeout_s
        self.request_timeout_s = request_timeout_s
        self.control_timeout_s = control_timeout_s
        self.pause_mode = pause_mode
        self.flush_cache = flush_cache
        self.load_format = load_format
        self.health_path = health_path
        self.process: asyncio.subprocess.Process | None = None
        self._client: httpx.AsyncClient | None = None
        self._running = asyncio.Event()
        self._running.set()
        self._inflight: dict[str, list[str]] = {}  # request id -> SGLang rids
        self._aborted: set[str] = set()
        self._closed = False
        self.last_flush_ok: bool | None = None
        self.version_cache_salt = version_cache_salt
        # The version each recent session's last turn ended on: a later version means the
        # server's cache for it is salted away, so the next turn rebuilds it.
        self._session_versions: OrderedDict[str, int] = OrderedDict()

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self, checkpoint_dir: Path | None, version: int) -> None:
        if self.pull_dir is not None and self.store_dir is not None:
            # SGLang's puller seeds version 0 from the server's own model path: the store's version 0.
            model_path = self.model_path or str(self.store_dir / "weight_v000000")
            launch_version = 0
        else:
            model_path = self.model_path or (str(checkpoint_dir) if checkpoint_dir is not None else None)
            launch_version = version
        if self.url is None:
            if model_path is None:
                raise InvalidRequest("launching SGLang needs a model path or a checkpoint dir")
            await self._launch(model_path, launch_version)
        self._client = httpx.AsyncClient(base_url=self.url or "", timeout=self.control_timeout_s)
        await self._wait_healthy()
        served = await self.served_version()
        attached = self.process is None
        if served != version and ((attached and checkpoint_dir is not None) or self.pull_dir is not None):
            # A server holding other weights (attached, or launched on version 0 to pull from).
            await self.prepare_weights(checkpoint_dir, (), version)
            await self.pause()
            try:
                await self.load_weights(checkpoint_dir, (), version)
            finally:
                await self.resume()
        self.version = version

    async def _launch(self, model_path: str, version: int) -> None:
        port = self.port or _free_port(self.host)
        cmd = [*self.launch_cmd, "--model-path", model_path, "--host", self.host, "--port", str(port)]
        if self.pass_weight_version:
            cmd += ["--weight-version", str(version)]
        cmd += self.launch_args
        out: Any = asyncio.subprocess.DEVNULL
        if self.log_file is not None:
            self.log_file.parent.mkdir(parents=True, exist_ok=True)
            out = self.log_file.open("ab")
        env = {**os.environ, **self.env} if self.env else None
        # Own session, so close() can stop the server's scheduler/detokenizer children too.
        self.process = await asyncio.create_subprocess_exec(
            *cmd, stdout=out, stderr=asyncio.subprocess.STDOUT, env=env, start_new_session=True
        )
        if out is not asyncio.subprocess.DEVNULL:
            out.close()
        self.url = f"http://{self.host}:{port}"

    async def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            if self.process is not None and self.process.returncode is not None:
                raise EngineFailure(f"SGLang server exited with code {self.process.returncode} while starting")
            try:
                r = await self._http.get(self.health_path, timeout=5.0)
                if r.status_code == 200:
                    return
                last = f"HTTP {r.status_code}"
            except httpx.HTTPError as exc:
                last = type(exc).__name__
            await asyncio.sleep(0.5)
        raise EngineFailure(f"SGLang server at {self.url} not healthy after {self.startup_timeout_s:.0f}s ({last})")

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._running.set()
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

    async def health(self) -> EngineHealth:
        if self._client is None or self._closed:
            return EngineHealth(ok=False, detail="closed" if self._closed else "not started")
        try:
            r = await self._http.get(self.health_path, timeout=10.0)
        except httpx.HTTPError as exc:
            return EngineHealth(ok=False, detail=f"{self.health_path}: {type(exc).__name__}")
        extra: dict[str, object] = {"version": self.version, "url": self.url, "paused": not self._running.is_set()}
        if self.process is not None:
            extra["pid"] = self.process.pid
        ok = r.status_code == 200
        return EngineHealth(ok=ok, detail="serving" if ok else f"{self.health_path}: HTTP {r.status_code}", extra=extra)

    # -- requests ----------------------------------------------------------------------------

    async def generate(self, request_id: str, payload: RolloutPayload, session_id: str | None = None) -> Generation:
        check_payload(payload)
        await self._running.wait()  # no new work reaches the server during an activation
        if self._closed:
            raise EngineFailure("the sglang engine is closed")
        rids = [request_id] if payload.n == 1 else [f"{request_id}-{i}" for i in range(payload.n)]
        body = self._generate_body(rids, payload, session_id)
        version_start = salted = self.version
        self._inflight[request_id] = rids
        try:
            r = await self._http.post("/generate", json=body, timeout=self.request_timeout_s)
        except httpx.HTTPError as exc:
            if request_id in self._aborted:
                return self._aborted_generation(payload.n, version_start)
            raise EngineFailure(f"SGLang /generate failed: {type(exc).__name__}: {exc}") from exc
        finally:
            self._inflight.pop(request_id, None)
        aborted = request_id in self._aborted
        self._aborted.discard(request_id)
        if r.status_code >= 400:
            if aborted:
                return self._aborted_generation(payload.n, version_start)
            message = _error_message(r)
            if 400 <= r.status_code < 500:
                raise InvalidRequest(f"SGLang rejected the request: {message}")
            raise EngineFailure(f"SGLang /generate: HTTP {r.status_code}: {message}")
        items = r.json()
        items = items if isinstance(items, list) else [items]
        if len(items) != payload.n:
            raise EngineFailure(f"SGLang answered {len(items)} outputs for n={payload.n}")
        outputs, firsts, lasts, prompt_tokens = [], [], [], len(payload.prompt_token_ids or [])
        cached: list[int] = []
        for item in items:
            completion, served, prompt_len = self._parse_item(item, payload.sampling.logprobs, aborted)
            outputs.append(completion)
            cached.append(_cached_tokens(item))
            if completion.weight_versions:
                firsts.append(completion.weight_versions[0].version)
                lasts.append(completion.weight_versions[-1].version)
            elif served is not None:
                lasts.append(served)
            prompt_tokens = prompt_len or prompt_tokens
        version_end = max(lasts) if lasts else self.version
        if len(firsts) == len(outputs):  # every completion says where its tokens came from
            version_start = min(firsts)
        else:
            version_start = min([version_start, version_end, *firsts])
        return Generation(
            outputs,
            version_start,
            version_end,
            prompt_tokens=prompt_tokens,
            cached_tokens=min(cached, default=0),
            cache_rebuilt=self._session_turn(session_id, salted),
        )

    def _session_turn(self, session_id: str | None, salted: int) -> bool:
        """Remember the version the session's turn was salted with; True when its previous turn's
        was older (an activation in between), so the server prefilled this turn anew."""
        if session_id is None:
            return False
        before = self._session_versions.pop(session_id, None)
        self._session_versions[session_id] = salted
        while len(self._session_versions) > _SESSIONS_REMEMBERED:
            self._session_versions.popitem(last=False)
        return self.version_cache_salt and before is not None and before < salted

    async def end_session(self, session_id: str) -> None:
        """Forget the session; the server releases the KV it tagged with it (``/close_session``,
        best effort: older servers and servers without session radix caching may refuse)."""
        self._session_versions.pop(session_id, None)
        if self._client is None or self._closed:
            return
        with contextlib.suppress(httpx.HTTPError):
            await self._http.post("/close_session", json={"session_id": session_id})

    def _generate_body(self, rids: list[str], payload: RolloutPayload, session_id: str | None = None) -> dict[str, Any]:
        s = payload.sampling
        base: dict[str, Any] = {
            "max_new_tokens": s.max_tokens,
            "temperature": s.temperature,
            "top_p": s.top_p,
            "top_k": s.top_k if s.top_k > 0 else -1,  # SGLang: -1 means no top-k cut
        }
        if s.stop_token_ids:
            base["stop_token_ids"] = list(s.stop_token_ids)
        if payload.extra.get("ignore_eos"):
            base["ignore_eos"] = True
        base.update(payload.extra.get("sampling_params", {}))  # SGLang-specific pass-through
        per_sample = []
        for i in range(len(rids)):
            params = dict(base)
            if s.seed is not None:
                params["sampling_seed"] = s.seed + i
            per_sample.append(params)
        single = len(rids) == 1
        body: dict[str, Any] = {
            "rid": rids[0] if single else rids,
            "sampling_params": per_sample[0] if single else per_sample,
            "return_logprob": s.logprobs,
            "stream": False,
        }
        if payload.prompt_token_ids is not None:
            ids = list(payload.prompt_token_ids)
            body["input_ids"] = ids if single else [ids] * len(rids)
        else:
            body["text"] = payload.prompt_text if single else [payload.prompt_text] * len(rids)
        if self.version_cache_salt:
            body["cache_salt"] = f"rollfleet-v{self.version}"
        if session_id is not None:
            body["session_id"] = body["routing_key"] = session_id
        return body

    @staticmethod
    def _parse_item(item: Mapping[str, Any], want_logprobs: bool, aborted: bool) -> tuple[Completion, int | None, int]:
        meta = item.get("meta_info") or {}
        triples = meta.get("output_token_logprobs") or []
        tokens = item.get("output_ids")
        if tokens is None:
            tokens = [int(t[1]) for t in triples]
        logprobs = None
        if want_logprobs:
            logprobs = [float(t[0]) if t[0] is not None else float("nan") for t in triples]
            if len(logprobs) != len(tokens):
                raise EngineFailure(f"SGLang returned {len(logprobs)} log-probs for {len(tokens)} tokens")
        finish = meta.get("finish_reason")
        kind = finish.get("type") if isinstance(finish, Mapping) else finish
        reason = _FINISH.get(str(kind), "abort") if kind is not None else "abort"
        if aborted:
            reason = "abort"
        completion = Completion(
            token_ids=[int(t) for t in tokens],
            finish_reason=reason,  # type: ignore[arg-type]
            logprobs=logprobs,
            text=item.get("text") if isinstance(item.get("text"), str) else None,
            weight_versions=_parse_spans(meta.get("weight_versions"), len(tokens)),
        )
        return completion, _parse_version(meta.get("weight_version")), int(meta.get("prompt_tokens") or 0)

    def _aborted_generation(self, n: int, version: int) -> Generation:
        outputs = [Completion(token_ids=[], finish_reason="abort", logprobs=[]) for _ in range(n)]
        return Generation(outputs, version, version)

    async def abort(self, request_id: str) -> None:
        rids = self._inflight.get(request_id)
        if not rids:
            return
        self._aborted.add(request_id)
        for rid in rids:
            with contextlib.suppress(httpx.HTTPError):
                await self._http.post("/abort_request", json={"rid": rid})

    # -- activation ----------------------------------------------------------------------------

    async def pause(self) -> None:
        self._running.clear()
        await self._control("/pause_generation", {"mode": self.pause_mode})

    async def prepare_weights(self, checkpoint_dir: Path | None, changed: Sequence[str], version: int) -> None:
        """With ``pull_dir``: SGLang pulls ``version`` from the store into it, while it serves."""
        if self.pull_dir is None:
            return
        body: dict[str, Any] = {"local_checkpoint_dir": str(self.pull_dir), "source_dir": str(self.store_dir)}
        body["target_version"] = version
        try:
            r = await self._http.post("/pull_weights", json=body, timeout=self.control_timeout_s)
        except httpx.HTTPError as exc:
            raise EngineFailure(f"SGLang /pull_weights failed: {type(exc).__name__}: {exc}") from exc
        result = _json(r)
        if r.status_code == 404:
            raise EngineFailure("this SGLang server has no /pull_weights; run without pull_dir")
        if r.status_code != 200 or not result.get("success", False):
            reason = result.get("message") or _error_message(r)
            raise EngineFailure(f"SGLang refused to pull version {version}: {reason}")
        self._pulled = version

    async def load_weights(self, checkpoint_dir: Path | None, changed: Sequence[str], version: int) -> None:
        """Paused: SGLang reloads the (already materialized or pulled) checkpoint dir and serves ``version``.

        SGLang reads the whole directory; ``changed`` is not needed by this route.
        """
        if self.pull_dir is not None:
            if self._pulled != version:
                raise EngineFailure(f"version {version} was not pulled (pull_dir holds {self._pulled})")
            checkpoint_dir = self.pull_dir
        if checkpoint_dir is None:
            raise InvalidRequest("the sglang engine loads weights from a checkpoint dir")
        body: dict[str, Any] = {
            "model_path": str(checkpoint_dir),
            "weight_version": str(version),
            "flush_cache": False,  # refused under an in-place pause with running requests
        }
        if self.load_format:
            body["load_format"] = self.load_format
        r = await self._http.post("/update_weights_from_disk", json=body, timeout=self.control_timeout_s)
        result = _json(r)
        if r.status_code != 200 or not result.get("success", False):
            raise EngineFailure(f"SGLang refused the weight update: {result.get('message') or _error_message(r)}")
        if self.flush_cache:
            flushed = await self._http.post("/flush_cache", timeout=self.control_timeout_s)
            self.last_flush_ok = flushed.status_code == 200
        served = await self.served_version()
        if served is not None and served != version:
            raise EngineFailure(f"SGLang serves weight_version {served} after loading {version}")
        self.version = version

    async def resume(self) -> None:
        try:
            await self._control("/continue_generation", {})
        finally:
            self._running.set()

    async def served_version(self) -> int | None:
        """The weight version the server reports (None when it reports none or a non-integer)."""
        for path in ("/model_info", "/get_model_info"):
            try:
                r = await self._http.get(path)
            except httpx.HTTPError:
                continue
            if r.status_code == 200:
                return _parse_version(_json(r).get("weight_version"))
        return None

    # -- plumbing ------------------------------------------------------------------------------

    @property
    def _http(self) -> httpx.AsyncClient:
        if self._client is None:
            self._client = httpx.AsyncClient(base_url=self.url or "", timeout=self.control_timeout_s)
        return self._client

    async def _control(self, path: str, body: dict[str, Any]) -> None:
        try:
            r = await self._http.post(path, json=body)
        except httpx.HTTPError as exc:
            raise EngineFailure(f"SGLang {path} failed: {type(exc).__name__}: {exc}") from exc
        if r.status_code != 200:
            raise EngineFailure(f"SGLang {path}: HTTP {r.status_code}: {_error_message(r)}")


def _cached_tokens(item: Mapping[str, Any]) -> int:
    value = (item.get("meta_info") or {}).get("cached_tokens")
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _json(r: httpx.Response) -> dict[str, Any]:
    try:
        value = r.json()
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _error_message(r: httpx.Response) -> str:
    body = _json(r)
    err = body.get("error")
    if isinstance(err, Mapping):
        return str(err.get("message", err))
    return str(body.get("message") or r.text[:500])
