"""The adversary's records: what the trainer asked and was answered, what the rogue forged,
what the adversary did. Append-only JSON lines, fsynced per record, so a SIGKILLed writer
loses at most the record it was writing; the oracle reads them after the run.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import xxhash

FORGED_TOKEN = 31_337  # every completion the rogue forges is made of this token


class Journal:
    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", encoding="utf-8")

    def write(self, record: dict[str, Any], sync: bool = True) -> None:
        self._f.write(json.dumps(record, separators=(",", ":"), default=str) + "\n")
        self._f.flush()
        if sync:
            os.fsync(self._f.fileno())

    def close(self) -> None:
        self._f.close()

    @staticmethod
    def read(path: Path) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        try:
            lines = Path(path).read_text(encoding="utf-8", errors="replace").splitlines()
        except OSError:
            return out
        for line in lines:
            try:
                out.append(json.loads(line))
            except ValueError:
                continue  # the last line of a killed writer
        return out


def tokens_digest(outputs: Any) -> str:
    """A digest of every completion's token ids, in order."""
    h = xxhash.xxh3_64()
    for c in outputs:
        h.update(json.dumps(list(c.token_ids)).encode())
        h.update(b"|")
    return h.hexdigest()


def prompt_digest(token_ids: Any) -> str | None:
    """A digest of a prompt's token ids (None for a prompt given as text): the wiretap files each
    job it sees under it, so the oracle finds the jobs of a request whose caller never learnt
    their ids (a keyless gateway request whose client left before its answer)."""
    if token_ids is None:
        return None
    return xxhash.xxh3_64_hexdigest(json.dumps([int(t) for t in token_ids]).encode())


def prefix_digests(prompt: Any, tokens: Any) -> list[str]:
    """``prompt_digest(prompt + tokens[:c])`` for every ``c`` from 0 to ``len(tokens)``, in one pass:
    the prompts a sample's continuations were sent with, had it been continued after ``c`` tokens."""
    h = xxhash.xxh3_64()
    h.update(("[" + ", ".join(str(int(t)) for t in prompt)).encode())
    first = not list(prompt)
    out: list[str] = []
    for c in range(len(tokens) + 1):
        end = h.copy()
        end.update(b"]")
        out.append(end.hexdigest())
        if c < len(tokens):
            h.update((("" if first else ", ") + str(int(tokens[c]))).encode())
            first = False
    return out


def describe_result(result: Any) -> dict[str, Any]:
    """What the oracle needs of an accepted RolloutResult."""
    spans, replicas = [], []
    for c in result.outputs:
        spans.append([[s.version, s.start, s.end] for s in c.weight_versions])
        replicas.append([s.replica for s in c.weight_versions])
    forged = any(c.token_ids and all(t == FORGED_TOKEN for t in c.token_ids) for c in result.outputs)
    return {
        "kind": "result",
        "job_id": result.job_id,
        "worker_id": result.worker_id,
        "version_start": result.version_start,
        "version_end": result.version_end,
        "spans": spans,
        "tokens": tokens_digest(result.outputs),
        "token_ids": [list(c.token_ids) for c in result.outputs],  # recomputed by the oracle (``served``)
        "ntokens": sum(len(c.token_ids) for c in result.outputs),
        "finish": [c.finish_reason for c in result.outputs],
        "finished_at": result.finished_at,
        "generation_s": result.generation_s,
        "attempt": result.delivery_attempt,
        "fingerprint": result.fingerprint,
        "session_id": result.session_id,
        "idem_key": result.idempotency_key,
        "forged_tokens": forged,
        # resumable jobs: which replica made each span, each completion's length, tokens kept
        "replicas": replicas,
        "lengths": [len(c.token_ids) for c in result.outputs],
        "finishes": [c.finish_reason for c in result.outputs],
        "kept": getattr(result, "kept_tokens", 0),
        "replay": _replay_wire(getattr(result, "replay", None)),  # (the oracle's ``replayed``)
    }


def _replay_wire(coord: Any) -> dict[str, Any] | None:
    from rollfleet.schemas.replay import coordinate_wire

    return coordinate_wire(coord, 0)


def describe_error(exc: BaseException) -> dict[str, Any]:
    return {
        "kind": "error",
        "cls": type(exc).__name__,
        "code": getattr(exc, "code", None),
        "retryable": getattr(exc, "retryable", None),
        "message": str(getattr(exc, "message", exc))[:400],
    }


def http_answer(status: int, data: Any) -> dict[str, Any]:
    """A gateway's answer to ``/generate`` as the fields ``describe_result`` (200) or
    ``describe_error`` write: SGLang's shape (a list of items when n > 1), each item's
    ``meta_info.rollfleet`` naming its job, replica and per-token versions. What the HTTP
    answer does not carry (when the worker finished it, which delivery ran it, the request's
    fingerprint) is left out: the oracle reads it from the answer as the worker published it."""
    if status != 200:
        err = (data or {}).get("error") if isinstance(data, dict) else None
        if not isinstance(err, dict):
            return {"kind": "error", "cls": f"HTTP {status}", "code": None, "retryable": None,
                    "message": str(data)[:400], "status": status, "untyped": True}  # fmt: skip
        return {"kind": "error", "cls": err.get("type"), "code": err.get("code"), "retryable": err.get("retryable"),
                "message": str(err.get("message"))[:400], "status": status}  # fmt: skip
    items = data if isinstance(data, list) else [data]
    meta = [it.get("meta_info") or {} for it in items]
    facts = [m.get("rollfleet") or {} for m in meta]
    outputs = [SimpleNamespace(token_ids=list(it.get("output_ids") or [])) for it in items]
    forged = any(o.token_ids and all(t == FORGED_TOKEN for t in o.token_ids) for o in outputs)
    finishes = [(m.get("finish_reason") or {}).get("type") for m in meta]
    return {
        "kind": "result",
        "job_id": facts[0].get("job_id"),
        "worker_id": facts[0].get("replica"),
        "version_start": meta[0].get("weight_version_start"),
        "version_end": meta[0].get("weight_version_end"),
        "spans": [[[v, a, b] for v, a, b, _ in f.get("weight_versions") or []] for f in facts],
        "tokens": tokens_digest(outputs),
        "token_ids": [o.token_ids for o in outputs],
        "ntokens": sum(len(o.token_ids) for o in outputs),
        "finish": finishes,
        "finished_at": None,
        "generation_s": facts[0].get("generation_s"),
        "attempt": None,
        "fingerprint": None,
        "session_id": None,
        "idem_key": facts[0].get("idempotency_key"),
        "forged_tokens": forged,
        "replicas": [[r for _, _, _, r in f.get("weight_versions") or []] for f in facts],
        "lengths": [len(o.token_ids) for o in outputs],
        "finishes": finishes,
        "kept": 0,
        "logprobs": [len(m.get("output_token_logprobs") or []) for m in meta],
        "status": 200,
        "replay": facts[0].get("replay"),
    }


def seed_used(payload: dict[str, Any], desc: dict[str, Any]) -> int | None:
    """The seed an answer's samples were drawn from: the request's, or, where it gave none, the
    one the replica drew and recorded in the answer's replay coordinate (an engine server is sent
    a seed drawn for every unseeded request: campaign 7, the sglang replicas' answers judged as
    unseeded). A recorded seed is no licence: the tokens must still be what the labelled
    version's weights make under it."""
    if payload.get("seed") is not None:
        return int(payload["seed"])
    sampling = (desc.get("replay") or {}).get("sampling") or {}
    return None if sampling.get("seed") is None else int(sampling["seed"])
