"""The sglang engine: an HTTP adapter for an SGLang server the worker launches or attaches to.

The server process, its liveness, the request gate during activations, abort bookkeeping and the
per-version prefix-cache salt are ``http_server.HTTPServerEngine``'s, shared with the vllm adapter;
this module is SGLang's API. (``health_interval_s`` polls ``/health``; off by default here.)

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
version. Once the adapter has set the server's label (it loaded a version, or the server reported
the adapter's version at start), such tokens are refused, never relabelled: the server lost the
weights made live here (restarted on its launch checkpoint) and the engine is down while it
reloads them (``http_server``). A server whose label the adapter never set (attached without a
checkpoint) keeps the old reading: its spans are dropped (``weight_versions`` empty, meaning
unknown) and the adapter's own version stands in.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import httpx

from rollfleet.schemas import EngineBuild, RolloutPayload
from rollfleet.schemas.errors import EngineFailure, InvalidRequest, RollfleetError
from rollfleet.schemas.limits import check_payload
from rollfleet.workers.engines.base import Generation, TokenSink, with_drawn_seed
from rollfleet.workers.engines.http_server import HTTPServerEngine
from rollfleet.workers.engines.server_protocol import (
    error_message,
    generation_versions,
    parse_version,
    response_json,
)
from rollfleet.workers.engines.sglang_protocol import (
    cached_tokens,
    generate_body,
    labels,
    parse_item,
    runs_deterministic,
    server_build,
)

DETERMINISTIC_FLAG = "--enable-deterministic-inference"


def _pulling_dirs(pull_dir: str | Path | None, store_dir: str | Path | None) -> tuple[Path | None, Path | None]:
    """Where ``/pull_weights`` brings versions (``pull_dir``) and the store it pulls them from."""
    if pull_dir is not None and store_dir is None:
        raise InvalidRequest("pulling weights (pull_dir) needs the store to pull from (store_dir)")
    return (Path(pull_dir) if pull_dir is not None else None, Path(store_dir) if store_dir is not None else None)


class SGLangEngine(HTTPServerEngine):
    name = "sglang"
    server_name = "SGLang"

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
        health_interval_s: float = 0.0,
        pull_dir: str | Path | None = None,
        store_dir: str | Path | None = None,
        version_cache_salt: bool = True,
        deterministic: bool = False,
    ) -> None:
        """``pull_dir`` (with ``store_dir``, the policy store): activate through SGLang's own
        ``/pull_weights`` into this host-local directory instead of reloading the worker's.
        ``version_cache_salt``: namespace the server's prefix cache by weight version.
        ``deterministic``: launch the server with ``--enable-deterministic-inference`` (an
        attached server runs as it was started; ``/server_info`` says which)."""
        super().__init__(
            url,
            host=host,
            port=port,
            launch_args=launch_args,
            log_file=log_file,
            env=env,
            startup_timeout_s=startup_timeout_s,
            request_timeout_s=request_timeout_s,
            control_timeout_s=control_timeout_s,
            health_path=health_path,
            health_interval_s=health_interval_s,
            version_cache_salt=version_cache_salt,
        )
        self.pull_dir, self.store_dir = _pulling_dirs(pull_dir, store_dir)
        self._pulled: int | None = None  # the version /pull_weights last brought pull_dir to
        self.model_path = model_path
        # The command that starts a server; the flags --model-path/--host/--port follow it.
        self.launch_cmd = list(launch_cmd) if launch_cmd else [sys.executable, "-m", "sglang.launch_server"]
        self.pass_weight_version = pass_weight_version
        self.pause_mode = pause_mode
        self.flush_cache = flush_cache
        self.load_format = load_format
        self.last_flush_ok: bool | None = None
        self.deterministic = deterministic
        # What the server says of itself (``/server_info``): its SGLang version, and whether it
        # runs deterministic inference, which alone makes a seeded sample come out again.
        self.server_info: dict[str, Any] = {}

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self, checkpoint_dir: Path | None, version: int) -> None:
        if self.pull_dir is not None and self.store_dir is not None:
            # SGLang's puller seeds version 0 from the server's own model path: the store's version 0.
            model_path = self.model_path or str(self.store_dir / "weight_v000000")
            launch_version = 0
        else:
            model_path = self.model_path or (str(checkpoint_dir) if checkpoint_dir is not None else None)
            launch_version = version
        await self._connect(checkpoint_dir, launch_version, model_path)
        self.server_info = await self._server_info()
        served = await self.served_version()
        attached = self.process is None
        if served != version and ((attached and checkpoint_dir is not None) or self.pull_dir is not None):
            # A server holding other weights (attached, or launched on version 0 to pull from).
            await self._first_load(checkpoint_dir, version)
        self.version = version
        if served == version:  # (a load above labelled it; else the server carries no label of ours)
            self._labelled = True
            self._loaded_dir = checkpoint_dir
        self._start_watching()

    async def _first_load(self, checkpoint_dir: Path | None, version: int, every_s: float = 0.5) -> None:
        """Load ``version`` into a server that holds other weights. A retryable refusal (a pause the
        server answers with an error for a while, a load it cannot take yet) is asked again until
        the startup timeout: a worker whose engine failed to start exits, and one restarted into
        the same transient fault would only crash again and again."""
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            try:
                await self.prepare_weights(checkpoint_dir, (), version)
                await self.pause()
                try:
                    await self.load_weights(checkpoint_dir, (), version)
                finally:
                    await self.resume()
                return
            except RollfleetError as exc:
                if not exc.retryable or time.monotonic() + every_s > deadline:
                    raise
            await asyncio.sleep(every_s)

    def _launch_command(self, model_path: str, version: int, port: int) -> list[str]:
        cmd = [*self.launch_cmd, "--model-path", model_path, "--host", self.host, "--port", str(port)]
        if self.pass_weight_version:
            cmd += ["--weight-version", str(version)]
        if self.deterministic and DETERMINISTIC_FLAG not in self.launch_args:
            cmd.append(DETERMINISTIC_FLAG)
        return cmd + self.launch_args

    async def _server_info(self) -> dict[str, Any]:
        """The server's resolved arguments and version (``/server_info``; ``/get_server_info``
        before 0.5.23); empty where it answers neither (then nothing is claimed of it)."""
        for path in ("/server_info", "/get_server_info"):
            with contextlib.suppress(httpx.HTTPError, ValueError):
                r = await self._http.get(path, timeout=10.0)
                if r.status_code == 200 and isinstance(info := r.json(), dict):
                    return info
        return {}

    # -- replay ------------------------------------------------------------------------------

    def deterministic_for(self, payload: RolloutPayload) -> bool:
        return runs_deterministic(self.server_info)

    def build(self, deterministic: bool) -> EngineBuild:
        return server_build(self.server_info, deterministic)

    # -- requests ----------------------------------------------------------------------------

    async def generate(
        self, request_id: str, payload: RolloutPayload, session_id: str | None = None, sink: TokenSink | None = None
    ) -> Generation:
        check_payload(payload)
        if await self._admit(request_id):  # aborted while an activation held it at the gate
            return self._aborted_generation(payload.n, self.version)
        rids = [request_id] if payload.n == 1 else [f"{request_id}-{i}" for i in range(payload.n)]
        payload, drawn = with_drawn_seed(payload)
        body = generate_body(rids, payload, session_id, self._cache_salt())
        version_start = salted = self.version
        r = await self._post_request(request_id, rids, "/generate", body)
        aborted = self._take_aborted(request_id)
        if r is None or (aborted and r.status_code >= 400):
            return self._aborted_generation(payload.n, version_start)
        self._check_status(r, "/generate")
        items = r.json()
        items = items if isinstance(items, list) else [items]
        if len(items) != payload.n:
            raise EngineFailure(f"SGLang answered {len(items)} outputs for n={payload.n}")
        outputs, served, prompt_tokens = [], [], len(payload.prompt_token_ids or [])
        cached: list[int] = []
        self._refuse_foreign([label for item in items for label in labels(item)])
        sampling = payload.sampling
        for item in items:
            completion, version, prompt_len = parse_item(item, sampling.logprobs, aborted, sampling.max_tokens)
            outputs.append(completion)
            cached.append(cached_tokens(item))
            if not completion.weight_versions and version is not None:
                served.append(version)
            prompt_tokens = prompt_len or prompt_tokens
        version_start, version_end = generation_versions(outputs, version_start, served, self.version)
        return Generation(
            outputs,
            version_start,
            version_end,
            prompt_tokens=prompt_tokens,
            cached_tokens=min(cached, default=0),
            cache_rebuilt=self._session_turn(session_id, salted),
            seed=drawn,
        )

    async def end_session(self, session_id: str) -> None:
        """Forget the session; the server releases the KV it tagged with it (``/close_session``,
        best effort: older servers and servers without session radix caching may refuse)."""
        await super().end_session(session_id)
        if self._client is None or self._closed:
            return
        with contextlib.suppress(httpx.HTTPError):
            await self._http.post("/close_session", json={"session_id": session_id})

    async def _send_abort(self, ids: list[str]) -> None:
        for rid in ids:
            with contextlib.suppress(httpx.HTTPError):
                await self._http.post("/abort_request", json={"rid": rid})

    # -- activation ----------------------------------------------------------------------------

    async def _pause_server(self) -> None:
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
        result = response_json(r)
        if r.status_code == 404:
            raise EngineFailure("this SGLang server has no /pull_weights; run without pull_dir")
        if r.status_code != 200 or not result.get("success", False):
            reason = result.get("message") or error_message(r)
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
        r = await self._post_control("/update_weights_from_disk", body)
        result = response_json(r)
        if r.status_code != 200 or not result.get("success", False):
            raise EngineFailure(f"SGLang refused the weight update: {result.get('message') or error_message(r)}")
        if self.flush_cache:
            flushed = await self._post_control("/flush_cache")
            self.last_flush_ok = flushed.status_code == 200
        served = await self.served_version()
        if served is not None and served != version:
            raise EngineFailure(f"SGLang serves weight_version {served} after loading {version}")
        self.version = version
        self._labelled, self._loaded_dir = served == version, checkpoint_dir

    async def _resume_server(self) -> None:
        await self._control("/continue_generation", {})

    async def served_version(self) -> int | None:
        """The weight version the server reports (None when it reports none or a non-integer)."""
        try:
            return parse_version(await self._read_label())
        except (httpx.HTTPError, EngineFailure):
            return None

    async def _read_label(self) -> object:
        failure: Exception = EngineFailure("SGLang answered no model info")
        for path in ("/model_info", "/get_model_info"):
            try:
                r = await self._http.get(path)
            except httpx.HTTPError as exc:
                failure = exc
                continue
            if r.status_code == 200:
                return response_json(r).get("weight_version")
        raise failure
