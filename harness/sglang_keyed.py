"""A keyed SGLang stand-in: an HTTP server whose tokens prove which weights it holds.

It answers the part of SGLang 0.5.23's HTTP API the ``sglang`` adapter uses (``/generate`` with
``input_ids``, ``/pause_generation``, ``/continue_generation``, ``/update_weights_from_disk``,
``/flush_cache``, ``/abort_request``, ``/close_session``, ``/health``, ``/model_info``), in
SGLang's shapes (``output_ids``; ``meta_info`` with ``finish_reason``, ``weight_version`` and the
per-token ``weight_versions`` spans). Unlike ``tests/sglang_standin.py``, whose tokens ignore
the weights, every token here is the keyed echo engine's (``rollfleet.workers.engines.keyed``):
a function of the key of the tensor bytes it read from ``--model-path`` at launch and from each
``/update_weights_from_disk`` since, the context and the sample's stream. So a checker holding a
version's bytes recomputes every token, and a label that does not name the weights that served
shows as different tokens (the reliability oracle's ``served``).

The sample's stream: a request's ``sampling_seed`` (the adapter sends ``sample_seed(seed, i)``
for sample ``i``), or, unseeded, its index within the batch (``keyed_token``'s rule); so these
tokens are exactly the keyed echo engine's for the same request.

A restarted process starts again on its ``--model-path`` with its ``--weight-version`` label
(SGLang's ``default``): what an engine server SIGKILLed and restarted by its supervisor does.

Fault hooks (for the machine adversary; not SGLang's): ``POST /_fault/pause_error``
``{"for_s": S}`` makes ``/pause_generation`` answer HTTP 500 for ``S`` seconds.

    python -m harness.sglang_keyed --model-path DIR --port N
"""

from __future__ import annotations

import argparse
import threading
import time
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

from harness.json_http import JsonServer
from rollfleet.workers.engines.keyed import VOCAB, context_state, keyed_token, weights_key


def read_key(model_path: str | Path) -> bytes:
    """The weights key of every tensor of a checkpoint directory, as its bytes are now (the
    same rule, and the same reads, as the keyed echo engine's)."""
    from rollfleet.policy_store import CheckpointLayout

    tensors: dict[str, bytes] = {}
    for name, loc in CheckpointLayout.read(Path(model_path)).tensors.items():
        with open(loc.file, "rb") as f:
            f.seek(loc.offset)
            tensors[name] = f.read(loc.nbytes)
    return weights_key(tensors)


def stream_of(params: dict[str, Any], index: int) -> tuple[int | None, int]:
    """(seed, sample) to pass to ``keyed_token`` for the request's sample at batch ``index``: a
    seeded one draws ``sampling_seed`` itself (as sample 0 of that seed), an unseeded one is
    told apart by its index."""
    seed = params.get("sampling_seed")
    if seed is None:
        return None, index
    return int(seed), 0


def pause_refused(now: float, refuse_until: float) -> bool:
    """Whether a pause asked at ``now`` is answered with an error (an injected fault window)."""
    return now < refuse_until


@dataclass
class KeyedState:
    model_path: str
    key: bytes
    weight_version: str = "default"
    vocab: int = VOCAB
    token_delay_s: float = 0.003
    paused: str | None = None  # the pause mode, None while running
    running: dict[str, int] = field(default_factory=dict)  # rid -> tokens so far
    aborted: set[str] = field(default_factory=set)
    refuse_pause_until: float = 0.0  # monotonic: /pause_generation fails until then
    cond: threading.Condition = field(default_factory=threading.Condition)


def _one(state: KeyedState, prompt: list[int], rid: str, params: dict[str, Any], index: int) -> dict[str, Any]:
    max_new = int(params.get("max_new_tokens", 128))
    stops = set(params.get("stop_token_ids") or [])
    seed, sample = stream_of(params, index)
    context = context_state(prompt)
    out: list[int] = []
    versions: list[str] = []  # the label live when each token was made
    finish: dict[str, Any] = {"type": "length", "length": max_new}
    with state.cond:
        state.running[rid] = 0
    try:
        for i in range(max_new):
            with state.cond:
                while state.paused in ("in_place", "retract") and rid not in state.aborted:
                    state.cond.wait(0.05)
                if rid in state.aborted:
                    finish = {"type": "abort", "message": "Abort request."}
                    break
                key, version = state.key, state.weight_version
            time.sleep(state.token_delay_s)
            tok = keyed_token(key, context, seed=seed, sample=sample, first=i == 0, vocab=state.vocab)
            context = context_state((tok,), context)
            out.append(tok)
            versions.append(version)
            with state.cond:
                state.running[rid] = len(out)
            if tok in stops:
                finish = {"type": "stop", "matched": tok}
                break
    finally:
        with state.cond:
            state.running.pop(rid, None)
            state.aborted.discard(rid)
            final = state.weight_version
    spans: list[dict[str, Any]] = []
    for i, v in enumerate(versions):
        if spans and spans[-1]["version"] == v:
            spans[-1]["end"] = i + 1
        else:
            spans.append({"version": v, "start": i, "end": i + 1})
    meta = {
        "id": rid,
        "finish_reason": finish,
        "prompt_tokens": len(prompt),
        "completion_tokens": len(out),
        "cached_tokens": 0,
        "weight_version": versions[-1] if versions else final,
        "weight_versions": spans or [{"version": final, "start": 0, "end": 0}],
    }
    return {"text": "", "output_ids": out, "meta_info": meta}


def _generate(state: KeyedState, body: dict[str, Any]) -> tuple[int, Any]:
    ids = body.get("input_ids")
    if not isinstance(ids, list):
        return 400, {"error": {"message": "this stand-in needs input_ids"}}
    batch = bool(ids) and isinstance(ids[0], list)
    prompts = ids if batch else [ids]
    rids = body.get("rid") if batch else [body.get("rid")]
    params = body.get("sampling_params") or {}
    plist = params if isinstance(params, list) else [params] * len(prompts)
    if not isinstance(rids, list) or len(rids) != len(prompts) or len(plist) != len(prompts):
        return 400, {"error": {"message": "rid/sampling_params must match the batch"}}
    results: list[Any] = [None] * len(prompts)

    def run(i: int) -> None:
        results[i] = _one(state, prompts[i], str(rids[i]), plist[i], i)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in results:
        if body.get("return_logprob"):
            r["meta_info"]["output_token_logprobs"] = [[-0.5, tok, None] for tok in r["output_ids"]]
    return 200, (results if batch else results[0])


def _pause(state: KeyedState, body: dict[str, Any]) -> tuple[int, Any]:
    mode = body.get("mode", "abort")
    if mode not in ("abort", "retract", "in_place"):
        return 400, {"error": {"message": f"unknown mode {mode}"}}
    with state.cond:
        if pause_refused(time.monotonic(), state.refuse_pause_until):
            return 500, {"error": {"message": "pause_generation failed (injected fault)"}}
        state.paused = mode
        if mode == "abort":
            state.aborted.update(state.running)
        state.cond.notify_all()
    return 200, {"message": "Generation paused successfully.", "status": "ok"}


def _continue(state: KeyedState, body: dict[str, Any]) -> tuple[int, Any]:
    with state.cond:
        state.paused = None
        state.cond.notify_all()
    return 200, {"message": "Generation continued successfully.", "status": "ok"}


def _update(state: KeyedState, body: dict[str, Any]) -> tuple[int, Any]:
    path = body.get("model_path")
    if not isinstance(path, str):
        return 400, {"success": False, "message": "model_path is required"}
    with state.cond:
        if body.get("flush_cache", True) and state.running:
            return 400, {"success": False, "message": "flush cache failed: running requests", "num_paused_requests": 0}
    try:
        key = read_key(path)  # (read outside the lock; a real server loads while paused too)
    except Exception as exc:
        return 400, {"success": False, "message": f"failed to load {path}: {exc}", "num_paused_requests": 0}
    with state.cond:
        state.key, state.model_path = key, path
        message = "Succeeded to update model weights."
        if body.get("weight_version") is not None:
            state.weight_version = str(body["weight_version"])
            message += f" Weight version updated to {state.weight_version}."
        return 200, {"success": True, "message": message, "num_paused_requests": len(state.running)}


def _flush(state: KeyedState, body: dict[str, Any]) -> tuple[int, Any]:
    with state.cond:
        busy = bool(state.running)
    return (400 if busy else 200), "Cache flushed.\n"


def _abort(state: KeyedState, body: dict[str, Any]) -> tuple[int, Any]:
    with state.cond:
        if body.get("abort_all"):
            state.aborted.update(state.running)
        elif body.get("rid") in state.running:
            state.aborted.add(body["rid"])
        state.cond.notify_all()
    return 200, ""


def _model_info(state: KeyedState, body: dict[str, Any]) -> tuple[int, Any]:
    with state.cond:
        return 200, {
            "model_path": state.model_path,
            "tokenizer_path": state.model_path,
            "is_generation": True,
            "weight_version": state.weight_version,
        }


def _pause_error(state: KeyedState, body: dict[str, Any]) -> tuple[int, Any]:
    with state.cond:
        state.refuse_pause_until = time.monotonic() + float(body.get("for_s", 0.0))
    return 200, {"refusing_pause_for_s": float(body.get("for_s", 0.0))}


_ROUTES = {
    "/generate": _generate,
    "/pause_generation": _pause,
    "/continue_generation": _continue,
    "/update_weights_from_disk": _update,
    "/flush_cache": _flush,
    "/abort_request": _abort,
    "/close_session": lambda state, body: (200, ""),
    "/health": lambda state, body: (200, ""),
    "/health_generate": lambda state, body: (200, ""),
    "/model_info": _model_info,
    "/get_model_info": _model_info,
    "/_fault/pause_error": _pause_error,
}


def _answer(state: KeyedState, method: str, path: str, body: Any) -> tuple[int, Any]:
    route = _ROUTES.get(path)
    if route is None:
        return 404, {"detail": "Not Found"}
    return route(state, body if isinstance(body, dict | list) else {})


def main(argv: list[str] | None = None) -> None:
    """Serve with SGLang's launch flags (unknown ones are ignored), until killed."""
    p = argparse.ArgumentParser(prog="python -m harness.sglang_keyed")
    p.add_argument("--model-path", required=True)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--weight-version", default="default")
    p.add_argument("--token-delay", type=float, default=0.003, help="seconds per output token")
    args, _ = p.parse_known_args(argv)
    state = KeyedState(
        model_path=args.model_path,
        key=read_key(args.model_path),
        weight_version=args.weight_version,
        token_delay_s=args.token_delay,
    )
    server = JsonServer((args.host, args.port), partial(_answer, state))
    print(f"sglang-keyed on http://{args.host}:{server.server_address[1]}", flush=True)
    server.serve_forever(poll_interval=0.05)


if __name__ == "__main__":
    main()
