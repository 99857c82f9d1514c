"""A small stand-in for an SGLang server, for contract tests of the sglang adapter.

It speaks SGLang 0.5.23's HTTP contract, taken from the installed sglang package
(``sglang_contract``): ``/generate`` bodies are decoded with ``GenerateRequest.from_json_value``
and answered with ``GenerateResponse``/``GenerateMetaInfo`` (``finish_reason``,
``output_token_logprobs``, ``weight_version`` and the per-token ``weight_versions`` spans);
control bodies are checked against io_struct's request classes (``PauseGenerationReqInput``,
``UpdateWeightFromDiskReqInput``, ``ContinueGenerationReqInput``, ``AbortReq``, and
``PullWeightsReqInput`` for ``/pull_weights``), and a body that breaks the contract gets the
400 SGLang would answer. It records every call, so tests can assert the adapter's exact
requests and their order.

Generation is fake but shaped like the real thing: output token ``i`` of a sample is
``(sum(input_ids) + i + stream * 7919) % vocab``, one token per ``token_delay_s``. The sample's
random ``stream``: under ``--enable-deterministic-inference`` (``deterministic``) SGLang's own
rule (``SamplingBatchInfo``): the request's ``sampling_seed``, or 42 for every unseeded one.
Otherwise SGLang ignores ``sampling_seed`` and draws at random; the stand-in still follows the
seed (0 unseeded), so that a test can name a sample's tokens. ``/server_info`` answers the
resolved arguments a test reads (``enable_deterministic_inference``, ``version``, ``dtype``,
``device``). A request in flight during an in-place pause waits and then continues, and reports
the weight version live when it finished. A prefix cache keyed like SGLang's radix cache (token
ids within a ``cache_salt`` namespace) answers ``meta_info.cached_tokens``: the longest prefix
of a finished request's prompt and output (all but its last token, whose KV is never computed)
that a new prompt starts with, at most all but its last token; a flush empties it.
``/close_session`` is recorded.
Standard library only (``http.server`` in a thread); it also runs as a process with SGLang's
launch flags: ``python tests/sglang_standin.py --model-path P --port N``.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from sglang_contract import api_types, check_request

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # (run as a script: the checkout's harness/)
from harness.json_http import JsonServer


@dataclass
class Call:
    method: str
    path: str
    body: Any


@dataclass
class StandinState:
    model_path: str = "standin-model"
    weight_version: str = "default"
    vocab: int = 1000
    token_delay_s: float = 0.002
    logprob: float = -0.5
    healthy: bool = True
    fail_next_update: str | None = None  # message of a refused update, once
    fail_next_pull: str | None = None  # message of a refused /pull_weights, once
    fail_next_pause: str | None = None  # message of a failed /pause_generation (HTTP 500), once
    fail_next_continue: str | None = None  # message of a failed /continue_generation (HTTP 500), once
    contract_errors: list[str] = field(default_factory=list)  # bodies that broke SGLang's contract
    calls: list[Call] = field(default_factory=list)
    paused: str | None = None  # the pause mode, None when running
    running: dict[str, int] = field(default_factory=dict)  # rid -> tokens so far
    aborted: set[str] = field(default_factory=set)
    cond: threading.Condition = field(default_factory=threading.Condition)
    radix: dict[str | None, list[list[int]]] = field(default_factory=dict)  # cache_salt -> cached sequences
    closed_sessions: list[str] = field(default_factory=list)
    deterministic: bool = False  # launched with --enable-deterministic-inference

    def paths(self) -> list[str]:
        return [c.path for c in self.calls]

    def bodies(self, path: str) -> list[Any]:
        return [c.body for c in self.calls if c.path == path]


def _answer(state: StandinState, method: str, path: str, body: Any) -> tuple[int, Any]:
    with state.cond:
        state.calls.append(Call(method, path, body))
    route = _ROUTES.get((method, path)) or _ROUTES.get(("*", path))
    if route is None:
        return 404, {"detail": "Not Found"}
    return route(state, body or {})


# -- routes -------------------------------------------------------------------------------------


def _contract_error(state: StandinState, message: str) -> tuple[int, Any]:
    with state.cond:
        state.contract_errors.append(message)
    return 400, {"error": {"message": message}}


def _generate(state: StandinState, body: dict[str, Any]) -> tuple[int, Any]:
    try:
        api_types().GenerateRequest.from_json_value(body)
    except (api_types().JsonContractError, ValueError, TypeError) as exc:
        return _contract_error(state, f"/generate: {exc}")
    ids = body.get("input_ids")
    if ids is None:
        return 400, {"error": {"message": "this stand-in needs input_ids"}}
    batch = bool(ids) and isinstance(ids[0], list)
    prompts = ids if batch else [ids]
    rids = body.get("rid") if batch else [body.get("rid")]
    params = body.get("sampling_params") or {}
    params_list = params if isinstance(params, list) else [params] * len(prompts)
    if not isinstance(rids, list) or len(rids) != len(prompts) or len(params_list) != len(prompts):
        return 400, {"error": {"message": "rid/sampling_params must match the batch"}}
    results: list[Any] = [None] * len(prompts)
    threads = [
        threading.Thread(
            target=lambda i=i: results.__setitem__(i, _one(state, prompts[i], rids[i], params_list[i], body))
        )
        for i in range(len(prompts))
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return 200, (results if batch else results[0])


def _prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


# SGLang's seed for an unseeded request under deterministic inference (``SamplingBatchInfo``).
DEFAULT_SAMPLING_SEED = 42


def _stream(state: StandinState, params: dict[str, Any]) -> int:
    """The sample's random stream, as SGLang draws it."""
    seed = params.get("sampling_seed")
    if seed is not None:
        return int(seed)
    return DEFAULT_SAMPLING_SEED if state.deterministic else 0


def _one(state: StandinState, prompt: list[int], rid: str, params: dict[str, Any], body: dict[str, Any]) -> Any:
    t = api_types()
    salt = body.get("cache_salt") or None
    with state.cond:
        held = state.radix.get(salt, [])
        cached = min(max((_prefix(seq, prompt) for seq in held), default=0), len(prompt) - 1)
    max_new = int(params.get("max_new_tokens", 128))
    seeded = _stream(state, params) * 7919
    stops = set(params.get("stop_token_ids") or [])
    out: list[int] = []
    versions: list[str] = []  # the weight version live when each output token was produced
    finish: Any = t.FinishLength(length=max_new)
    with state.cond:
        state.running[rid] = 0
    try:
        for i in range(max_new):
            with state.cond:
                while state.paused == "in_place" and rid not in state.aborted:
                    state.cond.wait(0.05)
                if rid in state.aborted:
                    finish = t.FinishAbort(message="Abort request.")
                    break
                version = state.weight_version
            time.sleep(state.token_delay_s)
            tok = (sum(prompt) + i + seeded) % state.vocab
            out.append(tok)
            versions.append(version)
            with state.cond:
                state.running[rid] = len(out)
            if tok in stops:
                finish = t.FinishStop(matched=tok)
                break
    finally:
        with state.cond:
            state.running.pop(rid, None)
            state.aborted.discard(rid)
            final = state.weight_version
            state.radix.setdefault(salt, []).append(prompt + out[:-1])
    spans: list[Any] = []
    for i, v in enumerate(versions):
        if spans and spans[-1].version == v:
            spans[-1] = t.WeightVersionSpan(version=v, start=spans[-1].start, end=i + 1)
        else:
            spans.append(t.WeightVersionSpan(version=v, start=i, end=i + 1))
    meta = t.GenerateMetaInfo(
        id=rid,
        finish_reason=finish,
        prompt_tokens=len(prompt),
        completion_tokens=len(out),
        cached_tokens=cached,
        output_token_logprobs=[t.LogprobEntry(logprob=state.logprob, token_id=x) for x in out]
        if body.get("return_logprob")
        else None,
        weight_version=versions[-1] if versions else final,
        weight_versions=spans or [t.WeightVersionSpan(version=final, start=0, end=0)],
    )
    return t.GenerateResponse(text="", output_ids=out, meta_info=meta).to_json_value()


def _checked(name: str, route: Any) -> Any:
    """A control route whose body must fit io_struct's ``name`` (FastAPI answers 422 otherwise)."""

    def handler(state: StandinState, body: dict[str, Any]) -> tuple[int, Any]:
        try:
            check_request(name, body)
        except AssertionError as exc:
            with state.cond:
                state.contract_errors.append(str(exc))
            return 422, {"detail": str(exc)}
        return route(state, body)  # type: ignore[no-any-return]

    return handler


def _pause(state: StandinState, body: dict[str, Any]) -> tuple[int, Any]:
    mode = body.get("mode", "abort")
    if mode not in ("abort", "retract", "in_place"):
        return 400, {"error": {"message": f"unknown mode {mode}"}}
    with state.cond:
        if state.fail_next_pause is not None:
            message, state.fail_next_pause = state.fail_next_pause, None
            return 500, {"error": {"message": message}}
        state.paused = mode
        if mode == "abort":
            state.aborted.update(state.running)
        state.cond.notify_all()
    return 200, {"message": "Generation paused successfully.", "status": "ok"}


def _continue(state: StandinState, body: dict[str, Any]) -> tuple[int, Any]:
    with state.cond:
        if state.fail_next_continue is not None:
            message, state.fail_next_continue = state.fail_next_continue, None
            return 500, {"error": {"message": message}}
        state.paused = None
        state.cond.notify_all()
    return 200, {"message": "Generation continued successfully.", "status": "ok"}


def _update(state: StandinState, body: dict[str, Any]) -> tuple[int, Any]:
    if "model_path" not in body:
        return 400, {"success": False, "message": "model_path is required"}
    with state.cond:
        if state.fail_next_update is not None:
            message, state.fail_next_update = state.fail_next_update, None
            return 400, {"success": False, "message": message, "num_paused_requests": 0}
        if body.get("flush_cache", True) and state.running:
            # As SGLang documents for in-place pauses: no flush while requests hold the batch.
            return 400, {"success": False, "message": "flush cache failed: running requests", "num_paused_requests": 0}
        state.model_path = body["model_path"]
        message = "Succeeded to update model weights."
        if body.get("weight_version") is not None:
            state.weight_version = str(body["weight_version"])
            message += f" Weight version updated to {state.weight_version}."
        return 200, {"success": True, "message": message, "num_paused_requests": len(state.running)}


def _flush(state: StandinState, body: dict[str, Any]) -> tuple[int, Any]:
    with state.cond:
        busy = bool(state.running)
        if not busy:
            state.radix.clear()
    return (400 if busy else 200), "Cache flushed.\n"


def _close_session(state: StandinState, body: dict[str, Any]) -> tuple[int, Any]:
    with state.cond:
        state.closed_sessions.append(body["session_id"])
    return 200, ""


def _abort(state: StandinState, body: dict[str, Any]) -> tuple[int, Any]:
    with state.cond:
        if body.get("abort_all"):
            state.aborted.update(state.running)
        elif body.get("rid") in state.running:
            state.aborted.add(body["rid"])
        state.cond.notify_all()
    return 200, ""


def _pull(state: StandinState, body: dict[str, Any]) -> tuple[int, Any]:
    """Like SGLang's /pull_weights: the published version must be in ``source_dir``."""
    with state.cond:
        if state.fail_next_pull is not None:
            message, state.fail_next_pull = state.fail_next_pull, None
            return 400, {"success": False, "message": message}
    source = Path(body["source_dir"]) / f"weight_v{body['target_version']:06d}"
    if not source.is_dir():
        return 400, {"success": False, "message": f"published weight version missing: {source}"}
    Path(body["local_checkpoint_dir"]).mkdir(parents=True, exist_ok=True)
    return 200, {"success": True, "message": f"pulled version {body['target_version']}"}


def _health(state: StandinState, body: dict[str, Any]) -> tuple[int, Any]:
    return (200, "") if state.healthy else (503, "")


def _model_info(state: StandinState, body: dict[str, Any]) -> tuple[int, Any]:
    info = api_types().GetModelInfoResponse(
        model_path=state.model_path,
        tokenizer_path=state.model_path,
        is_generation=True,
        weight_version=state.weight_version,
    )
    return 200, info.to_json_value()


def _server_info(state: StandinState, body: dict[str, Any]) -> tuple[int, Any]:
    return 200, {
        "model_path": state.model_path,
        "enable_deterministic_inference": state.deterministic,
        "dtype": "bfloat16",
        "device": "cuda",
        "version": "0.5.23",
    }


_ROUTES = {
    ("*", "/generate"): _generate,
    ("GET", "/server_info"): _server_info,
    ("GET", "/get_server_info"): _server_info,  # deprecated in 0.5.23, kept for older servers
    ("POST", "/pause_generation"): _checked("PauseGenerationReqInput", _pause),
    ("POST", "/continue_generation"): _checked("ContinueGenerationReqInput", _continue),
    ("POST", "/update_weights_from_disk"): _checked("UpdateWeightFromDiskReqInput", _update),
    ("POST", "/pull_weights"): _checked("PullWeightsReqInput", _pull),
    ("*", "/flush_cache"): _flush,  # takes no body in SGLang (a query parameter)
    ("POST", "/abort_request"): _checked("AbortReq", _abort),
    ("*", "/close_session"): _checked("CloseSessionReqInput", _close_session),
    ("GET", "/health"): _health,
    ("GET", "/health_generate"): _health,
    ("GET", "/model_info"): _model_info,
    ("GET", "/get_model_info"): _model_info,  # deprecated in 0.5.23, kept for older servers
}


class SGLangStandin:
    """Runs the stand-in on a free loopback port in a background thread."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, keep_alive: bool = False, **state: Any) -> None:
        self.state = StandinState(**state)
        self._server = JsonServer((host, port), partial(_answer, self.state), keep_alive)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, name="sglang-standin", daemon=True
        )

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host}:{port}"

    def __enter__(self) -> SGLangStandin:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self.state.cond:
            self.state.paused = None
            self.state.aborted.update(self.state.running)
            self.state.cond.notify_all()
        self._server.shutdown()
        self._server.server_close()


def main() -> None:
    """Serve with SGLang's launch flags (unknown flags are ignored), until killed."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=30000)
    parser.add_argument("--weight-version", default="default")
    parser.add_argument("--enable-deterministic-inference", action="store_true")
    args, _ = parser.parse_known_args()
    state = StandinState(
        model_path=args.model_path,
        weight_version=args.weight_version,
        deterministic=args.enable_deterministic_inference,
    )
    server = JsonServer((args.host, args.port), partial(_answer, state))
    server.serve_forever()


if __name__ == "__main__":
    main()
