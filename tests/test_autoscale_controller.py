"""``rollfleet autoscale``: the lease (one controller acting), the fleet it sees, and the local
driver scaling real worker processes up and down under real jobs, read back as KEDA reads it."""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import structlog

from harness import temp_broker, wait_until
from rollfleet.autoscale.controller import Controller, ControllerConfig, fleet_of
from rollfleet.autoscale.drivers.base import Run
from rollfleet.autoscale.drivers.local import LocalDriver, _worker_of
from rollfleet.autoscale.lease import BrokerLease, Seen, contend, may_act, renew_due
from rollfleet.autoscale.planner import Policy
from rollfleet.autoscale.signal import LAUNCHING, ReplicaFacts
from rollfleet.broker import EmbeddedBroker
from rollfleet.broker.connection import connect
from rollfleet.broker.topology import ensure_topology
from rollfleet.runtime.logs import configure as configure_logs
from rollfleet.schemas import Names, VersionRecord
from rollfleet.schemas.errors import NoCompatibleReplica
from rollfleet.trainer_client import RolloutClient
from tests.helpers import payload


@pytest.fixture(scope="module")
def shared_broker() -> Iterator[EmbeddedBroker]:
    with temp_broker("rf-autoscale-ctl-") as broker:
        yield broker


# -- the lease's rules, as sequences ---------------------------------------------------------


def test_a_contender_takes_the_lease_only_after_a_whole_ttl_of_the_same_revision_on_its_own_clock():
    seen, move = contend(Seen(), None, 0.0, 10)
    assert move == "create"
    seen, move = contend(Seen(), 7, 100.0, 10)  # (a holder's revision: the clock starts now)
    assert move == "wait"
    for now, revision, expected in [(105, 7, "wait"), (109.9, 7, "wait"), (110, 8, "wait"), (119, 8, "wait")]:
        seen, move = contend(seen, revision, now, 10)
        assert move == expected, (now, revision)
    assert contend(seen, 8, 120.0, 10)[1] == "take"


def test_a_holder_stops_acting_before_any_contender_could_take_over():
    ttl = 10.0
    assert not renew_due(0.0, 3.0, ttl) and renew_due(0.0, ttl / 3, ttl)
    # The holder renewed at 0; a contender reads that revision no sooner than 0 and takes it no
    # sooner than ttl later; the holder stopped acting at ttl/2.
    assert may_act(0.0, 4.99, ttl) and not may_act(0.0, 5.0, ttl)


async def test_a_second_controller_waits_for_the_lease_and_takes_it_when_the_first_goes_silent(
    shared_broker: EmbeddedBroker,
) -> None:
    names = Names("l" + uuid.uuid4().hex[:8])
    nc = await connect(shared_broker.url, name="lease-test")
    try:
        await ensure_topology(nc.jetstream(), names)
        kv = await nc.jetstream().key_value(names.fleet_bucket)
        first, second = BrokerLease(kv, "first", ttl_s=0.6), BrokerLease(kv, "second", ttl_s=0.6)
        assert await first.step() and not await second.step()
        t0 = time.monotonic()
        for _ in range(3):  # the first renews: the second keeps waiting
            await asyncio.sleep(0.25)
            assert await first.step() and not await second.step()
        assert time.monotonic() - t0 >= 0.6  # (longer than the ttl in all)
        silent_at = time.monotonic()  # the first stops renewing (paused, cut off)
        await wait_until(second.step, 10, interval=0.1, what="the second controller takes the lease")
        assert time.monotonic() - silent_at >= 0.5  # not before a whole ttl of silence (less a step)
        assert not first.holding  # (it stopped acting after half a ttl without a renewal)
        assert not await first.step()  # its renewal is refused: the lease is the second's
        assert await second.holder_now() == "second"
        await second.release()
        assert await first.step()  # a released lease is taken at the next look
    finally:
        await nc.close()


# -- the fleet the planner sees --------------------------------------------------------------


def test_the_fleet_is_the_registry_and_the_drivers_own_replicas():
    registry = [
        ReplicaFacts("auto-a", in_flight=1),
        ReplicaFacts("auto-gone"),  # its process exited; its entry lingers for a few heartbeats
        ReplicaFacts("operator-1", held=3),
        ReplicaFacts("auto-b"),
    ]
    runs = [
        Run("auto-a", None, 1.0),
        Run("auto-b", None, 2.0, retiring=True),
        Run("auto-new", 4, 3.0),  # started, not registered yet
    ]
    fleet = {r.worker_id: r for r in fleet_of(registry, runs, lambda w, host: w.startswith("auto-"))}
    assert set(fleet) == {"auto-a", "operator-1", "auto-b", "auto-new"}
    assert fleet["auto-a"].managed and fleet["auto-a"].state == "ready" and fleet["auto-a"].in_flight == 1
    assert not fleet["operator-1"].managed
    assert fleet["auto-b"].state == "draining"
    assert (fleet["auto-new"].state, fleet["auto-new"].held, fleet["auto-new"].managed) == (LAUNCHING, 4, True)


def test_a_container_is_matched_to_its_registry_entry_by_host():
    """A Compose worker calls itself ``<hostname>-<pid>``: the driver knows only the hostname."""
    registry = [
        ReplicaFacts("0123456789ab-7", host="0123456789ab"),
        ReplicaFacts("ba9876543210-7", host="ba9876543210"),
    ]
    runs = [Run("0123456789ab", None, 1.0, host="0123456789ab"), Run("cafecafecafe", 2, 2.0, host="cafecafecafe")]
    seen = {"0123456789ab", "ba9876543210", "cafecafecafe"}  # (the second's container is gone)
    fleet = {r.worker_id: r for r in fleet_of(registry, runs, lambda w, host: host in seen)}
    assert set(fleet) == {"0123456789ab-7", "cafecafecafe"}
    assert fleet["0123456789ab-7"].managed and fleet["0123456789ab-7"].state == "ready"
    assert (fleet["cafecafecafe"].state, fleet["cafecafecafe"].held) == (LAUNCHING, 2)


def test_a_restarted_controller_knows_its_workers_by_their_command_lines():
    driver = LocalDriver(url="nats://x:1", namespace="ns", prefix="auto")
    follower = driver.command("auto-1a2b3c", None)
    held = driver.command("auto-v3-1a2b3c", 3)
    assert _worker_of(follower, "ns", "auto") == ("auto-1a2b3c", None)
    assert _worker_of(held, "ns", "auto") == ("auto-v3-1a2b3c", 3)
    assert _worker_of(held, "other", "auto") is None
    assert _worker_of(LocalDriver(url="u", namespace="ns", prefix="x").command("x-1", None), "ns", "auto") is None
    stored = LocalDriver(url="u", namespace="ns", store=Path("/s"), prefix="auto").command("auto-v2-ff", 2)
    assert "--hold-version" in stored and _worker_of(stored, "ns", "auto") == ("auto-v2-ff", 2)


async def test_a_restarted_controller_adopts_only_the_workers_of_its_own_broker() -> None:
    """Two fleets on one host (two ``up --autoscale``, or a test beside a campaign) share a namespace
    name and the id prefix: a controller that restarts must not take the other fleet's workers for
    its own (it would count them, and retire them)."""
    import subprocess
    import sys

    ns = f"adopt-{uuid.uuid4().hex[:8]}"
    mine, theirs = "nats://127.0.0.1:4301", "nats://127.0.0.1:4302"
    sleeper = [sys.executable, "-c", "import time; time.sleep(60)"]
    procs = [
        subprocess.Popen([*sleeper, *LocalDriver(url=url, namespace=ns).command(wid, None)[2:]])
        for url, wid in ((mine, "auto-00aa11"), (theirs, "auto-22bb33"))
    ]
    try:
        await wait_until(
            lambda: all(_worker_of(_cmdline(p.pid), ns, "auto") is not None for p in procs), 10.0, what="both started"
        )
        driver = LocalDriver(url=mine, namespace=ns)
        assert [r.worker_id for r in await driver.runs()] == ["auto-00aa11"]
    finally:
        for p in procs:
            p.kill()
            p.wait()


def _cmdline(pid: int) -> list[str]:
    try:
        return [a for a in Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0") if a]
    except OSError:
        return []


# -- the local driver under real jobs --------------------------------------------------------


def _keda_value(doc: Any, value_location: str) -> float:
    """KEDA's metrics-api scaler: the number at ``valueLocation`` (a GJSON path; its dotted form)."""
    for part in value_location.split("."):
        doc = doc[part]
    return float(doc)


async def test_the_local_driver_scales_workers_up_under_load_and_back_down_when_it_ends(
    shared_broker: EmbeddedBroker, tmp_path: Path
) -> None:
    """Four one-slot jobs of a second each, bounds 1..3: the controller starts two more worker
    processes, every job is answered once, and once the queue is empty two drain and exit (code
    0); KEDA reads the desired size at ``classes.latest.desired`` meanwhile."""
    url, ns = shared_broker.url, "s" + uuid.uuid4().hex[:8]
    names = Names(ns)
    driver = LocalDriver(
        url=url, namespace=ns, home=tmp_path, prefix="t",
        worker_args=["--capacity", "1", "--echo-latency", "1.0", "--heartbeat", "1"],
    )  # fmt: skip
    policy = Policy(min_replicas=1, max_replicas=3, slots_per_replica=1, cooldown_s=0, scale_in_grace_s=1.0,
                    hysteresis=0.0, target_wait_s=60.0)  # fmt: skip
    controller = Controller(ControllerConfig(url=url, namespace=ns, policy=policy, interval_s=0.3, http_port=0), driver)
    stop = asyncio.Event()
    popens: dict[str, Any] = {}
    configure_logs("info")  # (the decisions are info lines; the suite runs at warning)
    async with await RolloutClient.connect(url, namespace=ns, client_id="c") as client:
        with structlog.testing.capture_logs() as logs:
            task = asyncio.create_task(controller.run(stop))
            try:
                await wait_until(lambda: len(client.fleet.replicas()) == 1, 30, what="the minimum, one worker")
                handles = [
                    await client.submit(payload(), min_version=0, idempotency_key=f"k{i}", timeout=60) for i in range(4)
                ]
                await wait_until(lambda: len(driver.pids()) == 3, 20, what="two more workers launched")
                popens = {w: p.popen for w, p in driver._procs.items()}
                pids = driver.pids()
                for pid in pids.values():
                    os.kill(pid, 0)  # (raises if there is no such process)
                async with httpx.AsyncClient() as http:
                    keda = (await http.get(f"http://127.0.0.1:{controller.http_port}/keda")).json()
                    metrics = (await http.get(f"http://127.0.0.1:{controller.http_port}/metrics")).text
                assert _keda_value(keda, "classes.latest.desired") == 3
                assert 'rollfleet_autoscale_desired_replicas{klass="latest"} 3.0' in metrics
                results = await asyncio.gather(*(h.result(60) for h in handles))
                served_by = {r.worker_id for r in results}
                # Once the queue is empty (and the grace is spent), two drain and exit.
                await wait_until(
                    lambda: sum(p.poll() is not None for p in popens.values()) == 2, 30, what="two workers exited"
                )
                assert sorted(p.returncode for p in popens.values() if p.poll() is not None) == [0, 0]
                assert len(driver.pids()) == 1
            finally:
                stop.set()
                await asyncio.wait_for(task, 60)
                configure_logs()
        # Raw facts: one answer stored per key on the results stream, and no worker process left.
        js = client.js
        info = await js.stream_info(names.results_stream, subjects_filter=names.results_wildcard)
        heads = [s for s in (info.state.subjects or {}) if names.parse_result_subject(s) is not None]
        assert len(heads) == 4 and len({names.parse_result_subject(s)[1] for s in heads}) == 4
        assert all(p.poll() is not None for p in popens.values())
    assert len(served_by) >= 2  # (the jobs did spread over the new workers)
    decisions = [e for e in logs if e["event"] == "autoscale decision"]
    ups = [d for d in decisions if d["action"] == "up"]
    downs = [d for d in decisions if d["action"] == "down"]
    retired = [d for d in decisions if d["action"] == "retire"]
    assert [(u["before"], u["after"]) for u in ups] == [(0, 1), (1, 3)]
    assert "minimum" in ups[0]["reason"] and "jobs" in ups[1]["reason"] and ups[1]["backlog"] + ups[1]["running"] >= 3
    assert downs and downs[-1]["after"] == 1 and len(retired) == 2
    assert all(d["reason"] for d in decisions)


def test_keda_reads_each_class_desired_size_from_the_status_document():
    """The document /keda serves, read at the paths a ScaledObject names: one per Deployment."""
    from rollfleet.autoscale.controller import status_document
    from rollfleet.autoscale.planner import PlannerState, plan
    from rollfleet.autoscale.signal import ClassDemand, Signal

    policy = Policy(min_replicas=1, max_replicas=6, hold_after_s=0)
    signal = Signal(9, {"latest": ClassDemand(backlog=9, in_flight=3), 3: ClassDemand(sessions=1)})
    fleet = [ReplicaFacts("a", active_version=9, capacity=4)]
    doc = status_document(plan(signal, fleet, policy, PlannerState(), 0.0), signal, policy, "me", 0.0, [])
    doc = json.loads(json.dumps(doc))  # (as it travels)
    assert _keda_value(doc, "classes.latest.desired") == 3  # 12 jobs over 4-slot replicas
    assert _keda_value(doc, "classes.3.desired") == 1
    assert _keda_value(doc, "classes.latest.actual") == 1


def test_the_status_says_the_start_up_time_and_when_a_starting_class_should_serve():
    """What ``rollfleet status`` shows and a gateway's 409 reads: the start-up time the plan looks
    ahead by (assumed, then measured), and for a class none of whose replicas serves while one
    starts, the unix time its first should serve."""
    from rollfleet.autoscale.controller import status_document
    from rollfleet.autoscale.planner import PlannerState, plan
    from rollfleet.autoscale.signal import LAUNCHING, ClassDemand, Signal

    policy = Policy(min_replicas=1, max_replicas=4, hold_after_s=0, startup_s=30)
    asked = Signal(9, {3: ClassDemand(refusals=1)})
    fleet = [ReplicaFacts("a", active_version=9, capacity=4)]
    first = plan(asked, fleet, policy, PlannerState(), 100.0)
    doc = status_document(first, asked, policy, "me", 5000.0, [])
    assert (doc["startup_s"], doc["startup_measured"]) == (30, False)
    assert doc["classes"]["3"]["serving_by"] == 5030 and doc["classes"]["latest"]["serving_by"] is None
    fleet = [*fleet, ReplicaFacts("h3", held=3, state=LAUNCHING, capacity=0)]
    later = plan(asked, fleet, policy, first.state, 110.0)
    assert status_document(later, asked, policy, "me", 5010.0, [])["classes"]["3"]["serving_by"] == 5030
    fleet = [fleet[0], ReplicaFacts("h3", held=3, active_version=3, capacity=4)]
    served = plan(asked, fleet, policy, later.state, 124.0)
    doc = status_document(served, asked, policy, "me", 5024.0, [])
    assert (doc["startup_s"], doc["startup_measured"]) == (24, True) and doc["classes"]["3"]["serving_by"] is None


def _exited(pid: int) -> bool:
    """Gone, or a zombie waiting for its parent to read its exit status."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


@pytest.mark.long
async def test_an_old_version_asked_for_gets_a_held_worker_which_a_restarted_controller_releases(
    shared_broker: EmbeddedBroker, tmp_path: Path
) -> None:
    """Training is at version 2; a request for exactly version 1 is refused (no replica holds
    it), the refusal reaches the controller, which starts a worker held at 1; a request that
    chose to wait for a replica is served there within its deadline. The controller is then
    stopped and another started: it finds both workers by their command lines (launching none),
    and once the demand is gone it retires the held one (SIGTERM to a process it did not start; it exits 0)."""
    url, ns = shared_broker.url, "h" + uuid.uuid4().hex[:8]
    policy = Policy(min_replicas=1, max_replicas=3, hold_after_s=0, scale_in_grace_s=2.0, cooldown_s=0)
    args = ["--heartbeat", "1"]

    def driver() -> LocalDriver:
        return LocalDriver(url=url, namespace=ns, home=tmp_path, prefix="h", worker_args=args, keep_workers=True)

    first = driver()
    stop = asyncio.Event()
    task = asyncio.create_task(
        Controller(ControllerConfig(url=url, namespace=ns, policy=policy, interval_s=0.3), first).run(stop)
    )
    async with await RolloutClient.connect(url, namespace=ns, client_id="c") as client:
        try:
            await wait_until(lambda: len(client.fleet.replicas()) == 1, 30, what="one follower")
            for v in (1, 2):
                await client.commit_version(VersionRecord(version=v, kind="delta", base_version=v - 1))
            await client.wait_for_version(2, replicas=1, timeout=30)
            with pytest.raises(NoCompatibleReplica):
                await (await client.submit(payload(), exact_version=1, timeout=30)).result(30)
            # A request that chooses to wait is queued instead, and served within its deadline.
            waiting = await client.submit(
                payload(), exact_version=1, idempotency_key="old", timeout=30, wait_for_replica=True
            )
            result = await waiting.result(40)  # (its deadline settles it first: Expired, if not served)
            assert result.version_start == result.version_end == 1 and result.worker_id.startswith("h-v1-")
            pids = first.pids()
            assert len(pids) == 2
            stop.set()
            await asyncio.wait_for(task, 30)
            for pid in pids.values():
                os.kill(pid, 0)  # (still running: kept past the controller)
            second = driver()
            stop = asyncio.Event()
            task = asyncio.create_task(
                Controller(ControllerConfig(url=url, namespace=ns, policy=policy, interval_s=0.3), second).run(stop)
            )
            held_pid = pids[result.worker_id]
            await wait_until(lambda: set(second.pids()) == set(pids), 30, what="both workers found again")
            await wait_until(lambda: _exited(held_pid), 60, what="the held worker retired and exited")
            assert (await asyncio.to_thread(os.waitpid, held_pid, 0))[1] == 0  # (our child: its status is ours)
            assert set(second.pids()) == set(pids) - {result.worker_id}  # (nothing launched anew)
        finally:
            stop.set()
            await asyncio.wait_for(task, 30)
            for d in (first, locals().get("second")):
                if d is not None:
                    d.stop_all()


def test_every_policy_field_is_a_flag_of_rollfleet_autoscale_and_reaches_the_policy() -> None:
    """The bounds come from ``--bounds``; every other field of the policy is a flag whose value
    reaches the Policy the controller runs (a declared flag that was dropped would not)."""
    import argparse
    import dataclasses

    from rollfleet.autoscale.planner import Policy
    from rollfleet.cli.autoscale import _POLICY_FLAGS, add_policy_flags, policy_from

    fields = {f.name for f in dataclasses.fields(Policy)} - {"min_replicas", "max_replicas"}
    assert {field for _, field, _, _ in _POLICY_FLAGS} == fields
    parser = argparse.ArgumentParser()
    add_policy_flags(parser)
    argv, want = [], {}
    for i, (flag, field, kind, _) in enumerate(_POLICY_FLAGS):
        value = i + 2 if kind is int else round(0.05 * (i + 1), 2)  # (all valid: hysteresis < 1)
        argv += [flag, str(value)]
        want[field] = value
    policy = policy_from(parser.parse_args(argv), (2, 9))
    assert (policy.min_replicas, policy.max_replicas) == (2, 9)
    assert {field: getattr(policy, field) for field in fields} == want
    assert policy_from(parser.parse_args([]), (1, 8)) == Policy(min_replicas=1, max_replicas=8)
