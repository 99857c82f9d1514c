"""Every door of the gateway keeps the same promises, over real HTTP against a real broker and
echo workers: a plain request, a batch of inputs, a stream and a session's turn each honour the
client's idempotency key and its weight-version constraint; a client that leaves without a key
has its jobs cancelled in the fleet whenever it leaves (while its job is being stored, while it
waits, while it streams), one with a key has them run on; a refusal is its status before any
200; a client that leaves is counted as 499, never as a 5xx. What the fleet did is read from the
worker's engine and the broker's jobs stream, not from the gateway's word."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx
import openai
import pytest

from harness import running_worker, wait_until
from rollfleet.broker.topology import DEFAULT_TOPOLOGY
from rollfleet.gateway import app as gateway_app
from rollfleet.gateway.app import serve
from rollfleet.trainer_client import RolloutClient
from tests.helpers import CountingEcho


class Recording(CountingEcho):
    """The echo engine, recording each run's samples as (tokens made, finish reason): what the
    fleet generated, seen where it was generated."""

    def __init__(self, **kw: Any) -> None:
        super().__init__(**kw)
        self.finished: list[list[tuple[int, str]]] = []

    async def generate(self, request_id: str, payload: Any, session_id: str | None = None, sink: Any = None) -> Any:
        done = await super().generate(request_id, payload, session_id, sink)
        self.finished.append([(len(o.token_ids), o.finish_reason) for o in done.outputs])
        return done


@asynccontextmanager
async def served(url: str, namespace: str, **options: Any) -> AsyncIterator[tuple[str, RolloutClient]]:
    """A gateway in this process on a shared client id (as ``rollfleet gateway`` runs it), and
    the client under it (its connection's counters are facts about what left the process)."""
    async with await RolloutClient.connect(
        url, namespace=namespace, client_id="gw", shared=True, topology=DEFAULT_TOPOLOGY
    ) as client:
        bound: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(serve(client, "127.0.0.1", 0, started=bound.set_result, **options))
        try:
            yield f"http://127.0.0.1:{await asyncio.wait_for(bound, 10)}", client
        finally:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task


def counted(metrics: str, status: str) -> float:
    """The requests counted under ``status`` in a /metrics page, over every route."""
    total = 0.0
    for line in metrics.splitlines():
        if line.startswith("rollfleet_gateway_requests_total{") and f'status="{status}"' in line:
            total += float(line.rsplit(" ", 1)[1])
    return total


async def jobs_stored(client: RolloutClient) -> int:
    """Jobs the broker holds (a work queue: a job withdrawn, or answered and acknowledged, is gone)."""
    return int((await client.js.stream_info(client.names.jobs_stream)).state.messages)


def turn_headers(session: str, key: str | None = None) -> dict[str, str]:
    return {"X-Session-Id": session} | ({"Idempotency-Key": key} if key else {})


# -- session turns keep the promises of a plain request ----------------------------------------


async def test_a_keyed_session_turn_is_answered_once_and_names_the_clients_key(nats_url: str, namespace: str) -> None:
    """A turn with ``Idempotency-Key`` (or ``rid``) asked again, through either of two gateways on
    one client id, is the one run with its one answer, and does not move the trajectory on; the
    key with another prompt is the typed conflict a plain request gets; the answer names the
    client's key."""
    engine = Recording(per_token_s=0.001)
    body = {"input_ids": [3, 4], "sampling_params": {"max_new_tokens": 4}}
    async with (
        running_worker(nats_url, namespace, engine=engine),
        served(nats_url, namespace) as (one, _),
        served(nats_url, namespace) as (two, _),
        httpx.AsyncClient(timeout=30) as http,
    ):
        first = await http.post(f"{one}/generate", json=body, headers=turn_headers("traj-k", "turn-a"))
        assert first.status_code == 200, first.text
        assert first.json()["meta_info"]["rollfleet"]["idempotency_key"] == "turn-a"
        for gw in (one, two):  # the retry, through each gateway
            again = await http.post(f"{gw}/generate", json=body, headers=turn_headers("traj-k", "turn-a"))
            assert again.status_code == 200, again.text
            assert again.json()["meta_info"]["rollfleet"]["job_id"] == first.json()["meta_info"]["rollfleet"]["job_id"]
            assert again.json()["output_ids"] == first.json()["output_ids"]
        assert len(engine.calls) == 1
        other = await http.post(f"{two}/generate", json=body | {"input_ids": [9]},
                                headers=turn_headers("traj-k", "turn-a"))  # fmt: skip
        assert other.status_code == 422 and other.json()["error"]["code"] == "idempotency_conflict", other.text
        by_rid = await http.post(f"{two}/generate", json=body | {"rid": "turn-b"}, headers=turn_headers("traj-k"))
        assert by_rid.status_code == 200 and by_rid.json()["meta_info"]["rollfleet"]["idempotency_key"] == "turn-b"
        keyless = await http.post(f"{one}/generate", json=body, headers=turn_headers("traj-k"))
        assert keyless.status_code == 200, keyless.text
        # Turns 0 and 1 were the keyed ones: the retries spent no turn.
        assert keyless.json()["meta_info"]["rollfleet"]["idempotency_key"].endswith("/2")
        assert len(engine.calls) == 3


async def test_a_later_session_turn_is_held_to_its_own_weight_version(nats_url: str, namespace: str) -> None:
    """Each turn's ``weight_version`` binds that turn: after a first turn at version 0, a fleet
    at version 0 answers a turn asking for version 7 exactly, or at least 5, with 409, never with
    a 200 from version 0; one asking for version 0 exactly is served at it."""
    engine = Recording(per_token_s=0.001)
    body: dict[str, Any] = {"input_ids": [5], "sampling_params": {"max_new_tokens": 2}}
    async with (
        running_worker(nats_url, namespace, engine=engine),
        served(nats_url, namespace) as (base, _),
        httpx.AsyncClient(base_url=base, timeout=30) as http,
    ):
        first = await http.post("/generate", json=body, headers=turn_headers("traj-v"))
        assert first.status_code == 200, first.text
        for spec in ({"exact_version": 7}, {"min_required_version": 5}):
            later = await http.post("/generate", json=body | {"weight_version": spec}, headers=turn_headers("traj-v"))
            assert later.status_code == 409 and later.json()["error"]["code"] == "no_compatible_replica", later.text
        exact = await http.post("/generate", json=body | {"weight_version": {"exact_version": 0}},
                                headers=turn_headers("traj-v"))  # fmt: skip
        assert exact.status_code == 200 and exact.json()["meta_info"]["weight_version_end"] == 0, exact.text
        assert len(engine.calls) == 2


async def test_a_refused_first_turn_leaves_no_constraint_behind(nats_url: str, namespace: str) -> None:
    """A trajectory's first turn asking for a version no replica serves is a 409 with
    ``Retry-After``; its next turn, asking for none, is served (the refused turn's constraint does
    not stay with the session for its TTL)."""
    body: dict[str, Any] = {"input_ids": [5], "sampling_params": {"max_new_tokens": 2}}
    async with (
        running_worker(nats_url, namespace, engine=Recording()),
        served(nats_url, namespace) as (base, _),
        httpx.AsyncClient(base_url=base, timeout=30) as http,
    ):
        refused = await http.post("/generate", json=body | {"weight_version": {"exact_version": 7}},
                                  headers=turn_headers("traj-r"))  # fmt: skip
        assert refused.status_code == 409 and refused.headers["retry-after"] == "1", refused.text
        plain = await http.post("/generate", json=body, headers=turn_headers("traj-r"))
        assert plain.status_code == 200, plain.text


# -- a client that leaves --------------------------------------------------------------------

LONG = {"max_new_tokens": 1500}  # 15 s at 10 ms a token: a keyless run stopped early shows it
SHORT = {"max_new_tokens": 40}  # 0.4 s: a keyed run that runs on is waited for


def door_request(door: str, key: str | None, params: dict[str, Any]) -> tuple[dict[str, Any], dict[str, str]]:
    """The body and headers of one request through ``door``."""
    headers = {"Idempotency-Key": key} if key else {}
    if door == "batch":
        return {"input_ids": [[1, 2], [3, 4]], "sampling_params": params}, headers
    body: dict[str, Any] = {"input_ids": [1, 2], "sampling_params": params}
    if door == "stream":
        body["stream"] = True
    if door == "turn":
        headers["X-Session-Id"] = f"leave-{key}"
    return body, headers


async def ask(http: httpx.AsyncClient, body: dict[str, Any], headers: dict[str, str]) -> httpx.Response:
    """One request, read whole (a stream to its end)."""
    async with http.stream("POST", "/generate", json=body, headers=headers) as r:
        await r.aread()
        return r


@pytest.mark.parametrize("door", ["plain", "stream", "batch", "turn"])
@pytest.mark.parametrize("keyed", [False, True], ids=["keyless", "keyed"])
async def test_a_client_that_leaves_cancels_a_keyless_job_and_not_a_keyed_one(
    nats_url: str, namespace: str, door: str, keyed: bool
) -> None:
    """The client leaves while its job runs (a stream: after its 200): a keyless job is stopped
    in the fleet (its run ends early), a keyed one runs to its end and a retry with the key gets
    that one run's answer; either way /metrics counts a 499, never a 5xx."""
    engine = Recording(per_token_s=0.01)
    key = f"k-{door}" if keyed else None
    body, headers = door_request(door, key, SHORT if keyed else LONG)
    async with (
        running_worker(nats_url, namespace, engine=engine, capacity=1),
        served(nats_url, namespace) as (base, client),
        httpx.AsyncClient(base_url=base, timeout=30) as http,
    ):
        request = asyncio.create_task(ask(http, body, headers))
        await wait_until(lambda: engine.running == 1, timeout=10, what="the job running")
        request.cancel()  # the connection closes with it
        with contextlib.suppress(asyncio.CancelledError):
            await request
        await wait_until(lambda: engine.finished, timeout=20, what="the run ended")
        if keyed:
            again = await ask(http, body, headers)
            assert again.status_code == 200, again.text
            await wait_until(lambda: engine.running == 0 and len(engine.finished) == len(engine.calls), timeout=20,
                             what="every run ended")  # fmt: skip
            assert all(done == [(40, "length")] for done in engine.finished), engine.finished
            assert len(engine.calls) == (2 if door == "batch" else 1)  # one run a job, none again
        else:
            await wait_until(lambda: engine.running == 0, timeout=10, what="nothing running")
            assert all(tokens < 1500 for done in engine.finished for tokens, _ in done), engine.finished
            await wait_until(lambda: _is(jobs_stored(client), 0), timeout=10, what="no job left stored")
        metrics = (await http.get("/metrics")).text
        assert counted(metrics, "499") == 1 and not any(counted(metrics, f"5{i:02d}") for i in range(100)), metrics


async def test_a_keyless_turn_left_and_asked_again_runs_once_not_beside_itself(nats_url: str, namespace: str) -> None:
    """A trajectory's keyless turn whose client leaves mid-run, asked again at once (what a client
    does after a dropped connection): the first run is stopped, the retry is the trajectory's next
    turn and runs whole, and the two never run side by side on a replica with room for both."""
    engine = Recording(per_token_s=0.005)
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 300}}  # 1.5 s a run
    async with (
        running_worker(nats_url, namespace, engine=engine, capacity=2),
        served(nats_url, namespace) as (base, _),
        httpx.AsyncClient(base_url=base, timeout=30) as http,
    ):
        request = asyncio.create_task(ask(http, body, turn_headers("again")))
        await wait_until(lambda: engine.running == 1, timeout=10, what="the turn running")
        request.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await request
        again = await ask(http, body, turn_headers("again"))
        assert again.status_code == 200, again.text
        assert len(again.json()["output_ids"]) == 300
        assert again.json()["meta_info"]["rollfleet"]["idempotency_key"].endswith("/1")  # the next turn
    assert engine.peak == 1 and len(engine.finished) == 2, engine.finished
    assert engine.finished[0][0][0] < 300 and engine.finished[1] == [(300, "length")], engine.finished


@pytest.mark.parametrize("door", ["plain", "stream", "batch"])
async def test_a_keyless_request_left_while_its_job_is_being_stored_is_cancelled(
    broker: Any, nats_url: str, namespace: str, door: str
) -> None:
    """The broker stalls (SIGSTOP) while the gateway stores a keyless request's job; the client
    leaves; the broker comes back and stores the job it had been sent. Nobody can ask for that
    job again, so it must not run: the fleet ends with no job stored and no run left going."""
    engine = Recording(per_token_s=0.01)
    body, headers = door_request(door, None, LONG)
    async with (
        running_worker(nats_url, namespace, engine=engine, capacity=1),
        served(nats_url, namespace) as (base, client),
        httpx.AsyncClient(base_url=base, timeout=30) as http,
    ):
        # A first request declares the constraint's consumer: the next one's submit goes straight to storing.
        assert (await ask(http, {"input_ids": [9], "sampling_params": {"max_new_tokens": 1}}, {})).status_code == 200
        before = (await client.js.stream_info(client.names.jobs_stream)).state.last_seq
        storing = asyncio.Event()
        store = client.placement.store

        async def noted(*args: Any, **kwargs: Any) -> Any:
            storing.set()
            return await store(*args, **kwargs)

        client.placement.store = noted  # type: ignore[method-assign]
        broker.proc.send_signal(signal.SIGSTOP)
        try:
            request = asyncio.create_task(ask(http, body, headers))
            # The job's message has left the gateway's process: the broker will store it.
            await wait_until(lambda: storing.is_set() and client.nc.pending_data_size == 0, timeout=10,
                             what="the job sent to the stalled broker")  # fmt: skip
            request.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await request
        finally:
            broker.proc.send_signal(signal.SIGCONT)
        info = await wait_until(lambda: _stored_since(client, before), timeout=20, what="the job stored, then gone")
        assert info.state.last_seq > before  # (the broker did store it: the case is the one meant)
        await wait_until(lambda: engine.running == 0, timeout=10, what="nothing running")
        assert all(tokens < 1500 for done in engine.finished for tokens, _ in done), engine.finished


async def test_a_stream_that_cannot_be_served_is_refused_before_any_200(nats_url: str, namespace: str) -> None:
    """``stream: true`` with a constraint no replica can serve: 409 with ``Retry-After`` and the
    JSON error body, on every route, as for a request that is not streamed."""
    async with (
        running_worker(nats_url, namespace, engine=Recording()),
        served(nats_url, namespace) as (base, _),
        httpx.AsyncClient(base_url=base, timeout=30) as http,
    ):
        never = {"weight_version": {"exact_version": 7}, "stream": True}
        for route, body in (
            ("/generate", {"input_ids": [1], "sampling_params": {"max_new_tokens": 2}}),
            ("/v1/completions", {"model": "rollfleet", "prompt": [1], "max_tokens": 2}),
        ):
            r = await http.post(route, json=body | never)
            assert r.status_code == 409 and r.headers["retry-after"] == "1", (route, r.status_code, r.text)
            assert r.headers["content-type"].startswith("application/json")
            assert r.json()["error"]["code"] == "no_compatible_replica"


async def test_a_request_that_waits_for_a_replica_is_answered_once_a_held_one_starts(
    nats_url: str, namespace: str
) -> None:
    """Training is at version 2 and no replica serves version 1. The fleet's autoscaler has
    published that one held at 1 is starting (its status document, as the controller writes it,
    from a plan that launched it): a request for exactly 1 gets 409 with the time it expects as
    ``Retry-After``. The same request with ``weight_version.wait_for_replica`` is stored instead,
    waits, and is answered by the replica held at 1 once it has started."""
    from rollfleet.autoscale.controller import STATUS_KEY, status_document
    from rollfleet.autoscale.planner import PlannerState, Policy, plan
    from rollfleet.autoscale.signal import ClassDemand, ReplicaFacts, Signal
    from rollfleet.schemas import VersionRecord
    from rollfleet.workers.engines.echo import EchoEngine

    async with served(nats_url, namespace) as (base, client), httpx.AsyncClient(base_url=base, timeout=60) as http:
        for v in (1, 2):
            await client.commit_version(VersionRecord(version=v, kind="delta", base_version=v - 1))
        policy = Policy(min_replicas=0, max_replicas=2, startup_s=30)
        asked = Signal(2, {1: ClassDemand(refusals=1)})
        launched = plan(asked, [ReplicaFacts("f", active_version=2)], policy, PlannerState(), 0.0)
        assert [(x.held, x.count) for x in launched.launch] == [(1, 1)]
        doc = status_document(launched, asked, policy, "controller", time.time(), [])
        fleet_kv = await client.js.key_value(client.names.fleet_bucket)
        await fleet_kv.put(STATUS_KEY, json.dumps(doc).encode())
        await wait_until(lambda: client.fleet.autoscaler_status is not None, 10, what="the status heard")
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3}, "weight_version": {"exact_version": 1}}
        refused = await http.post("/generate", json=body)
        assert refused.status_code == 409 and refused.json()["error"]["code"] == "no_compatible_replica"
        # 30 s from its launch (published to the whole second, the header rounded up), read a moment later
        assert 25 <= int(refused.headers["retry-after"]) <= 31
        body["weight_version"] |= {"wait_for_replica": True}
        waiting = asyncio.create_task(http.post("/generate", json=body))
        await wait_until(lambda: jobs_stored(client), 20, what="the waiting request's job stored")
        assert not waiting.done()
        held = EchoEngine(startup_s=0.5)  # (a start that takes a moment, as a GPU server's)
        async with running_worker(nats_url, namespace, version=1, worker_id="held-1", engine=held):
            answer = await asyncio.wait_for(waiting, 30)
        assert answer.status_code == 200, answer.text
        meta = answer.json()["meta_info"]
        assert (meta["weight_version_start"], meta["weight_version_end"]) == (1, 1)
        assert meta["rollfleet"]["weight_versions"][0][3] == "held-1"


async def test_a_request_at_the_newest_version_waits_while_the_follower_still_loads_an_older_one(
    nats_url: str, namespace: str
) -> None:
    """The HTTP door of ``tests/test_contract.py``'s twin: the only replica follows ``latest`` and
    spends 6 s loading v1 when v2 is committed. ``min_required_version: 2`` is answered at v2 by
    that replica, not 409 (no replica shows v2 yet, but this one will reach it)."""
    from rollfleet.schemas import VersionRecord
    from tests.test_contract import SlowLoadEcho

    slow = SlowLoadEcho(load_s=6.0)
    async with (
        served(nats_url, namespace) as (base, client),
        httpx.AsyncClient(base_url=base, timeout=60) as http,
        running_worker(nats_url, namespace, engine=slow, worker_id="a", follow_versions=True) as a,
    ):
        await wait_until(lambda: client.fleet.replica("a") is not None, 10, what="the replica registered")
        await client.commit_version(VersionRecord(version=1, kind="delta", base_version=0))
        await wait_until(lambda: slow.paused, 10, what="v1 loading")
        await client.commit_version(VersionRecord(version=2, kind="delta", base_version=1))
        await wait_until(lambda: client.latest_version == 2, 10, what="v2 heard")
        assert a.version == 0
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 3},
                "weight_version": {"min_required_version": 2}}  # fmt: skip
        answer = await http.post("/generate", json=body)
    assert answer.status_code == 200, answer.text
    meta = answer.json()["meta_info"]
    assert meta["weight_version_start"] == 2 and meta["rollfleet"]["weight_versions"][0][3] == "a"


async def test_the_openai_client_reads_what_is_not_honoured_as_its_own_errors(nats_url: str, namespace: str) -> None:
    """Through the official ``openai`` client: a model not served is its ``NotFoundError``
    (``model_not_found``), a parameter not honoured its ``BadRequestError`` naming it in
    ``param``; at their neutral values they are accepted; nothing refused runs."""
    engine = Recording()
    async with (
        running_worker(nats_url, namespace, engine=engine),
        served(nats_url, namespace) as (base, _),
        httpx.AsyncClient(base_url=base, timeout=30) as http,
    ):
        oa = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.NotFoundError) as missing:
            await oa.completions.create(model="gpt-4o", prompt="x", max_tokens=2)
        assert isinstance(missing.value.body, dict) and missing.value.body["code"] == "model_not_found"
        for asked, name in (({"logit_bias": {"5": 10}}, "logit_bias"), ({"presence_penalty": 0.5}, "presence_penalty"),
                            ({"logprobs": 5}, "logprobs"), ({"echo": True}, "echo"), ({"best_of": 3}, "best_of"),
                            ({"suffix": "x"}, "suffix"), ({"stop": "\n"}, "stop")):  # fmt: skip
            with pytest.raises(openai.BadRequestError) as bad:
                await oa.completions.create(model="rollfleet", prompt="x", max_tokens=2, **asked)  # type: ignore[call-overload]
            assert isinstance(bad.value.body, dict) and bad.value.body["param"] == name, bad.value.body
        twice = await http.post("/generate", content=b'{"input_ids": [1], "input_ids": [2]}',
                                headers={"Content-Type": "application/json"})  # fmt: skip
        assert twice.status_code == 400 and "twice" in twice.json()["error"]["message"], twice.text
        assert engine.calls == []
        done = await oa.completions.create(model="rollfleet", prompt="x", max_tokens=2, user="end-user-1",
                                           presence_penalty=0, best_of=1, logprobs=0)  # fmt: skip
        assert done.model == "rollfleet" and done.choices[0].logprobs is not None and len(engine.calls) == 1


# -- headers, unknown routes, slow clients ---------------------------------------------------------


async def test_bad_headers_and_unknown_routes_get_typed_json_and_nothing_is_echoed(
    nats_url: str, namespace: str, caplog: pytest.LogCaptureFixture, capfd: pytest.CaptureFixture[str]
) -> None:
    """A header value that is not UTF-8 is a typed 400 naming the header; 404 and 405 are JSON in
    the error shape; 401 says ``WWW-Authenticate: Bearer``; an over-long or malformed
    ``Authorization`` header is refused without its bytes in the answer or in the logs."""
    secret = "S3CRET" * 2000  # past aiohttp's 8190-byte field limit
    async with (
        running_worker(nats_url, namespace, engine=Recording()),
        served(nats_url, namespace, api_key="sekrit") as (base, _),
    ):
        port = int(base.rsplit(":", 1)[1])
        ok = b"Authorization: Bearer sekrit\r\n"
        body = json.dumps({"input_ids": [1], "sampling_params": {"max_new_tokens": 2}}).encode()
        for header in (b"Idempotency-Key: \xff\xfe", b"X-Session-Id: \xc3("):
            status, head, payload = await raw_request(port, b"POST /generate", ok + header + b"\r\n", body)
            assert status == 400 and b"application/json" in head, (header, status, payload)
            error = json.loads(payload)["error"]
            assert error["code"] == "invalid_request" and header.split(b":")[0].decode() in error["message"]
        status, head, payload = await raw_request(port, b"GET /nowhere", ok, b"")
        assert status == 404 and json.loads(payload)["error"]["code"] == "not_found", payload
        status, head, payload = await raw_request(port, b"GET /generate", ok, b"")
        assert status == 405 and json.loads(payload)["error"]["code"] == "method_not_allowed", payload
        assert b"allow: post" in head.lower()
        status, head, payload = await raw_request(port, b"GET /v1/models", b"", b"")
        assert status == 401 and b"www-authenticate: bearer" in head.lower(), head
        with caplog.at_level(logging.DEBUG):
            for auth in (f"Authorization: Bearer {secret}".encode(), b"Authorization: Bearer S3CRET\x01"):
                status, head, payload = await raw_request(port, b"GET /v1/models", auth + b"\r\n", b"")
                assert status in (400, 401) and b"S3CRET" not in head + payload, (status, payload[:300])
                assert json.loads(payload)["error"]["code"] in ("invalid_request", "unauthorized")
        # What the server logged (aiohttp through logging, rollfleet to stderr); not the asyncio
        # logger's report of another test's client collected here.
        ours = [r for r in caplog.records if r.name.startswith(("aiohttp", "rollfleet"))]
        assert not any(r.exc_info for r in ours), [r.getMessage() for r in ours if r.exc_info]
        logged = "\n".join(r.getMessage() for r in ours) + capfd.readouterr().err
        assert "S3CRET" not in logged and "Traceback" not in logged, logged[:2000]


async def raw_request(port: int, line: bytes, headers: bytes, body: bytes) -> tuple[int, bytes, bytes]:
    """One HTTP/1.1 request written byte for byte (headers no client library would send): the
    status, the head and the body of the answer."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        length = b"Content-Length: %d\r\nContent-Type: application/json\r\n" % len(body) if body else b""
        writer.write(line + b" HTTP/1.1\r\nHost: gw\r\nConnection: close\r\n" + headers + length + b"\r\n" + body)
        await writer.drain()
        answer = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, payload = answer.partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), head, payload


async def test_slow_headers_are_cut_off_and_a_waiting_stream_keeps_its_connection_alive(
    nats_url: str, namespace: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Connections that send their headers a byte at a time (slowloris) are closed once the
    header-read time is up, while a normal request is served; a stream whose tokens come only at
    the end (a job that is not resumable) sends ``: keep-alive`` comments while it waits, so a
    proxy with an idle timeout does not cut it."""
    monkeypatch.setattr(gateway_app, "HEADER_TIMEOUT_S", 0.5, raising=False)
    monkeypatch.setattr(gateway_app, "SSE_KEEPALIVE_S", 0.1, raising=False)
    async with (
        running_worker(nats_url, namespace, engine=Recording(per_token_s=0.01)),
        served(nats_url, namespace) as (base, _),
        httpx.AsyncClient(base_url=base, timeout=30) as http,
    ):
        port = int(base.rsplit(":", 1)[1])
        slow = [await asyncio.open_connection("127.0.0.1", port) for _ in range(20)]
        loop = asyncio.get_running_loop()
        started = loop.time()

        async def dribble(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> float:
            with contextlib.suppress(ConnectionError):
                for byte in b"GET /health HTTP/1.1\r\nHost: gw\r\nX-Slow: " + b"a" * 100:
                    writer.write(bytes([byte]))
                    await writer.drain()
                    if reader.at_eof():
                        break
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(reader.read(1), 0.1)  # (EOF shows here)
            writer.close()
            return loop.time() - started

        closed_after = await asyncio.wait_for(asyncio.gather(*(dribble(r, w) for r, w in slow)), 30)
        assert max(closed_after) < 5, closed_after  # (a byte every 0.1 s: 122 bytes would be 12 s)
        assert (await http.get("/health")).status_code == 200
        lines: list[str] = []
        body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 60}, "stream": True}
        async with http.stream("POST", "/generate", json=body) as r:
            assert r.status_code == 200
            async for line in r.aiter_lines():
                lines.append(line)
        data = [i for i, line in enumerate(lines) if line.startswith("data: ")]
        assert lines[-2:] == ["data: [DONE]", ""] or lines[-1] == "data: [DONE]", lines[-3:]
        assert ": keep-alive" in lines[: data[0]], lines[:10]


async def _stored_since(client: RolloutClient, seq: int) -> Any:
    """The jobs stream's state once a job was stored in it past ``seq`` and none is left (withdrawn, or run)."""
    info = await client.js.stream_info(client.names.jobs_stream)
    return info if info.state.last_seq > seq and info.state.messages == 0 else None


async def _is(value: Any, want: Any) -> bool:
    return await value == want
