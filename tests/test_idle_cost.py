"""What an idle fleet costs the broker (its own counters): no JetStream API request, and no
message but the registry refreshes; and how a commit still reaches every replica."""

from __future__ import annotations

import asyncio

import pytest

from harness import broker_counters, running_worker, temp_broker, wait_until
from rollfleet.broker.kv import advance_latest
from rollfleet.schemas import VersionRecord
from rollfleet.trainer_client import RolloutClient
from tests.helpers import payload


@pytest.fixture
def monitored() -> object:
    with temp_broker("rf-idle-", monitor=True) as broker:
        yield broker


async def test_an_idle_fleet_and_trainer_cost_the_broker_nothing(monitored: object) -> None:
    broker = monitored
    url = broker.url  # type: ignore[attr-defined]
    counters = broker_counters(broker)  # type: ignore[arg-type]
    async with (
        running_worker(url, "idle", worker_id="a", heartbeat_s=20.0, follow_versions=True),
        running_worker(url, "idle", worker_id="b", heartbeat_s=20.0, follow_versions=True),
        await RolloutClient.connect(url, namespace="idle", client_id="c") as client,
    ):
        await wait_until(lambda: len(client.fleet.replicas()) == 2)
        await (await client.submit(payload(), min_version=0)).result(10)  # the request path is warm
        await asyncio.sleep(2.0)  # slots the job moved go back after rebalance_s (1 s) of quiet
        before = counters.snapshot()
        await asyncio.sleep(4.0)  # shorter than the first refresh (10 s or more after the start)
        spent = counters.snapshot() - before
    assert spent.api == 0, f"{spent.api} JetStream API requests while idle"
    assert spent.in_msgs == 0, f"{spent.in_msgs} messages into the broker while idle"


async def test_a_commit_reaches_every_replica_through_its_announcement(nats_url: str, namespace: str) -> None:
    async with (
        running_worker(nats_url, namespace, worker_id="a", follow_versions=True) as a,
        running_worker(nats_url, namespace, worker_id="b", follow_versions=True) as b,
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client,
    ):
        await wait_until(lambda: len(client.fleet.replicas()) == 2)
        await client.commit_version(VersionRecord(version=1, kind="delta", base_version=0))
        # (Within 10 s: the resync, the only other way a replica learns of it, is 120 s away.)
        await client.wait_for_version(1, replicas=2, timeout=10)
        await wait_until(lambda: a.version == b.version == 1, 10, what="both replicas at version 1")
        result = await (await client.submit(payload(), exact_version=1)).result(10)
        assert result.version_start == 1


async def test_a_missed_announcement_is_caught_by_the_resync(nats_url: str, namespace: str) -> None:
    """A publisher killed between the commit and the announcement: replicas still follow, at
    the latest one resync period later."""
    async with (
        running_worker(nats_url, namespace, worker_id="a", follow_versions=True, resync_s=1.0) as a,
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client,
    ):
        await wait_until(lambda: len(client.fleet.replicas()) == 1)
        kv = await client.js.key_value(client.names.policy_bucket)
        await advance_latest(
            kv, client.names, VersionRecord(version=1, kind="delta", base_version=0)
        )  # no announcement
        await wait_until(lambda: a.version == 1, timeout=1.2 * 1.0 + 2.0, what="the resync to find version 1")
