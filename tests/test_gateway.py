"""The gateway (``rollfleet gateway``): its contract as pure functions, then a real gateway in
front of real workers on a real broker, asked by clients nobody here wrote: the official
``openai`` package, and bodies checked with SGLang's own ``GenerateRequest``. Bad input gets a
typed 4xx and changes nothing; a retried key runs once; a client that leaves without a key has
its job cancelled in the fleet; a gateway process SIGKILLed mid-request loses nothing a retry
with the same key through another gateway cannot get back."""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from sglang_contract import api_types

from harness import ProcessGroup, running_worker, wait_until
from harness.processes import rollfleet_command
from rollfleet.broker.connection import connect
from rollfleet.broker.topology import DEFAULT_TOPOLOGY, TopologyConfig
from rollfleet.cli import event_loop
from rollfleet.gateway import protocol
from rollfleet.gateway.app import serve
from rollfleet.schemas import (
    AskedConstraint,
    Completion,
    Names,
    RolloutResult,
    VersionSpan,
    coordinate_from_wire,
    coordinate_wire,
)
from rollfleet.schemas.errors import Expired, InvalidRequest, NoCompatibleReplica
from rollfleet.trainer_client import RolloutClient, answers
from tests.helpers import CountingEcho, stored_results

# -- the contract, pure ------------------------------------------------------------------------


def test_a_generate_body_becomes_a_payload_and_a_constraint() -> None:
    body = {
        "input_ids": [3, 4, 5],
        "sampling_params": {"max_new_tokens": 7, "temperature": 0.5, "top_k": -1, "ignore_eos": True, "n": 2},
        "return_logprob": True,
        "weight_version": {"min_required_version": 3},
        "rid": "k1",
    }
    req = protocol.parse_generate(body, key_header=None, default_max_staleness=None)
    assert req.payload.prompt_token_ids == [3, 4, 5] and req.payload.n == 2
    assert req.payload.sampling.max_tokens == 7 and req.payload.sampling.top_k == 0
    assert req.payload.extra == {"ignore_eos": True}
    assert req.constraint == AskedConstraint("min", 3) and req.idempotency_key == "k1" and req.logprobs
    exact = protocol.parse_generate(
        {"text": "hi", "weight_version": {"exact_version": 2}}, key_header="h", default_max_staleness=1
    )
    assert exact.constraint == AskedConstraint("exact", 2) and exact.idempotency_key == "h"
    default = protocol.parse_generate({"text": "hi"}, key_header=None, default_max_staleness=1)
    assert default.constraint == AskedConstraint("staleness", 1)
    anyv = protocol.parse_generate({"text": "hi"}, key_header=None, default_max_staleness=None)
    assert anyv.constraint == AskedConstraint("min", 0)


@pytest.mark.parametrize(
    "body",
    [
        [],
        {"input_ids": [1], "text": "x"},
        {},
        {"input_ids": [[1, 2], []]},  # (a batch with an empty input)
        {"text": ["a", None]},
        {"input_ids": [1, "2"]},
        {"input_ids": [-1]},
        {"input_ids": [1], "sampling_params": {"max_new_tokens": "9"}},
        {"input_ids": [1], "sampling_params": {"max_tokens": 9}},  # OpenAI's name in SGLang's object
        {"input_ids": [1], "weight_version": {"min_version": 1}},  # a misspelt constraint
        {"input_ids": [1], "weight_version": {"min_required_version": 1, "exact_version": 1}},
        {"input_ids": [1], "weight_version": 3},
        {"input_ids": [1], "stream": "yes"},
        {"input_ids": [1], "rid": ["a"]},
    ],
)
def test_a_bad_generate_body_is_a_typed_error(body: Any) -> None:
    with pytest.raises(InvalidRequest):
        protocol.parse_generate(body, key_header=None, default_max_staleness=None)


def test_the_body_miles_sends_is_accepted_and_its_sampling_keys_reach_the_engine() -> None:
    """miles' own default request (rollout/generate_utils/generate_endpoint_utils.py and
    sglang_rollout.py): its sampling parameters include SGLang-only keys."""
    body = {
        "input_ids": [1, 2, 3],
        "sampling_params": {
            "temperature": 1.0, "top_p": 1.0, "top_k": -1, "max_new_tokens": 16, "stop": None,
            "stop_token_ids": None, "skip_special_tokens": False, "no_stop_trim": True,
            "spaces_between_special_tokens": False, "sampling_seed": 7,
        },
        "return_logprob": True,
        "return_routed_experts": False,
        "return_indexer_topk": False,
    }  # fmt: skip
    api_types().GenerateRequest.from_json_value(body)
    req = protocol.parse_generate(body, key_header=None, default_max_staleness=None)
    assert req.payload.sampling.seed == 7 and req.payload.sampling.top_k == 0
    # SGLang's text options go where the SGLang engine reads its pass-through (as rollfleet's miles
    # integration puts them); ``stop: None`` is no stop string.
    assert req.payload.extra == {"sampling_params": {"skip_special_tokens": False, "no_stop_trim": True,
                                                     "spaces_between_special_tokens": False}}  # fmt: skip


def test_completions_bodies_as_the_openai_client_sends_them() -> None:
    req = protocol.parse_completions(
        {"model": "m", "prompt": [1, 2], "max_tokens": 4, "logprobs": 0, "weight_version": {"exact_version": 0}},
        key_header=None,
        default_max_staleness=None,
    )
    assert (
        req.payload.prompt_token_ids == [1, 2] and req.logprobs and req.constraint == AskedConstraint("exact", 0)
    )
    assert (
        protocol.parse_completions({"prompt": ["hi"]}, key_header=None, default_max_staleness=None).payload.prompt_text
        == "hi"
    )
    for bad in ({"prompt": ["a", "b"]}, {"prompt": 3}, {"prompt": "x", "max_tokens": 0}, {"prompt": "x", "stop": 3}):
        with pytest.raises(InvalidRequest):
            protocol.parse_completions(bad, key_header=None, default_max_staleness=None)


def _result(**kw: Any) -> RolloutResult:
    spans = [VersionSpan(version=1, start=0, end=2), VersionSpan(version=2, start=2, end=3)]
    out = Completion(token_ids=[7, 8, 9], finish_reason="length", logprobs=[-0.1, -0.2, -0.3], text="abc",
                     weight_versions=spans)  # fmt: skip
    base = dict(job_id="j", idempotency_key="k", client_id="c", outputs=[out], version_start=1, version_end=2,
                worker_id="w", engine="echo", queue_wait_s=0.0, generation_s=0.1, delivery_attempt=1,
                finished_at=0.0, prompt_tokens=3)  # fmt: skip
    return RolloutResult(**(base | kw))


def test_responses_carry_what_miles_and_openai_clients_read_and_the_versions() -> None:
    g = protocol.generate_response(_result(), logprobs=True)
    assert isinstance(g, dict) and g["text"] == "abc"
    meta = g["meta_info"]
    assert meta["finish_reason"] == {"type": "length", "length": 3}
    assert meta["output_token_logprobs"] == [[-0.1, 7, None], [-0.2, 8, None], [-0.3, 9, None]]
    assert (meta["weight_version"], meta["weight_version_start"], meta["weight_version_end"]) == ("2", 1, 2)
    assert meta["rollfleet"]["weight_versions"] == [[1, 0, 2, "w"], [2, 2, 3, "w"]]
    c = protocol.completions_response(_result(), model="m", created=1, logprobs=True)
    assert c["choices"][0]["token_ids"] == [7, 8, 9] and c["choices"][0]["logprobs"]["token_logprobs"][2] == -0.3
    assert c["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}


def test_errors_map_to_statuses_a_client_can_act_on() -> None:
    busy = protocol.error_reply(NoCompatibleReplica("none at exact:9"))
    assert busy.status == 409 and busy.headers == {"Retry-After": "1"} and busy.body["error"]["retryable"]
    assert protocol.error_reply(Expired("late")).status == 504
    bad = protocol.error_reply(InvalidRequest("no"))
    assert bad.status == 400 and bad.body["error"]["code"] == "invalid_request" and not bad.body["error"]["retryable"]


# -- a real gateway --------------------------------------------------------------------------


@asynccontextmanager
async def gateway(url: str, namespace: str, **options: Any) -> AsyncIterator[str]:
    """A gateway in this process, as ``rollfleet gateway`` runs it (a shared client id)."""
    topology = options.pop("topology", DEFAULT_TOPOLOGY)
    async with await RolloutClient.connect(
        url, namespace=namespace, client_id="gw", shared=True, topology=topology
    ) as client:
        bound: asyncio.Future[int] = asyncio.get_running_loop().create_future()
        task = asyncio.create_task(serve(client, "127.0.0.1", 0, started=bound.set_result, **options))
        try:
            yield f"http://127.0.0.1:{await asyncio.wait_for(bound, 10)}"
        finally:
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task


async def test_the_official_openai_client_gets_exact_tokens_logprobs_and_versions(
    nats_url: str, namespace: str
) -> None:
    async with (
        running_worker(nats_url, namespace, engine=CountingEcho(per_token_s=0.002)),
        gateway(nats_url, namespace, api_key="sekrit") as base,
    ):
        oa = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="sekrit", max_retries=0)
        models = await oa.models.list()
        assert [m.id for m in models.data] == ["rollfleet"]
        done = await oa.completions.create(
            model="rollfleet", prompt=[5, 6, 7], max_tokens=6, logprobs=0,
            extra_body={"weight_version": {"min_required_version": 0}},
        )  # fmt: skip
        choice = done.choices[0]
        extra = choice.model_extra or {}
        assert len(extra["token_ids"]) == 6 and choice.finish_reason == "length"
        assert choice.logprobs is not None and len(choice.logprobs.token_logprobs or []) == 6
        assert extra["rollfleet"]["weight_versions"][0][:3] == [0, 0, 6]
        # The sample's replay coordinate: the one the worker stored with its result, in the wire form.
        (stored,) = await stored_results(nats_url, namespace, "gw", extra["rollfleet"]["idempotency_key"])
        assert stored.replay is not None and stored.replay.sampling.max_tokens == 6
        assert extra["rollfleet"]["replay"] == coordinate_wire(stored.replay, 0)
        assert coordinate_from_wire(extra["rollfleet"]["replay"]) == (stored.replay, 0)
        chunks = [
            c async for c in await oa.completions.create(model="rollfleet", prompt="hello", max_tokens=5, stream=True)
        ]
        streamed = [t for c in chunks for t in (c.choices[0].model_extra or {}).get("token_ids", [])]
        assert len(streamed) == 5 and chunks[-1].choices[0].finish_reason == "length"
        # No replica at exact:9: a 409 the client sees as a conflict, with the code and retryable.
        with pytest.raises(openai.ConflictError) as busy:
            await oa.completions.create(model="rollfleet", prompt=[1], max_tokens=2,
                                        extra_body={"weight_version": {"exact_version": 9}})  # fmt: skip
        assert busy.value.response.headers["retry-after"] == "1"
        error = busy.value.body  # (the client hands over the body's "error" object)
        assert isinstance(error, dict) and error["code"] == "no_compatible_replica" and error["retryable"] is True
        with pytest.raises(openai.AuthenticationError):
            await openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0).models.list()


async def test_generate_in_sglangs_shape_retried_by_key_runs_once(nats_url: str, namespace: str) -> None:
    engine = CountingEcho(per_token_s=0.002)
    body = {"input_ids": [3, 4, 5], "sampling_params": {"max_new_tokens": 8, "temperature": 1.0},
            "return_logprob": True}  # fmt: skip
    api_types().GenerateRequest.from_json_value(body)  # what we send is what SGLang accepts
    async with (
        running_worker(nats_url, namespace, engine=engine),
        gateway(nats_url, namespace) as base,
        httpx.AsyncClient(base_url=base, timeout=30) as http,
    ):
        first = await http.post("/generate", json=body, headers={"Idempotency-Key": "g-1"})
        again = await http.post("/generate", json=body, headers={"Idempotency-Key": "g-1"})
        assert first.status_code == again.status_code == 200, first.text
        a, b = first.json(), again.json()
        assert a["meta_info"]["rollfleet"]["job_id"] == b["meta_info"]["rollfleet"]["job_id"]
        assert a["output_ids"] == b["output_ids"] and len(engine.calls) == 1  # one run, one answer
        meta = a["meta_info"]
        assert [t for _, t, _ in meta["output_token_logprobs"]] == a["output_ids"]
        assert meta["finish_reason"]["type"] == "length" and meta["weight_version"] == "0"
        (stored,) = await stored_results(nats_url, namespace, "gw", "g-1")
        assert stored.replay is not None and meta["rollfleet"]["replay"] == coordinate_wire(stored.replay, 0)
        # Bad input: a typed 400 naming the problem, and nothing submitted.
        for bad in (b"{not json", json.dumps({"input_ids": [1], "weight_version": {"min": 1}}).encode(),
                    b"[" * 100_000 + b"]" * 100_000):  # fmt: skip
            r = await http.post("/generate", content=bad, headers={"Content-Type": "application/json"})
            assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_request", r.text
        big = await http.post(
            "/generate", content=b" " * (2 * 1024 * 1024), headers={"Content-Type": "application/json"}
        )
        assert big.status_code == 413
        assert len(engine.calls) == 1
        health = await http.get("/health")
        assert health.status_code == 200 and health.json()["replicas"] == 1
        metrics = (await http.get("/metrics")).text
        assert 'rollfleet_gateway_requests_total{route="/generate",status="200"} 2.0' in metrics


def test_a_session_header_names_one_stable_valid_session() -> None:
    a = protocol.session_id_of("traj-17")
    assert a == protocol.session_id_of("traj-17") != protocol.session_id_of("traj-18")
    assert a.startswith("gw-") and len(a) == 27 and protocol.session_id_of("ü/../*>") != a
    for bad in ("", "x" * 513):
        with pytest.raises(InvalidRequest):
            protocol.session_id_of(bad)


async def test_a_trajectorys_turns_stick_to_one_replica_through_the_routing_header(
    nats_url: str, namespace: str
) -> None:
    """Six turns of one trajectory (miles' ``X-SMG-Routing-Key``), each prompt the whole context
    so far, on two replicas: every turn is served by the replica holding its context, and the
    replica reports the context's prefix as cached from the second turn on."""
    engines = {"a": CountingEcho(per_token_s=0.002), "b": CountingEcho(per_token_s=0.002)}
    async with (
        running_worker(nats_url, namespace, worker_id="a", engine=engines["a"]),
        running_worker(nats_url, namespace, worker_id="b", engine=engines["b"]),
        gateway(nats_url, namespace) as base,
        httpx.AsyncClient(base_url=base, timeout=30) as http,
    ):
        context = [3, 4, 5]
        served, cached = [], []
        for _ in range(6):
            body = {"input_ids": context, "sampling_params": {"max_new_tokens": 4}}
            r = await http.post("/generate", json=body, headers={"X-SMG-Routing-Key": "traj-1"})
            assert r.status_code == 200, r.text
            served.append(r.json()["meta_info"]["rollfleet"]["replica"])
            cached.append(r.json()["meta_info"]["cached_tokens"])
            context = context + r.json()["output_ids"] + [7]
        assert len(set(served)) == 1, served
        assert all(c > 0 for c in cached[1:]), cached
        # A second, different trajectory header is another session: its turn runs too.
        other = await http.post("/generate", json={"input_ids": [9], "sampling_params": {"max_new_tokens": 2}},
                                headers={"X-Session-Id": "traj-2"})  # fmt: skip
        assert other.status_code == 200, other.text


async def gateway_process(procs: ProcessGroup, name: str, url: str, namespace: str, *args: str) -> str:
    """A ``rollfleet gateway`` process on a free port (its default, shared client id): its address."""
    procs.spawn(name, rollfleet_command("gateway", "--nats", url, "-n", namespace, "--port", "0", *args))
    log = procs.log(name)
    await wait_until(lambda: "rollfleet gateway on" in (log.read_text() if log.exists() else ""), timeout=30,
                     what=f"{name} listening")  # fmt: skip
    line = next(x for x in log.read_text().splitlines() if "rollfleet gateway on" in x)
    assert f"loop {event_loop.resolved('gateway')})" in line, line  # (it owns its loop: the one it was asked for)
    return line.split()[3]


async def test_a_gateway_declares_a_lost_job_consumer_with_the_fleets_topology(
    nats_url: str, namespace: str, tmp_path: Path
) -> None:
    """A job consumer the gateway finds missing (deleted, or lost with the broker's store) is
    declared again with the fleet's ``--ack-wait`` (and ``--max-deliver``), not the default 30 s:
    a holder's death is then redelivered as fast as the fleet's own consumers redeliver it (with
    the default, a job whose holder died waited out its deadline)."""
    names = Names(namespace)
    consumer = names.job_consumer("min", 0)
    procs = ProcessGroup(tmp_path)
    nc = await connect(nats_url, name="topology-check")
    try:
        procs.worker(nats_url, namespace, "w")
        # (Closed before the consumer is deleted: a client keeps the subjects of live replicas'
        # versions declared, with its own topology, and could declare it again first.)
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="watch") as watch:
            await watch.wait_for_version(0, replicas=1, timeout=30)
        js = nc.jetstream()
        with contextlib.suppress(Exception):  # (whoever declared it, with whatever settings)
            await js.delete_consumer(names.jobs_stream, consumer)
        address = await gateway_process(procs, "gw", nats_url, namespace, "--ack-wait", "2.5", "--max-deliver", "7")
        body = {"input_ids": [4, 5], "sampling_params": {"max_new_tokens": 3},
                "weight_version": {"min_required_version": 0}}  # fmt: skip
        async with httpx.AsyncClient(timeout=30) as http:
            answer = await http.post(f"{address}/generate", json=body, headers={"Idempotency-Key": "topo-1"})
        assert answer.status_code == 200, answer.text
        info = await js.consumer_info(names.jobs_stream, consumer)
    finally:
        procs.close()
        await nc.close()
    assert info.config.ack_wait == 2.5 and info.config.max_deliver == 7


async def test_a_gateway_killed_mid_request_loses_nothing_a_keyed_retry_cannot_get(
    nats_url: str, namespace: str, tmp_path: Path
) -> None:
    """Two real ``rollfleet gateway`` processes behind one address book (the same client id); the
    one serving a keyed request is SIGKILLed mid-generation, and the client retries the key
    through the other, which was live all along: one run, one answer."""
    procs = ProcessGroup(tmp_path)
    body = {"input_ids": [9, 9], "sampling_params": {"max_new_tokens": 100}}
    try:
        procs.worker(nats_url, namespace, "w", "--echo-token-latency", "0.02")
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="watch") as watch:
            await watch.wait_for_version(0, replicas=1, timeout=30)  # a request now runs (no 409)

        first, second = (
            await gateway_process(procs, "gw1", nats_url, namespace),
            await gateway_process(procs, "gw2", nats_url, namespace),
        )
        async with httpx.AsyncClient(timeout=30) as http:
            running = asyncio.create_task(
                http.post(f"{first}/generate", json=body, headers={"Idempotency-Key": "kill-1"})
            )
            await asyncio.sleep(1.0)  # 100 tokens at 20 ms: mid-generation
            procs.procs["gw1"].send_signal(signal.SIGKILL)
            with pytest.raises(httpx.HTTPError):
                await running
            answer = await http.post(f"{second}/generate", json=body, headers={"Idempotency-Key": "kill-1"})
            assert answer.status_code == 200, answer.text
            assert len(answer.json()["output_ids"]) == 100
            assert answer.json()["meta_info"]["rollfleet"]["idempotency_key"] == "kill-1"
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="reader") as reader:
            stored = [o async for _, o in answers.stored(reader.js, reader.names, "gateway", "kill-1")]
    finally:
        procs.close()
    assert len(stored) == 1  # the fleet answered the key once


async def test_gateways_sharing_a_client_id_answer_each_others_keys_once(nats_url: str, namespace: str) -> None:
    """Two live gateways with one client id (behind a load balancer): a key asked of one while it
    runs, asked again of the other, is the one job; asked after its answer, the same answer; a
    trajectory whose turns alternate between them stays on one replica, turn after turn."""
    engines = [CountingEcho(per_token_s=0.01), CountingEcho(per_token_s=0.01)]
    body = {"input_ids": [2, 3], "sampling_params": {"max_new_tokens": 150}}

    def runs() -> int:
        return sum(len(e.calls) for e in engines)

    async with (
        running_worker(nats_url, namespace, worker_id="a", engine=engines[0]),
        running_worker(nats_url, namespace, worker_id="b", engine=engines[1]),
        gateway(nats_url, namespace) as one,
        gateway(nats_url, namespace) as two,
        httpx.AsyncClient(timeout=30) as http,
    ):
        first = asyncio.create_task(http.post(f"{one}/generate", json=body, headers={"Idempotency-Key": "lb-1"}))
        await wait_until(lambda: sum(e.running for e in engines) == 1, timeout=10, what="the job running")
        again = await http.post(f"{two}/generate", json=body, headers={"Idempotency-Key": "lb-1"})
        done = await first
        assert done.status_code == again.status_code == 200, (done.text, again.text)
        assert done.json() == again.json() and runs() == 1
        later = await http.post(f"{two}/generate", json=body, headers={"Idempotency-Key": "lb-1"})
        assert later.json() == done.json() and runs() == 1
        context, served = [4, 5], []
        for turn in range(6):
            gw = (one, two)[turn % 2]
            r = await http.post(f"{gw}/generate", json={"input_ids": context, "sampling_params": {"max_new_tokens": 3}},
                                headers={"X-Session-Id": "traj-lb"})  # fmt: skip
            assert r.status_code == 200, r.text
            served.append(r.json()["meta_info"]["rollfleet"]["replica"])
            assert r.json()["meta_info"]["rollfleet"]["idempotency_key"].endswith(f"/{turn}")  # its own turn
            context += r.json()["output_ids"] + [9]
        assert len(set(served)) == 1, served


async def test_a_worker_killed_under_a_gateway_request_costs_one_answer(
    nats_url: str, namespace: str, tmp_path: Path
) -> None:
    """The worker process running a keyed request through the gateway is SIGKILLed mid-generation:
    the broker redelivers the job to the other worker, the HTTP caller gets its answer from it,
    and the fleet stores one answer for the key."""
    procs = ProcessGroup(tmp_path)
    body = {"input_ids": [6, 7], "sampling_params": {"max_new_tokens": 150}}
    try:
        for name in ("w1", "w2"):
            procs.worker(nats_url, namespace, name, "--echo-token-latency", "0.02", "--ack-wait", "3")
        fast = TopologyConfig(ack_wait_s=3.0)  # a dead holder's job is redelivered after 3 s (30 s by default)
        async with (
            await RolloutClient.connect(nats_url, namespace=namespace, client_id="watch", topology=fast) as watch,
            gateway(nats_url, namespace, topology=fast) as base,
            httpx.AsyncClient(base_url=base, timeout=60) as http,
        ):
            await watch.wait_for_version(0, replicas=2, timeout=30)
            request = asyncio.create_task(http.post("/generate", json=body, headers={"Idempotency-Key": "wk-1"}))

            async def holder() -> str | None:
                await watch.fleet.refresh()
                busy = [r.worker_id for r in watch.fleet.replicas() if r.in_flight > 0]
                return busy[0] if len(busy) == 1 else None

            victim = await wait_until(holder, timeout=15, what="one worker running the request")
            procs.procs[victim].send_signal(signal.SIGKILL)
            answer = await asyncio.wait_for(request, 45)
            stored = [o async for _, o in answers.stored(watch.js, watch.names, "gw", "wk-1")]
    finally:
        procs.close()
    assert answer.status_code == 200, answer.text
    assert len(answer.json()["output_ids"]) == 150
    assert answer.json()["meta_info"]["rollfleet"]["replica"] != victim  # the survivor served it
    assert len(stored) == 1  # one answer for the key


async def test_a_frozen_gateway_costs_a_retry_and_a_broker_restart_an_outage_it_reports(
    broker: Any, nats_url: str, namespace: str, tmp_path: Path
) -> None:
    """A gateway process frozen (SIGSTOP) under a keyed request: the caller times out and retries
    through the other gateway, which answers; thawed, the frozen one answers the same. The broker
    SIGKILLed and restarted under both: /health says 503 while it is away, and the gateways serve
    again once it is back. One answer is stored for the key."""
    procs = ProcessGroup(tmp_path)
    body = {"input_ids": [8, 9], "sampling_params": {"max_new_tokens": 60}}
    try:
        procs.worker(nats_url, namespace, "w", "--echo-token-latency", "0.02")
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="watch") as watch:
            await watch.wait_for_version(0, replicas=1, timeout=30)
        one = await gateway_process(procs, "gw1", nats_url, namespace)
        two = await gateway_process(procs, "gw2", nats_url, namespace)
        key = {"Idempotency-Key": "frozen-1"}
        async with httpx.AsyncClient(timeout=30) as http:
            # (The caller gives up on a silent gateway after 2 s, as a load balancer would.)
            first = asyncio.create_task(http.post(f"{one}/generate", json=body, headers=key, timeout=2.0))
            await asyncio.sleep(0.3)
            procs.procs["gw1"].send_signal(signal.SIGSTOP)
            with pytest.raises(httpx.ReadTimeout):
                await first
            retried = await http.post(f"{two}/generate", json=body, headers=key)
            assert retried.status_code == 200 and len(retried.json()["output_ids"]) == 60, retried.text
            procs.procs["gw1"].send_signal(signal.SIGCONT)
            thawed = await http.post(f"{one}/generate", json=body, headers=key)
            assert thawed.json()["output_ids"] == retried.json()["output_ids"]
            assert (
                thawed.json()["meta_info"]["rollfleet"]["job_id"] == retried.json()["meta_info"]["rollfleet"]["job_id"]
            )
            broker.proc.send_signal(signal.SIGKILL)  # (its store kept: a crash, then a restart)
            broker.proc.wait(10)

            async def health(gw: str) -> int:
                with contextlib.suppress(httpx.HTTPError):
                    return (await http.get(f"{gw}/health")).status_code
                return 0

            await wait_until(lambda: _is(health(two), 503), timeout=15, what="/health 503 with the broker away")
            broker.start()
            await wait_until(lambda: _is(health(two), 200), timeout=30, what="/health 200 with the broker back")
            again = await http.post(f"{one}/generate", json=body | {"rid": "after-restart"}, timeout=60)
            assert again.status_code == 200, again.text
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="reader") as reader:
            stored = [o async for _, o in answers.stored(reader.js, reader.names, "gateway", "frozen-1")]
    finally:
        procs.close()
    assert len(stored) == 1


async def _is(status: Any, want: int) -> bool:
    return await status == want
