"""The adversary's trainer: a real training-loop process that SIGKILL may hit at any moment.

``python -m reliability.adversary.load --nats URL --namespace NS --journal PATH --seed S --duration D
--incarnation N`` submits, for ``D`` seconds, a seeded mix of rollout jobs (exact, min and
max_staleness constraints; replayable, at_most_once and resume; small and large, chunked, answers;
fresh keys, colliding keys such as ``k``, ``k:1``, ``k/0``, ``sample``, ``sample:0``;
resubmits of the same request and reuses of a key for another request) and multi-turn
sessions (pinned, monotonic, free; a failed turn is asked again with ``generate(turn=k)``).
Every request and every answer (or typed error, or a wait that outlived its deadline by
``HANG_SLACK_S``) is journaled, fsynced, before and after it happens. Two more lanes, each in a
module of its own: a ``RolloutLoop`` (``--loop``, ``reliability.adversary.loop_load``) and HTTP
trajectories and keyless callers of the gateways (``--gateway-sessions N``,
``reliability.adversary.gateway_load``).

Incarnation N > 0 is the same trainer restarted under the same client_id after a SIGKILL: it
reads the journal, resubmits every request that has no journaled answer exactly as it was
written, asks ``result(key)`` for some answered ones, and resumes its open sessions
(``resume_session``; a turn that was in flight is sent again with the same prompt), then
carries on with new work. Nothing here checks anything: the oracle reads the journal.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import random
import sys
import time
import zlib
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from reliability.adversary.journal import Journal, describe_error, describe_result, http_answer, tokens_digest

HANG_SLACK_S = 15.0  # a wait this long past the deadline is journaled as a hang and abandoned
SUBMIT_BOUND_S = 45.0  # submit itself retries for up to 30 s while the broker is away
REASK_BOUND_S = 12.0  # asking a failed or answered key (or turn) again
FAMILIES = ("k", "sample", "rollout", "item")
GATEWAY_SHARE = 1 / 6  # of the plain min and exact calls, sent over HTTP to a gateway instead
GATEWAY_RESEND = 0.25  # of the HTTP calls, the same request asked again under an earlier HTTP key
GATEWAY_TRY_S = 6.0  # one HTTP attempt waits this long before the call is retried through the other gateway
GATEWAY_RETRY = "replayable"  # what a gateway's job is (it sends no retry policy: the client's default)


def key_families(seed: int) -> list[str]:
    """Key bases of one run: names a trainer (and an attacker) would pick, plus numbered ones."""
    rng = random.Random(f"families:{seed}")
    return [*FAMILIES, *(f"g{rng.randrange(100)}x{i}" for i in range(3))]


def family_keys(base: str) -> list[str]:
    """Keys that collide with ``base``'s chunk ids and session-turn keys."""
    return [base, f"{base}:0", f"{base}:1", f"{base}:2", f"{base}/0", f"{base}/1"]


def payload_of(spec: dict[str, Any]) -> Any:
    from rollfleet.schemas import RolloutPayload, SamplingParams

    return RolloutPayload(
        prompt_token_ids=list(spec["prompt"]),
        sampling=SamplingParams(max_tokens=int(spec["max_tokens"])),
        n=int(spec.get("n", 1)),
    )


def constraint_kwargs(req: dict[str, Any]) -> dict[str, Any]:
    kind, value = req["kind"], int(req["value"])
    return {"exact": {"exact_version": value}, "min": {"min_version": value}, "staleness": {"max_staleness": value}}[
        kind
    ]


CANCEL_WAIT_S = 5.0


def cancel_delay(key: str) -> float | None:
    """About one new call in twelve is cancelled, 0.2 to 2.2 s after it was stored (chosen by its
    key, not drawn from the schedule's generator: the seeds' schedules stay as they were)."""
    h = zlib.crc32(f"cancel:{key}".encode())
    return 0.2 + (h >> 8) % 2000 / 1000 if h % 12 == 0 else None


# Every run asks each retry policy for a result early, on min and exact constraints, whatever
# its seed draws after: each policy's promises are then judged in every run, short ones included.
_COVER = (
    ("resume", "min"),
    ("at_most_once", "exact"),
    ("replayable", "min"),
    ("resume", "exact"),
    ("at_most_once", "min"),
    ("replayable", "exact"),
)


class Load:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.inc = args.incarnation
        self.rng = random.Random(f"load:{args.seed}:{self.inc}")
        self.journal = Journal(Path(args.journal))
        self.client: Any = None
        self.n = 0
        self.rids = 0
        self.tasks: set[asyncio.Task[Any]] = set()
        self.submitted: dict[str, dict[str, Any]] = {}  # key -> request as written (this run's view)
        self.used_keys: set[str] = set()
        self.families = key_families(args.seed)
        self.stop_at = 0.0
        self.long_ok = args.duration >= 50
        self.covered = 0  # of the first requests, which cover every retry policy (_COVER)
        # The share of calls sent to a gateway is drawn from a generator of its own: the trainer's
        # other requests are what they were.
        self.gw_rng = random.Random(f"gateway-calls:{args.seed}:{self.inc}")
        self.gw_n = 0
        self.gw_submitted: dict[str, dict[str, Any]] = {}  # HTTP key -> request as written
        self.http: Any = None  # an aiohttp session

    def log(self, record: dict[str, Any]) -> None:
        record.setdefault("t", time.time())
        record.setdefault("inc", self.inc)
        self.journal.write(record)

    def rid(self) -> str:
        """An id per call (a key may be submitted several times)."""
        self.rids += 1
        return f"{self.inc}:{self.rids}"

    def spawn(self, coro: Any) -> None:
        task = asyncio.ensure_future(coro)
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)

    # -- requests ----------------------------------------------------------------------------
    def latest(self) -> int:
        return int(self.client.latest_version or 0)

    def new_request(self, large: bool = False) -> dict[str, Any]:
        rng, latest = self.rng, self.latest()
        roll = rng.random()
        if roll < 0.35:
            kind, value = "exact", max(0, latest - (1 if rng.random() < 0.3 else 0))
        elif roll < 0.65:
            kind, value = "min", rng.randint(max(0, latest - 3), latest)
        else:
            kind, value = "staleness", rng.randint(0, 2)
        roll = rng.random()
        retry = "at_most_once" if roll < 0.3 else "resume" if roll < 0.5 else "replayable"
        if self.covered < len(_COVER):  # the first requests: each policy twice, on constraints replicas meet
            retry, kind = _COVER[self.covered]
            value = 0 if kind == "min" else latest
            self.covered += 1
        prompt = [rng.randrange(1, 500) for _ in range(rng.randint(2, 12))]
        timeout = rng.uniform(8.0, 20.0)
        if large:
            spec = {"prompt": prompt, "max_tokens": rng.randint(1400, 2600), "n": 1}
            timeout = 25.0
        elif self.long_ok and retry == "at_most_once" and rng.random() < 0.15:
            spec = {"prompt": prompt, "max_tokens": rng.randint(7000, 9000), "n": 1}  # outlives its claim
            timeout = 60.0
        else:
            spec = {"prompt": prompt, "max_tokens": rng.randint(8, 200), "n": rng.choice((1, 1, 2))}
        return {"kind": kind, "value": value, "retry": retry, "payload": spec, "timeout": round(timeout, 2)}

    def choose_key(self) -> tuple[str, bool]:
        """(key, large): a fresh key, or one of a colliding family (its base is often large)."""
        rng = self.rng
        if rng.random() < 0.35:
            base = rng.choice(self.families)
            free = [k for k in family_keys(base) if k not in self.used_keys]
            if free:
                key = free[0] if rng.random() < 0.6 else rng.choice(free)
                return key, key == base and rng.random() < 0.7
        self.n += 1
        return f"job-{self.inc}-{self.n}", rng.random() < 0.1

    async def submit(self, key: str, req: dict[str, Any], op: str) -> None:
        """Submit one request as written and journal everything that happens to it."""
        from rollfleet.schemas.errors import RollfleetError

        self.used_keys.add(key)
        rid = self.rid()
        self.log({"ev": "submit", "rid": rid, "op": op, "key": key, "req": req, "latest": self.client.latest_version})
        t0 = time.time()
        try:
            handle = await asyncio.wait_for(
                self.client.submit(
                    payload_of(req["payload"]),
                    idempotency_key=key,
                    retry_policy=req["retry"],
                    timeout=req["timeout"],
                    **constraint_kwargs(req),
                ),
                SUBMIT_BOUND_S,
            )
        except RollfleetError as exc:
            answer = {"ev": "answer", "rid": rid, "op": op, "key": key, "at": "submit", "t0": t0}
            self.log({**answer, **describe_error(exc)})
            return
        except TimeoutError:
            self.log({"ev": "hang", "rid": rid, "op": op, "key": key, "at": "submit", "t0": t0})
            return
        self.submitted.setdefault(key, req)
        job = handle.job
        self.log(
            {
                "ev": "stored",
                "rid": rid,
                "op": op,
                "key": key,
                "job_id": job.job_id,
                "deadline": job.deadline,
                "constraint": [job.constraint.kind, job.constraint.version],
                "fingerprint": job.fingerprint,
                "stream_seq": handle.stream_seq,
                "t0": t0,
            }
        )
        self.spawn(self.await_answer(key, handle, job.deadline, op, t0, rid))
        delay = cancel_delay(key) if op == "new" else None
        if delay is not None:
            self.spawn(self.cancel_later(key, handle, delay, rid))

    async def cancel_later(self, key: str, handle: Any, delay: float, rid: str) -> None:
        """Cancel a call ``delay`` s after it was stored (queued, running, or answered by then) and
        journal what ``cancel()`` said it did; the oracle checks that against what happened."""
        await asyncio.sleep(delay)
        if handle.done():
            return
        t = time.time()
        try:
            outcome = await handle.cancel(timeout=CANCEL_WAIT_S)
        except Exception as exc:  # a cancel that raises is a finding too
            self.log({"ev": "cancel", "rid": rid, "key": key, "t_asked": t, "outcome": "raised", **describe_error(exc)})
            return
        self.log({"ev": "cancel", "rid": rid, "key": key, "t_asked": t, "outcome": outcome})

    async def await_answer(self, key: str, handle: Any, deadline: float, op: str, t0: float, rid: str) -> None:
        from rollfleet.schemas.errors import RollfleetError

        bound = max(1.0, deadline + HANG_SLACK_S - time.time())
        base = {"rid": rid, "op": op, "key": key, "t0": t0}
        # Half the resumable jobs (by key, not drawing from the schedule's generator) are also
        # streamed: the oracle compares the stream with the answer.
        streaming = None
        if handle.job.retry_policy == "resume" and zlib.crc32(key.encode()) % 2 == 0:
            streaming = asyncio.ensure_future(asyncio.wait_for(self.streamed(handle), bound + 5.0))
        try:
            result = await asyncio.wait_for(handle.result(), bound)
        except RollfleetError as exc:
            self.log({"ev": "answer", **base, **describe_error(exc)})
        except TimeoutError:
            self.log({"ev": "hang", **base, "deadline": deadline})
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # anything untyped is a finding too
            self.log({"ev": "answer", **base, **describe_error(exc), "untyped": True})
        else:
            seen = {}
            if streaming is not None:
                try:
                    seen = await streaming
                except Exception as exc:  # the stream of an answered job may not fail
                    seen = {"stream_error": f"{type(exc).__name__}: {exc}"}
            self.log({"ev": "answer", **base, **describe_result(result), **seen})
            return
        if streaming is not None:
            streaming.cancel()

    async def streamed(self, handle: Any) -> dict[str, Any]:
        """Consume a job's stream as a trainer would: each sample's tokens put together (rewinds
        applied), and how many chunks did not start where their sample stood."""
        samples: list[list[int]] = [[] for _ in range(handle.job.payload.n)]
        gaps = 0
        async for c in self.client.stream(handle):
            tokens = samples[c.index]
            if c.rewound:
                del tokens[c.start :]
                continue
            if c.start != len(tokens):
                gaps += 1
                del tokens[c.start :]
            tokens += c.token_ids
        return {"streamed": tokens_digest([SimpleNamespace(token_ids=t) for t in samples]), "stream_gaps": gaps}

    async def plain_loop(self) -> None:
        rng = self.rng
        while time.time() < self.stop_at:
            await asyncio.sleep(rng.expovariate(1 / 0.35))
            roll = rng.random()
            if roll < 0.12 and self.submitted:
                key = rng.choice(sorted(self.submitted))
                await self.submit(key, self.submitted[key], "resubmit")  # the same request, as written
            elif roll < 0.15 and self.submitted:
                key = rng.choice(sorted(self.submitted))
                await self.submit(key, self.new_request(), "conflict")  # the key reused for another request
            else:
                key, large = self.choose_key()
                req = self.new_request(large)
                # (the first min or exact call after those covering the retry policies always goes
                # to a gateway, as min 0: short runs judge one too)
                first = self.gw_n == 0 and self.covered >= len(_COVER)
                gw = self.args.gateways and req["kind"] in ("min", "exact")
                if gw and (self.gw_rng.random() < GATEWAY_SHARE or first):
                    if first:  # (on a constraint every replica meets, as the covering ones are)
                        req = {**req, "kind": "min", "value": 0}
                    await self.via_gateway(req)
                    continue
                await self.submit(key, req, "new")

    # -- calls through a gateway (HTTP) ---------------------------------------------------------
    async def via_gateway(self, req: dict[str, Any]) -> None:
        """A plain call sent to a ``rollfleet gateway`` over HTTP (SGLang's ``/generate``) under a
        key of its own (``http-<inc>-<n>``: the gateways' client id is not the trainer's, so its
        keys are other keys), or now and then an earlier HTTP call's request asked again."""
        if self.gw_submitted and self.gw_rng.random() < GATEWAY_RESEND:
            key = self.gw_rng.choice(sorted(self.gw_submitted))
            self.spawn(self.http_call(key, self.gw_submitted[key], "resubmit"))
            return
        from reliability.adversary.machine import GATEWAY_TIMEOUT_S

        self.gw_n += 1
        key = f"http-{self.inc}-{self.gw_n}"
        # (a gateway stores its jobs with its own --timeout: that is the call's)
        req = {**req, "retry": GATEWAY_RETRY, "timeout": GATEWAY_TIMEOUT_S}
        self.gw_submitted[key] = req
        self.spawn(self.http_call(key, req, "new"))

    def gateway_addresses(self) -> dict[str, str]:
        import json

        try:
            return dict(json.loads(Path(self.args.gateways).read_text()))
        except (OSError, ValueError):
            return {}

    async def http_call(self, key: str, req: dict[str, Any], op: str) -> None:
        """POST it to a gateway chosen at random, with an ``Idempotency-Key``; on a connection error,
        a timeout or a 503, the same key through the other gateway (as a load balancer retries),
        until the call's deadline (then plus ``HANG_SLACK_S``, a hang). Every attempt, and the
        answer converted to the fields ``describe_result`` writes, is journaled."""
        import aiohttp

        from reliability.adversary.machine import GATEWAY_CLIENT

        rid = self.rid()
        self.log({"ev": "submit", "rid": rid, "op": op, "key": key, "req": req, "client": GATEWAY_CLIENT,
                  "latest": self.client.latest_version})  # fmt: skip
        t0 = time.time()
        spec = req["payload"]
        constraint = {"min": "min_required_version", "exact": "exact_version"}[req["kind"]]
        body = {
            "input_ids": list(spec["prompt"]),
            "sampling_params": {"max_new_tokens": int(spec["max_tokens"]), "n": int(spec.get("n", 1))},
            "weight_version": {constraint: int(req["value"])},
            "return_logprob": True,
        }
        base = {"rid": rid, "op": op, "key": key, "t0": t0, "client": GATEWAY_CLIENT}
        deadline = t0 + float(req["timeout"])
        give_up = deadline + HANG_SLACK_S
        names = sorted(self.gateway_addresses())
        name = self.gw_rng.choice(names) if names else "g1"
        last_503: dict[str, Any] | None = None  # the last 503 answer (a retryable error)
        tries = 0
        while True:
            now = time.time()
            if now >= give_up or (last_503 is not None and now >= deadline):
                # Past the deadline, a 503 it kept getting is its answer; with no answer at all, a hang.
                if last_503 is not None:
                    self.log({"ev": "answer", **base, **last_503, "tries": tries})
                else:
                    self.log({"ev": "hang", **base, "tries": tries})
                return
            address = self.gateway_addresses().get(name)
            tries += 1
            attempt = {"ev": "http_attempt", "rid": rid, "key": key, "gateway": name, "address": address, "t_sent": now}
            try:
                if address is None:
                    raise aiohttp.ClientConnectionError(f"{name} has no address (not running)")
                wait = aiohttp.ClientTimeout(total=max(0.5, min(GATEWAY_TRY_S, give_up - now)))
                async with self.http.post(f"{address}/generate", json=body, headers={"Idempotency-Key": key},
                                          timeout=wait) as resp:  # fmt: skip
                    status, data = resp.status, await resp.json(content_type=None)
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                self.log({**attempt, "outcome": f"{type(exc).__name__}: {str(exc)[:120]}"})
            else:
                self.log({**attempt, "outcome": status})
                answer = http_answer(status, data)
                if status != 503:
                    self.log({"ev": "answer", **base, **answer, "tries": tries})
                    return
                # A 503 is tried again through the other gateway; the same error from both (not
                # "unavailable": the broker away) is the key's own stored answer.
                if last_503 is not None and answer.get("code") == last_503.get("code") != "unavailable":
                    self.log({"ev": "answer", **base, **answer, "tries": tries})
                    return
                last_503 = answer
            others = [n for n in sorted(self.gateway_addresses()) if n != name]
            name = others[0] if others else ("g2" if name == "g1" else "g1")  # the other gateway
            await asyncio.sleep(0.2)

    # -- sessions ----------------------------------------------------------------------------
    def session_settings(self) -> dict[str, Any]:
        rng = self.rng
        policy = rng.choice(("pinned", "monotonic", "free"))
        base = rng.choice(({}, {}, {"min_version": 0}, {"max_staleness": 1}))
        retry = "at_most_once" if rng.random() < 0.25 else "replayable"
        return {"policy": policy, "constraint": base, "retry": retry}

    def open_session(self, sid: str, settings: dict[str, Any]) -> Any:
        return self.client.session(
            sid,
            version_policy=settings["policy"],
            retry_policy=settings["retry"],
            affinity_wait_s=1.0,
            **settings["constraint"],
        )

    async def turn(self, session: Any, spec: dict[str, Any], timeout: float, turn: int | None = None) -> Any:
        """One ``generate`` (``turn``: ask an earlier turn again), journaled; the result or None."""
        from rollfleet.schemas.errors import RollfleetError

        sid = session.session_id
        index = session.next_turn if turn is None else turn
        key = f"{sid}/{index}"
        op = "turn" if turn is None else "reask-turn"
        rid = self.rid()
        self.log(
            {
                "ev": "turn",
                "rid": rid,
                "op": op,
                "sid": sid,
                "turn": index,
                "key": key,
                "payload": spec,
                "timeout": timeout,
            }
        )
        t0 = time.time()
        # Asking a turn again is what a user does without a time-out: it must come back by itself.
        bound = timeout + HANG_SLACK_S if turn is None else REASK_BOUND_S
        record: dict[str, Any] = {"ev": "answer", "rid": rid, "op": op, "sid": sid, "turn": index, "key": key, "t0": t0}
        call = session.generate(payload_of(spec), timeout=timeout if turn is None else None, turn=turn)
        try:
            result = await asyncio.wait_for(call, bound)
            record["session"] = self.session_state(session)
        except RollfleetError as exc:
            record["session"] = self.session_state(session)
            self.log({**record, **describe_error(exc), "spent": session.next_turn > index})
            return None
        except TimeoutError as exc:
            if time.time() - t0 < bound - 0.5:  # generate's own TimeoutError (untyped), not our bound
                self.log({**record, **describe_error(exc), "untyped": True, "spent": session.next_turn > index})
            else:
                self.log({**record, "ev": "hang", "bound": bound, "spent": session.next_turn > index})
            return None
        except Exception as exc:
            self.log({**record, **describe_error(exc), "untyped": True, "spent": session.next_turn > index})
            return None
        self.log({**record, **describe_result(result), "spent": True})
        return result

    @staticmethod
    def session_state(session: Any) -> dict[str, Any]:
        """The session record's progress as the client keeps it (a pinned session's pin)."""
        rec = getattr(session, "record", None)
        return {k: getattr(rec, k, None) for k in ("last_version", "replica", "next_turn")}

    async def conversation(self, session: Any, context: list[int], turns: int) -> None:
        rng = self.rng
        for _ in range(turns):
            if time.time() >= self.stop_at:
                break
            long_turn = rng.random() < 0.25  # long enough to be running when its replica is stopped
            tokens = rng.randint(300, 900) if long_turn else rng.randint(10, 120)
            spec = {"prompt": context[-200:], "max_tokens": tokens, "n": 1}
            index = session.next_turn
            result = await self.turn(session, spec, round(rng.uniform(12.0, 20.0), 2))
            if result is None:
                if session.next_turn > index and rng.random() < 0.7:
                    await self.turn(session, spec, REASK_BOUND_S, turn=index)  # ask the failed turn again
                if rng.random() < 0.4:
                    break
            else:
                context += list(result.outputs[0].token_ids[:8])
            await asyncio.sleep(rng.uniform(0.0, 1.5))

    async def session_loop(self, lane: int) -> None:
        from rollfleet.schemas.errors import RollfleetError

        rng = self.rng
        count = 0
        while time.time() < self.stop_at:
            count += 1
            sid = f"s{self.inc}-{lane}-{count}"
            settings = self.session_settings()
            self.log({"ev": "session_open", "sid": sid, **settings})
            try:
                session = await self.open_session(sid, settings).open()
            except RollfleetError as exc:
                self.log({"ev": "session_error", "sid": sid, **describe_error(exc)})
                await asyncio.sleep(1.0)
                continue
            await self.conversation(session, [1 + lane, 2 + count % 50], rng.randint(2, 6))
            with contextlib.suppress(Exception):
                await session.close()
            self.log({"ev": "session_close", "sid": sid})
            await asyncio.sleep(rng.uniform(0.0, 1.0))

    # -- after a restart -----------------------------------------------------------------------
    async def resume(self) -> None:
        """What the restarted trainer recovers from its journal."""

        records = Journal.read(Path(self.args.journal))
        requests: dict[str, dict[str, Any]] = {}
        answered: set[str] = set()
        sessions: dict[str, dict[str, Any]] = {}
        closed: set[str] = set()
        turns: dict[str, dict[int, dict[str, Any]]] = {}
        turn_answers: dict[str, set[int]] = {}
        gateway_calls: dict[str, dict[str, Any]] = {}
        for r in records:
            ev = r.get("ev")
            if ev == "submit" and r.get("client"):  # a call through a gateway: asked again through one
                gateway_calls.setdefault(r["key"], r["req"])
            elif ev == "submit" and r.get("op") in ("new", "resubmit", "resume"):
                requests.setdefault(r["key"], r["req"])
            elif ev == "answer" and "sid" not in r and not r.get("client"):
                answered.add(r["key"])
            elif ev == "answer" and r.get("client"):
                gateway_calls.pop(r["key"], None)
            elif ev == "session_open":
                sessions[r["sid"]] = r
            elif ev == "session_close":
                closed.add(r["sid"])
            elif ev == "turn" and r.get("op") == "turn":
                turns.setdefault(r["sid"], {})[int(r["turn"])] = r
            elif ev == "answer" and "sid" in r and r.get("spent", True):
                turn_answers.setdefault(r["sid"], set()).add(int(r["turn"]))
        self.used_keys |= set(requests)
        pending = [k for k in requests if k not in answered]
        self.log({"ev": "resume", "pending": len(pending), "answered": len(answered), "sessions": len(sessions)})
        for key in pending:  # exactly as written, so the same key is the same request
            await self.submit(key, requests[key], "resume")
        if self.args.gateways:
            for key, req in gateway_calls.items():  # unanswered HTTP calls: their keys asked again
                self.spawn(self.http_call(key, req, "resume"))
        for key in self.rng.sample(sorted(answered), min(15, len(answered))):
            self.spawn(self.reask(key))
        for sid, opened in sessions.items():
            if sid not in closed:
                self.spawn(self.resume_session(sid, opened, turns.get(sid, {}), turn_answers.get(sid, set())))

    async def reask(self, key: str) -> None:
        from rollfleet.schemas.errors import RollfleetError

        t0 = time.time()
        try:
            result = await self.client.result(key, timeout=REASK_BOUND_S)
        except RollfleetError as exc:
            self.log({"ev": "reask", "key": key, "t0": t0, **describe_error(exc)})
        except TimeoutError:
            self.log({"ev": "reask", "key": key, "t0": t0, "kind": "timeout"})
        else:
            self.log({"ev": "reask", "key": key, "t0": t0, **describe_result(result)})

    async def resume_session(
        self, sid: str, opened: dict[str, Any], turns: dict[int, dict[str, Any]], answered: set[int]
    ) -> None:
        from rollfleet.schemas.errors import RollfleetError

        try:
            session = await self.client.resume_session(sid, affinity_wait_s=1.0)
        except RollfleetError as exc:
            self.log({"ev": "session_resume", "sid": sid, **describe_error(exc)})
            return
        self.log({"ev": "session_resume", "sid": sid, "next_turn": session.next_turn, "kind": "ok"})
        context = [1, 2]
        inflight = [t for t in sorted(turns) if t not in answered]
        for t in inflight:
            spec = turns[t]["payload"]
            if t == session.next_turn:  # the dead process's turn: sent again, with the same prompt
                await self.turn(session, spec, float(turns[t]["timeout"]))
            elif t < session.next_turn:  # answered before the kill, not journaled: read it back
                await self.turn(session, spec, REASK_BOUND_S, turn=t)
            context = list(spec["prompt"])
        await self.conversation(session, context, self.rng.randint(1, 3))
        with contextlib.suppress(Exception):
            await session.close()
        self.log({"ev": "session_close", "sid": sid})

    # -- the run -----------------------------------------------------------------------------
    async def run(self) -> int:
        from rollfleet.broker.topology import TopologyConfig
        from rollfleet.trainer_client import RolloutClient

        a = self.args
        topo = TopologyConfig(
            ack_wait_s=a.ack_wait,
            duplicate_window_s=a.duplicate_window,
            max_deliver=a.max_deliver,
            replicas=a.stream_replicas,
        )
        url = os.environ.get("RF_ADV_TRAINER_URL", a.nats)
        self.log({"ev": "start", "pid": os.getpid()})
        self.client = await RolloutClient.connect(
            url, namespace=a.namespace, client_id=a.client_id, topology=topo, default_timeout_s=30.0
        )
        self.log({"ev": "connected", "latest": self.client.latest_version})
        self.stop_at = time.time() + a.duration
        import aiohttp

        self.http = aiohttp.ClientSession()
        try:
            if self.inc > 0:
                await self.resume()
            lanes = [self.plain_loop(), *(self.session_loop(i) for i in range(a.sessions))]
            if a.loop:  # a RolloutLoop of its own client (reliability.adversary.loop_load)
                from reliability.adversary.loop_load import LoopLane

                lanes.append(LoopLane(self).run())
            if a.gateways:  # HTTP trajectories and keyless callers (reliability.adversary.gateway_load)
                from reliability.adversary.gateway_load import GatewaySessions

                lanes += [GatewaySessions(self, i).run() for i in range(a.gateway_sessions)]
            await asyncio.gather(*lanes)
            # Everything outstanding resolves, or is journaled as a hang, within its bound.
            deadline = time.time() + 60.0 + HANG_SLACK_S
            while self.tasks and time.time() < deadline:
                await asyncio.wait(list(self.tasks), timeout=1.0)
            self.log({"ev": "done", "left": len(self.tasks)})
        finally:
            for task in list(self.tasks):
                task.cancel()
            await self.http.close()
            await self.client.close()
        return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m reliability.adversary.load")
    p.add_argument("--nats", required=True)
    p.add_argument("--namespace", required=True)
    p.add_argument("--client-id", default="trainer")
    p.add_argument("--journal", required=True)
    p.add_argument("--seed", type=int, required=True)
    p.add_argument("--incarnation", type=int, default=0)
    p.add_argument("--duration", type=float, default=30.0)
    p.add_argument("--sessions", type=int, default=3, help="sessions running at once")
    p.add_argument("--ack-wait", type=float, default=2.0)
    p.add_argument("--stream-replicas", type=int, default=1, help="3 on a 3-node cluster")
    p.add_argument("--duplicate-window", type=float, default=15.0)
    p.add_argument("--max-deliver", type=int, default=10)
    p.add_argument("--gateways", default=None, help="a JSON file of gateway addresses (name -> http://HOST:PORT)")
    p.add_argument("--loop", action="store_true", help="a RolloutLoop lane (reliability.adversary.loop_load)")
    p.add_argument(
        "--gateway-sessions", type=int, default=0, help="lanes of HTTP trajectories and keyless callers of the gateways"
    )
    args = p.parse_args(argv)
    return asyncio.run(Load(args).run())


if __name__ == "__main__":
    sys.exit(main())
