"""A small stand-in for an SGLang server, for contract tests of the sglang adapter.

It follows SGLang's documented native HTTP shapes (``/generate`` with ``input_ids``,
``sampling_params``, ``return_logprob``, ``rid``; ``meta_info`` with ``finish_reason``,
``output_token_logprobs`` triples and ``weight_version``; ``/pause_generation`` modes;
``/update_weights_from_disk`` with ``weight_version``; ``/continue_generation``;
``/flush_cache``; ``/abort_request``; ``/health``; ``/get_model_info``) and records every
call, so tests can assert the adapter's exact requests and their order.

Generation is fake but shaped like the real thing: output token ``i`` of a sample is
``(sum(input_ids) + i) % vocab``, one token per ``token_delay_s``. A request in flight during
an in-place pause waits and then continues, and reports the weight version live when it
finished. Standard library only (``http.server`` in a thread); it also runs as a process with
SGLang's launch flags: ``python tests/sglang_standin.py --model-path P --port N``.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


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
    calls: list[Call] = field(default_factory=list)
    paused: str | None = None  # the pause mode, None when running
    running: dict[str, int] = field(default_factory=dict)  # rid -> tokens so far
    aborted: set[str] = field(default_factory=set)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def paths(self) -> list[str]:
        return [c.path for c in self.calls]

    def bodies(self, path: str) -> list[Any]:
        return [c.body for c in self.calls if c.path == path]


class _Handler(BaseHTTPRequestHandler):
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        return

    def do_GET(self) -> None:
        self._dispatch("GET")

    def do_POST(self) -> None:
        self._dispatch("POST")

    def _dispatch(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            return self._send(400, {"error": {"message": "body is not JSON"}})
        state = self.server.state
        path = self.path.split("?")[0]
        with state.cond:
            state.calls.append(Call(method, path, body))
        route = _ROUTES.get((method, path)) or _ROUTES.get(("*", path))
        if route is None:
            return self._send(404, {"detail": "Not Found"})
        status, payload = route(state, body or {})
        self._send(status, payload)

    def _send(self, status: int, payload: Any) -> None:
        data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "text/plain" if isinstance(payload, str) else "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, addr: tuple[str, int], state: StandinState) -> None:
        super().__init__(addr, _Handler)
        self.state = state


# -- routes -------------------------------------------------------------------------------------


def _generate(state: StandinState, body: dict[str, Any]) -> tuple[int, Any]:
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


def _one(state: StandinState, prompt: list[int], rid: str, params: dict[str, Any], body: dict[str, Any]) -> Any:
    max_new = int(params.get("max_new_tokens", 128))
    stops = set(params.get("stop_token_ids") or [])
    out: list[int] = []
    finish: dict[str, Any] = {"type": "length", "length": max_new}
    with state.cond:
        state.running[rid] = 0
    try:
        for i in range(max_new):
            with state.cond:
                while state.paused == "in_place" and rid not in state.aborted:
                    state.cond.wait(0.05)
                if rid in state.aborted:
                    finish = {"type": "abort", "message": "Abort request."}
                    break
            time.sleep(state.token_delay_s)
            tok = (sum(prompt) + i) % state.vocab
            out.append(tok)
            with state.cond:
                state.running[rid] = len(out)
            if tok in stops:
                finish = {"type": "stop", "matched": tok}
                break
    finally:
        with state.cond:
            state.running.pop(rid, None)
            state.aborted.discard(rid)
    meta: dict[str, Any] = {
        "id": rid,
        "finish_reason": finish,
        "prompt_tokens": len(prompt),
        "completion_tokens": len(out),
        "weight_version": state.weight_version,
    }
    if body.get("return_logprob"):
        meta["output_token_logprobs"] = [[state.logprob, t, None] for t in out]
    return {"text": "", "output_ids": out, "meta_info": meta}


def _pause(state: StandinState, body: dict[str, Any]) -> tuple[int, Any]:
    mode = body.get("mode", "abort")
    if mode not in ("abort", "retract", "in_place"):
        return 400, {"error": {"message": f"unknown mode {mode}"}}
    with state.cond:
        state.paused = mode
        if mode == "abort":
            state.aborted.update(state.running)
        state.cond.notify_all()
    return 200, {"message": "Generation paused successfully.", "status": "ok"}


def _continue(state: StandinState, body: dict[str, Any]) -> tuple[int, Any]:
    with state.cond:
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
    return (400 if busy else 200), "Cache flushed.\n"


def _abort(state: StandinState, body: dict[str, Any]) -> tuple[int, Any]:
    with state.cond:
        if body.get("abort_all"):
            state.aborted.update(state.running)
        elif body.get("rid") in state.running:
            state.aborted.add(body["rid"])
        state.cond.notify_all()
    return 200, ""


def _health(state: StandinState, body: dict[str, Any]) -> tuple[int, Any]:
    return (200, "") if state.healthy else (503, "")


def _model_info(state: StandinState, body: dict[str, Any]) -> tuple[int, Any]:
    return 200, {
        "model_path": state.model_path,
        "tokenizer_path": state.model_path,
        "is_generation": True,
        "weight_version": state.weight_version,
    }


def _weight_version(state: StandinState, body: dict[str, Any]) -> tuple[int, Any]:
    return 200, {"weight_version": state.weight_version}


_ROUTES = {
    ("*", "/generate"): _generate,
    ("POST", "/pause_generation"): _pause,
    ("POST", "/continue_generation"): _continue,
    ("POST", "/update_weights_from_disk"): _update,
    ("*", "/flush_cache"): _flush,
    ("POST", "/abort_request"): _abort,
    ("GET", "/health"): _health,
    ("GET", "/health_generate"): _health,
    ("GET", "/get_model_info"): _model_info,
    ("GET", "/get_weight_version"): _weight_version,
}


class SGLangStandin:
    """Runs the stand-in on a free loopback port in a background thread."""

    def __init__(self, host: str = "127.0.0.1", port: int = 0, **state: Any) -> None:
        self.state = StandinState(**state)
        self._server = _Server((host, port), self.state)
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
    args, _ = parser.parse_known_args()
    server = _Server(
        (args.host, args.port), StandinState(model_path=args.model_path, weight_version=args.weight_version)
    )
    server.serve_forever()


if __name__ == "__main__":
    main()
