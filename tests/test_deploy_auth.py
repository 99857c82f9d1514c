"""Security configs of broker_config/: trainer/worker permissions, token auth, mutual TLS.

Each test runs the embedded broker (rollfleet.broker.EmbeddedBroker) with the config file
as written; secrets come from the environment, as the configs document.
"""

from __future__ import annotations

import asyncio
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import nats.errors
import pytest

from harness import make_dev_certs, start_worker_process, terminate, wait_until
from rollfleet.broker import (
    EmbeddedBroker,
    TopologyConfig,
    bind_job_consumer,
    ensure_job_consumer,
    ensure_topology,
    free_port,
)
from rollfleet.broker.connection import connect
from rollfleet.schemas import Names
from tests.deploy_helpers import BROKER_CONFIG, DEV_CERTS_SCRIPT, ECHO_V0, TEST_SECRETS, run_cli

pytestmark = pytest.mark.timeout(120)

# The namespace the permissions example is written for (JetStream names cannot be wildcarded).
NS = "run1"
TRAINER = ("trainer", TEST_SECRETS["ROLLFLEET_PASSWORD_TRAINER"])
WORKER = ("w1", TEST_SECRETS["ROLLFLEET_PASSWORD_W1"])
OTHER_WORKER = ("w2", TEST_SECRETS["ROLLFLEET_PASSWORD_W2"])
REFUSED_WAIT = 1.0  # a refused publish is dropped by the server: its ack simply never comes


def run_broker(tmp_path: Path, config: Path) -> EmbeddedBroker:
    # The configs document monitoring on 8222; a free port keeps parallel runs apart.
    return EmbeddedBroker(
        store_dir=tmp_path / "store",
        config=config,
        log_file=tmp_path / "nats.log",
        extra_args=["-m", str(free_port())],
    ).start()


@pytest.fixture
def secrets_env(monkeypatch: pytest.MonkeyPatch) -> None:
    for name, value in TEST_SECRETS.items():
        monkeypatch.setenv(name, value)


@pytest.fixture
def perm_broker(tmp_path: Path, secrets_env: None) -> Iterator[EmbeddedBroker]:
    broker = run_broker(tmp_path, BROKER_CONFIG / "auth" / "permissions.conf")
    try:
        yield broker
    finally:
        broker.stop()


def with_user(url: str, user: tuple[str, str]) -> str:
    return url.replace("nats://", f"nats://{user[0]}:{user[1]}@")


async def refused_connect(url: str, **options: Any) -> None:
    # nats-py raises several types here: authorization errors, NoServersError, a reset TLS handshake.
    with pytest.raises(Exception):  # noqa: B017
        nc = await nats.connect(url, allow_reconnect=False, max_reconnect_attempts=0, connect_timeout=2, **options)
        await nc.close()


async def test_worker_is_refused_versions_and_jobs(perm_broker: EmbeddedBroker) -> None:
    names = Names(NS)
    violations: list[str] = []

    async def on_error(exc: Exception) -> None:
        violations.append(str(exc))

    trainer = await nats.connect(with_user(perm_broker.url, TRAINER), inbox_prefix=names.inbox_prefix("trainer"))
    worker = await nats.connect(
        with_user(perm_broker.url, WORKER), error_cb=on_error, inbox_prefix=names.inbox_prefix("worker", "w1")
    )
    try:
        # The trainer declares the namespace, submits a job and commits version 0.
        tjs = trainer.jetstream(timeout=5)
        await ensure_topology(tjs, names)
        await tjs.publish(names.job_subject("min", 0), b"job", headers={"Nats-Msg-Id": "k1"})
        policy = await tjs.key_value(names.policy_bucket)
        await policy.put(names.version_key(0), b"v0")
        await policy.put(names.LATEST_KEY, b"0")

        await ensure_job_consumer(tjs, names, "min", 0)  # the trainer creates the shared consumers

        # What a worker needs works: bind, pull, store a result, ack, register, read versions.
        wjs = worker.jetstream(timeout=5)
        assert await ensure_topology(wjs, names) == []  # already declared: read-only checks
        consumer = await bind_job_consumer(wjs, names, "min", 0)
        assert consumer is not None
        sub = await wjs.pull_subscribe_bind(consumer, stream=names.jobs_stream)
        [job] = await sub.fetch(1, timeout=5)
        result_subject = names.result_subject("trainer-0", "k1", "job1", "w1")  # under its own id
        await wjs.publish(result_subject, b"result", headers={"Nats-Msg-Id": "h:job1"})
        await job.ack_sync()
        assert (await wjs.get_last_msg(names.results_stream, result_subject, direct=True)).data == b"result"
        fleet = await wjs.key_value(names.fleet_bucket)
        await fleet.put(names.replica_key("w1"), b"{}")  # its own registry entry
        claims = await wjs.key_value(names.claims_bucket)
        await claims.create("job-1", b"w1")  # a claim
        with pytest.raises(nats.js.errors.KeyWrongLastSequenceError):  # (nats-py reads the key back)
            await claims.create("job-1", b"w1 again")
        assert (await claims.get("job-1")).value == b"w1"
        worker_policy = await wjs.key_value(names.policy_bucket)
        assert (await worker_policy.get(names.LATEST_KEY)).value == b"0"
        await worker.publish(names.versions_activated, b"{}")

        # What it must not do is refused by the server.
        refused = worker.jetstream(timeout=REFUSED_WAIT)
        with pytest.raises(nats.errors.TimeoutError):
            await (await refused.key_value(names.policy_bucket)).put(names.version_key(1), b"evil weights")
        with pytest.raises(nats.errors.TimeoutError):
            await (await refused.key_value(names.policy_bucket)).put(names.LATEST_KEY, b"1")
        with pytest.raises(nats.errors.TimeoutError):
            await refused.publish(names.job_subject("exact", 1), b"injected job")
        await worker.publish(names.versions_published, b"fake announcement")
        with pytest.raises(nats.errors.TimeoutError):
            await refused.delete_stream(names.jobs_stream)
        # Another replica's registry entry: neither overwritten nor deleted.
        with pytest.raises(nats.errors.TimeoutError):
            await (await refused.key_value(names.fleet_bucket)).put(names.replica_key("w2"), b"{}")
        with pytest.raises(nats.errors.TimeoutError):
            await (await refused.key_value(names.fleet_bucket)).delete(names.replica_key("w2"))
        # The shared job consumer: not re-created with other settings (max_deliver 1, ack_wait 0.5 s).
        with pytest.raises(nats.errors.TimeoutError):
            await refused.add_consumer(
                names.jobs_stream, TopologyConfig(max_deliver=1, ack_wait_s=0.5).job_consumer_config(names, "min", 0)
            )
        # Another namespace's results: no forging; nor an answer under another replica's id.
        with pytest.raises(nats.errors.TimeoutError):
            await refused.publish(Names("run2").result_subject("trainer-0", "k", "job", "w1"), b"forged")
        with pytest.raises(nats.errors.TimeoutError):
            await refused.publish(names.result_subject("trainer-0", "k", "job", "w2"), b"forged as w2")
        # Another replica's own subject (its sessions' turns): not pulled.
        with pytest.raises(nats.errors.TimeoutError):
            await worker.request(
                f"$JS.API.CONSUMER.MSG.NEXT.{names.jobs_stream}.{names.replica_consumer('w2')}", b"1", timeout=1
            )
        # Replies of other roles and of other replicas (their job deliveries, with job ids and ack
        # subjects), of any namespace: not readable.
        await worker.subscribe("_INBOX.>")
        await worker.subscribe(Names("run2").inbox_prefix("worker") + ".>")
        await worker.subscribe(names.inbox_prefix("trainer") + ".>")
        await worker.subscribe(names.inbox_prefix("worker") + ".>")
        await worker.subscribe(names.inbox_prefix("worker", "w2") + ".>")
        await worker.flush()

        async def all_reported() -> bool:
            text = "\n".join(violations).lower()  # nats-py lower-cases the server's -ERR
            for subject in (
                f"$KV.{names.policy_bucket}.{names.version_key(1)}",
                f"$KV.{names.policy_bucket}.{names.LATEST_KEY}",
                names.job_subject("exact", 1),
                names.versions_published,
                f"$JS.API.STREAM.DELETE.{names.jobs_stream}",
                f"$KV.{names.fleet_bucket}.{names.replica_key('w2')}",
                f"$JS.API.CONSUMER.CREATE.{names.jobs_stream}.min-0.rf.run1.jobs.min.0",
                Names("run2").result_subject("trainer-0", "k", "job", "w1"),
                names.result_subject("trainer-0", "k", "job", "w2"),
                f"$JS.API.CONSUMER.MSG.NEXT.{names.jobs_stream}.{names.replica_consumer('w2')}",
            ):
                assert f'permissions violation for publish to "{subject.lower()}"' in text, (subject, violations)
            for subject in (
                "_INBOX.>",
                "_INBOX.run2.worker.>",
                "_INBOX.run1.trainer.>",
                "_INBOX.run1.worker.>",
                "_INBOX.run1.worker.w2.>",
            ):
                assert f'permissions violation for subscription to "{subject.lower()}"' in text, (subject, violations)
            return True

        await wait_until(
            all_reported, 5, what="permission violations reported to the worker", interval=0.2, retry_errors=True
        )
        assert not [v for v in violations if "claims" in v.lower()], violations  # claiming is the worker's own

        # Nothing the worker attempted was stored: the trainer's view is unchanged.
        assert (await policy.get(names.LATEST_KEY)).value == b"0"
        info = await tjs.consumer_info(names.jobs_stream, "min-0")
        assert info.config.max_deliver == TopologyConfig().max_deliver and info.config.ack_wait == 30.0
        with pytest.raises(nats.js.errors.KeyNotFoundError):
            await policy.get(names.version_key(1))
        assert (await tjs.stream_info(names.jobs_stream)).state.messages == 0
        assert (await tjs.stream_info(names.events_stream)).state.messages == 1  # the activation only

        # The trainer, in turn, may not forge results.
        trainer_violations: list[str] = []

        async def on_trainer_error(exc: Exception) -> None:
            trainer_violations.append(str(exc))

        forger = await nats.connect(with_user(perm_broker.url, TRAINER), error_cb=on_trainer_error)
        try:
            await forger.publish(names.result_subject("trainer-0", "forged", "job", "w1"), b"forged")
            await forger.flush()
            await wait_until(
                lambda: _contains(trainer_violations, "permissions violation"),
                5,
                what="trainer refused",
                interval=0.2,
                retry_errors=True,
            )
        finally:
            await forger.close()
    finally:
        await worker.close()
        await trainer.close()


def _contains(items: list[str], needle: str) -> bool:
    return any(needle in item.lower() for item in items)


async def test_permissions_refuse_anonymous_and_wrong_password(perm_broker: EmbeddedBroker) -> None:
    await refused_connect(perm_broker.url)
    await refused_connect(with_user(perm_broker.url, ("worker", "wrong")))


async def test_permissions_rollfleet_round_trip(perm_broker: EmbeddedBroker, tmp_path: Path) -> None:
    """The documented flow: declare as `trainer`, run the real worker as `worker`, submit as `trainer`."""
    from rollfleet.schemas import RolloutPayload, SamplingParams
    from rollfleet.trainer_client import RolloutClient

    trainer_url, worker_url = with_user(perm_broker.url, TRAINER), with_user(perm_broker.url, WORKER)
    declared = await asyncio.to_thread(run_cli, "declare", "--nats", trainer_url, "--namespace", NS)
    assert declared.returncode == 0, declared.stderr + declared.stdout

    worker = start_worker_process(worker_url, NS, "w1", *ECHO_V0, log_path=tmp_path / "worker.log")
    try:
        async with await RolloutClient.connect(trainer_url, namespace=NS, client_id="trainer-0") as client:
            payload = RolloutPayload(prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=4))

            async def round_trip() -> Any:
                return await asyncio.wait_for(await client.submit(payload, min_version=0), 10)

            result = await wait_until(
                round_trip, 25, what="a round trip with the permissions config", interval=0.5, retry_errors=True
            )
            assert result.version_start == 0 and result.outputs
            # A resumable job: the worker checkpoints on its progress subject (and rolls it up),
            # the trainer streams it through an ordered consumer, both within their permissions.
            long = RolloutPayload(prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=40))
            handle = await client.submit(long, min_version=0, retry_policy="resume")
            chunks = [c async for c in client.stream(handle)]
            streamed = [t for c in chunks for t in c.token_ids]
            assert streamed == (await handle.result(10)).outputs[0].token_ids and len(streamed) == 40
    except BaseException:
        print((tmp_path / "worker.log").read_text(errors="replace")[-4000:])
        raise
    finally:
        code = terminate(worker, 15)
    assert code == 0
    # The server logs "Publish Violation" / "Subscription Violation" for anything refused.
    log = (tmp_path / "nats.log").read_text(errors="replace")
    assert "violation" not in log.lower(), "the real worker or client needs a subject the config does not allow"


@pytest.fixture
def token_broker(tmp_path: Path, secrets_env: None) -> Iterator[EmbeddedBroker]:
    broker = run_broker(tmp_path, BROKER_CONFIG / "auth" / "token.conf")
    try:
        yield broker
    finally:
        broker.stop()


async def test_a_worker_started_while_its_namespace_is_lost_waits_for_the_trainer(
    perm_broker: EmbeddedBroker, tmp_path: Path
) -> None:
    """A broker back on a store that lost the jobs stream: a worker (re)started before a trainer
    declared it again waits for it, then serves. It used to try to declare it itself, which its
    permissions refuse (a violation in the broker's log), and exit (campaign seed 3)."""
    from rollfleet.broker.topology import _bucket_configs, _stream_configs

    trainer_url, worker_url = with_user(perm_broker.url, TRAINER), with_user(perm_broker.url, WORKER)
    names, cfg = Names(NS), TopologyConfig()
    tnc = await nats.connect(trainer_url, inbox_prefix=names.inbox_prefix("trainer"))
    try:  # the namespace but its jobs stream (what a store loss leaves; a trainer may not delete)
        tjs = tnc.jetstream()
        for scfg in _stream_configs(names, cfg):
            if scfg.name != names.jobs_stream:
                await tjs.add_stream(scfg)
        for kcfg in _bucket_configs(names, cfg):
            await tjs.create_key_value(kcfg)
    finally:
        await tnc.close()
    worker = start_worker_process(worker_url, NS, "w1", *ECHO_V0, log_path=tmp_path / "worker.log")
    try:
        await asyncio.sleep(2.0)
        assert worker.poll() is None, (tmp_path / "worker.log").read_text(errors="replace")[-2000:]
        from rollfleet.schemas import RolloutPayload, SamplingParams
        from rollfleet.trainer_client import RolloutClient

        # A trainer's client declares what is missing, and the worker goes on.
        async with await RolloutClient.connect(trainer_url, namespace=NS, client_id="trainer-0") as client:
            payload = RolloutPayload(prompt_token_ids=[1, 2, 3], sampling=SamplingParams(max_tokens=4))

            async def round_trip() -> Any:
                return await asyncio.wait_for(await client.submit(payload, min_version=0), 10)

            result = await wait_until(round_trip, 30, what="a round trip", interval=0.5, retry_errors=True)
            assert result.version_start == 0 and result.outputs
    finally:
        code = terminate(worker, 15)
    assert code == 0
    log = (tmp_path / "nats.log").read_text(errors="replace")
    assert "violation" not in log.lower(), [line for line in log.splitlines() if "iolation" in line]


async def test_token_auth(token_broker: EmbeddedBroker) -> None:
    token = TEST_SECRETS["ROLLFLEET_TOKEN"]
    await refused_connect(token_broker.url)
    await refused_connect(token_broker.url, token="not-the-token")
    for nc in (
        await connect(token_broker.url, name="t-option", token=token),
        await connect(token_broker.url.replace("nats://", f"nats://{token}@"), name="t-url"),
    ):
        try:
            names = Names("t" + uuid.uuid4().hex[:6])
            await ensure_topology(nc.jetstream(timeout=5), names)
            ack = await nc.jetstream().publish(names.job_subject("min", 0), b"job")
            assert ack.stream == names.jobs_stream
        finally:
            await nc.close()


async def test_token_rollfleet_round_trip(token_broker: EmbeddedBroker, tmp_path: Path) -> None:
    from rollfleet.schemas import RolloutPayload, SamplingParams
    from rollfleet.trainer_client import RolloutClient

    token = TEST_SECRETS["ROLLFLEET_TOKEN"]
    ns = "t" + uuid.uuid4().hex[:6]
    worker = start_worker_process(
        token_broker.url, ns, "w-deploy", *ECHO_V0, "--token", token, log_path=tmp_path / "worker.log"
    )
    try:
        async with await RolloutClient.connect(token_broker.url, namespace=ns, client_id="c0", token=token) as client:
            payload = RolloutPayload(prompt_token_ids=[5, 6], sampling=SamplingParams(max_tokens=3))

            async def round_trip() -> Any:
                return await asyncio.wait_for(await client.submit(payload, min_version=0), 10)

            result = await wait_until(
                round_trip, 25, what="a round trip with token auth", interval=0.5, retry_errors=True
            )
            assert result.outputs
    except BaseException:
        print((tmp_path / "worker.log").read_text(errors="replace")[-4000:])
        raise
    finally:
        code = terminate(worker, 15)
    assert code == 0


@pytest.fixture
def tls_broker(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[EmbeddedBroker, dict[str, str]]]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make test certificates")
    env = make_dev_certs(DEV_CERTS_SCRIPT, tmp_path / "tls")
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    broker = run_broker(tmp_path, BROKER_CONFIG / "tls" / "nats-server-tls.conf")
    try:
        yield broker, env
    finally:
        broker.stop()


async def test_mutual_tls(tls_broker: tuple[EmbeddedBroker, dict[str, str]]) -> None:
    broker, env = tls_broker
    tls_dir = Path(env["ROLLFLEET_TLS_CA"]).parent
    client_cert = {
        "tls_ca": env["ROLLFLEET_TLS_CA"],
        "tls_cert": str(tls_dir / "client-cert.pem"),
        "tls_key": str(tls_dir / "client-key.pem"),
    }
    url = broker.url.replace("nats://", "tls://")
    nc = await connect(url, name="tls-client", **client_cert)
    try:
        names = Names("t" + uuid.uuid4().hex[:6])
        await ensure_topology(nc.jetstream(timeout=5), names)
        assert (await nc.jetstream().publish(names.job_subject("min", 0), b"job")).stream == names.jobs_stream
    finally:
        await nc.close()

    # Without a client certificate, or without TLS at all, the server refuses the connection.
    import ssl

    no_cert = ssl.create_default_context(cafile=env["ROLLFLEET_TLS_CA"])
    await refused_connect(url, tls=no_cert)
    await refused_connect(broker.url)


async def test_mutual_tls_rollfleet_round_trip(tls_broker: tuple[EmbeddedBroker, dict[str, str]]) -> None:
    """Worker and client both connect with the CA and a client certificate; a job goes round."""
    from rollfleet.schemas import RolloutPayload, SamplingParams
    from rollfleet.trainer_client import RolloutClient
    from rollfleet.workers.engines import make_engine
    from rollfleet.workers.worker import Worker, WorkerConfig

    broker, env = tls_broker
    tls_dir = Path(env["ROLLFLEET_TLS_CA"]).parent
    tls = {
        "tls_ca": env["ROLLFLEET_TLS_CA"],
        "tls_cert": str(tls_dir / "client-cert.pem"),
        "tls_key": str(tls_dir / "client-key.pem"),
    }
    url = broker.url.replace("nats://", "tls://")
    ns = "t" + uuid.uuid4().hex[:6]
    # In-process worker: the CLI has --tls-ca but (yet) no client-certificate flags.
    worker = Worker(
        WorkerConfig(nats_url=url, namespace=ns, heartbeat_s=0.5, connect_options=dict(tls)), make_engine("echo")
    )
    await worker.start()
    try:
        async with await RolloutClient.connect(url, namespace=ns, client_id="c0", **tls) as client:
            payload = RolloutPayload(prompt_token_ids=[7, 8], sampling=SamplingParams(max_tokens=2))

            async def round_trip() -> Any:
                return await asyncio.wait_for(await client.submit(payload, min_version=0), 10)

            result = await wait_until(
                round_trip, 20, what="a round trip over mutual TLS", interval=0.5, retry_errors=True
            )
            assert result.worker_id == worker.config.worker_id and result.outputs
    finally:
        await worker.stop()


def test_the_example_config_is_what_rollfleet_permissions_generates(tmp_path: Path) -> None:
    """The checked-in example cannot drift from the subjects the code uses."""
    out = run_cli("permissions", "run1=w1,w2")
    assert out.returncode == 0, out.stderr
    assert out.stdout == (BROKER_CONFIG / "auth" / "permissions.conf").read_text()
    # Two namespaces: each has its own trainer and workers, each with its own password variable.
    two = run_cli("permissions", "run1=w1", "run2=x1,x2")
    conf = tmp_path / "two.conf"
    conf.write_text(two.stdout)
    env = {"ROLLFLEET_PASSWORD_" + u: "s" for u in ("TRAINER_RUN1", "TRAINER_RUN2", "W1", "X1", "X2", "SYS")}
    import os
    import subprocess

    from rollfleet.broker import check_server_binary

    checked = subprocess.run(
        [str(check_server_binary()), "-c", str(conf), "-t"], capture_output=True, text=True, env={**os.environ, **env}
    )
    assert checked.returncode == 0, checked.stderr
    assert "RF_RUN2_JOBS" in two.stdout and "user: trainer-run2" in two.stdout and "user: x2" in two.stdout
    bad = run_cli("permissions", "run1")
    assert bad.returncode == 2 and "NAMESPACE=WORKER" in bad.stderr
