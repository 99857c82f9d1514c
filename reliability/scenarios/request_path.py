"""Scenarios 1-3: the request path under worker kills, a broker restart and a cluster node loss."""

from __future__ import annotations

import asyncio
import random
import time
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness import ProcessGroup, wait_until
from reliability.scenarios.common import (
    BROKER_CONFIG,
    REPO,
    Figures,
    Ledger,
    gather_outcomes,
    job_payload,
    max_gap,
    start_broker,
)
from rollfleet.broker.topology import TopologyConfig
from rollfleet.runtime import faults
from rollfleet.schemas.errors import NoCompatibleReplica
from rollfleet.trainer_client import RolloutClient

ACK_WAIT_S = 2.0


@dataclass
class Submitted:
    handles: dict[str, Any]
    retries: int = 0
    errors: dict[str, int] | None = None


async def submit_paced(
    client: RolloutClient, keys: list[str], rate: float, *, retry_s: float = 30.0, stop: asyncio.Event | None = None
) -> Submitted:
    """Submit ``keys`` at ``rate`` per second. A submission the broker did not acknowledge (an
    exception, or a fail-fast NoCompatibleReplica while the fleet view is stale) is retried with
    the same key, as a trainer would, for up to ``retry_s``."""
    out = Submitted(handles={}, errors={})
    assert out.errors is not None
    t0 = time.monotonic()
    for i, key in enumerate(keys):
        if stop is not None and stop.is_set():
            break
        await asyncio.sleep(max(0.0, t0 + i / rate - time.monotonic()))
        deadline = time.monotonic() + retry_s
        while True:
            try:
                handle = await client.submit(job_payload(i), min_version=0, idempotency_key=key)
                if handle.done() and isinstance(handle._future.exception(), NoCompatibleReplica):
                    raise handle._future.exception()  # type: ignore[misc]
                out.handles[key] = handle
                break
            except Exception as exc:
                name = f"{type(exc).__module__}.{type(exc).__name__}"
                out.errors[name] = out.errors.get(name, 0) + 1
                out.retries += 1
                if time.monotonic() > deadline:
                    break
                await asyncio.sleep(0.2)
    return out


async def _count(fig: Figures, ledger: Ledger, handles: dict[str, Any], timeout: float) -> dict[str, Any]:
    results, errors = await gather_outcomes(handles, timeout)
    fig.submitted = len(handles)
    fig.completed = len(results)
    fig.failed = len(errors)
    fig.lost = len(handles) - len(results) - len(errors)
    fig.reexecuted = sum(1 for r in results.values() if r.delivery_attempt > 1)
    if errors:
        fig.notes["failures"] = sorted({type(e).__name__ for e in errors.values()})
    return results


async def _settle_and_count_duplicates(fig: Figures, ledger: Ledger, client: RolloutClient) -> None:
    # Late redeliveries would surface within an ack-wait: give them the chance to.
    await asyncio.sleep(ACK_WAIT_S + 0.5)
    fig.duplicated = await ledger.duplicated()
    info = await client.js.stream_info(client.names.jobs_stream)
    fig.notes["jobs_left_in_queue"] = int(info.state.messages)
    fig.expect(info.state.messages == 0, f"{info.state.messages} jobs left unacknowledged in the work queue")


# -- scenario 1 --------------------------------------------------------------------------------


async def worker_kills(
    workdir: Path,
    jobs: int = 200,
    kills: int = 2,
    workers: int = 3,
    rate: float = 50.0,
    latency_s: float = 0.05,
    seed: int = 1,
    timeout_s: float = 60.0,
) -> Figures:
    """Workers SIGKILLed at random moments while replayable jobs run; a replacement starts after each.

    One extra worker dies by fault point right after storing a result and before acking it,
    the narrowest window for a duplicate.
    """
    fig = Figures(
        "1", "Workers SIGKILLed while replayable jobs run", {"jobs": jobs, "kills": kills, "workers": workers}
    )
    t_start = time.monotonic()
    workdir.mkdir(parents=True, exist_ok=True)
    broker = start_broker(workdir)
    procs = ProcessGroup(workdir, cwd=REPO)
    ns = "rel1"
    common = ["--echo-latency", str(latency_s), "--ack-wait", str(ACK_WAIT_S), "--capacity", "4"]
    rng = random.Random(seed)
    try:
        topo = TopologyConfig(ack_wait_s=ACK_WAIT_S)
        async with await RolloutClient.connect(broker.url, namespace=ns, client_id="trainer", topology=topo) as client:
            ledger = Ledger(client)
            for i in range(workers):
                procs.worker(broker.url, ns, f"w{i}", *common)
            procs.worker(broker.url, ns, "poisoned", *common, env=faults.env("kill", "worker:after-result-before-ack"))
            ok = await wait_until(
                lambda: len(client.fleet.replicas()) >= workers + 1, 30, retry_errors=True, default=False
            )
            if not fig.expect(ok, "workers did not register"):
                return fig
            run_s = jobs / rate
            kill_at = sorted(rng.uniform(0.1 * run_s, 0.9 * run_s) for _ in range(kills))
            killed_at: list[float] = []
            t0 = time.monotonic()

            async def killer() -> None:
                for i, at in enumerate(kill_at):
                    await asyncio.sleep(max(0.0, t0 + at - time.monotonic()))
                    victims = [n for n in procs.alive("w")]
                    if not victims:
                        continue
                    victim = rng.choice(victims)
                    procs.kill(victim)
                    killed_at.append(time.monotonic())
                    procs.worker(broker.url, ns, f"w{workers + i}", *common)  # the replacement

            killer_task = asyncio.create_task(killer())
            submitted = await submit_paced(client, [f"s1/{i}" for i in range(jobs)], rate)
            await killer_task
            results = await _count(fig, ledger, submitted.handles, timeout_s)
            fig.faults = len(killed_at) + (1 if procs.procs["poisoned"].poll() is not None else 0)
            fig.notes["poisoned_worker_died_after_storing_a_result"] = procs.procs["poisoned"].poll() is not None
            # Time to recover: from each kill until the last job its victim held was answered
            # (those are the results generated on a redelivery).
            redelivered = sorted(ledger.first_arrival[k] for k, r in results.items() if r.delivery_attempt > 1)
            for i, t_kill in enumerate(killed_at):
                t_next = killed_at[i + 1] if i + 1 < len(killed_at) else float("inf")
                held = [t for t in redelivered if t_kill <= t < t_next]
                fig.recover_s.append(round(max(held) - t_kill, 3) if held else 0.0)
            await _settle_and_count_duplicates(fig, ledger, client)
            fig.notes["submit_retries"] = submitted.retries
            fig.notes["workers_serving"] = sorted({r.worker_id for r in results.values()})
    finally:
        procs.close()
        broker.stop()
    fig.expect(fig.lost == 0, f"{fig.lost} jobs lost")
    fig.expect(fig.failed == 0, f"{fig.failed} replayable jobs failed")
    fig.expect(fig.duplicated == 0, f"{fig.duplicated} keys got more than one result")
    fig.expect(fig.submitted == jobs, f"only {fig.submitted}/{jobs} submissions were acknowledged")
    fig.seconds = time.monotonic() - t_start
    return fig


# -- scenario 2 --------------------------------------------------------------------------------


async def broker_restart(
    workdir: Path,
    jobs: int = 150,
    rate: float = 30.0,
    down_s: float = 1.0,
    restarts: int = 1,
    workers: int = 2,
    timeout_s: float = 60.0,
) -> Figures:
    """The single-node broker (file store) SIGKILLed and restarted on the same store mid-run."""
    fig = Figures("2", "Broker SIGKILLed and restarted mid-run", {"jobs": jobs, "restarts": restarts, "down_s": down_s})
    t_start = time.monotonic()
    workdir.mkdir(parents=True, exist_ok=True)
    broker = start_broker(workdir)
    procs = ProcessGroup(workdir, cwd=REPO)
    ns = "rel2"
    try:
        topo = TopologyConfig(ack_wait_s=ACK_WAIT_S)
        async with await RolloutClient.connect(broker.url, namespace=ns, client_id="trainer", topology=topo) as client:
            ledger = Ledger(client)
            for i in range(workers):
                procs.worker(broker.url, ns, f"w{i}", "--echo-latency", "0.05", "--ack-wait", str(ACK_WAIT_S))
            ok = await wait_until(lambda: len(client.fleet.replicas()) >= workers, 30, retry_errors=True, default=False)
            if not fig.expect(ok, "workers did not register"):
                return fig
            run_s = jobs / rate
            outages: list[tuple[float, float]] = []

            async def chaos() -> None:
                for _k in range(restarts):
                    await asyncio.sleep(run_s / (restarts + 1))
                    broker.kill()  # SIGKILL: no flush, no goodbye
                    t_kill = time.monotonic()
                    await asyncio.sleep(down_s)
                    broker.start()  # same port, same store directory
                    outages.append((t_kill, time.monotonic()))

            chaos_task = asyncio.create_task(chaos())
            submitted = await submit_paced(client, [f"s2/{i}" for i in range(jobs)], rate)
            await chaos_task
            await _count(fig, ledger, submitted.handles, timeout_s)
            fig.faults = len(outages)
            for t_kill, t_up in outages:
                after = [t for t in ledger.arrivals if t > t_up]
                # Time to recover: broker back -> the next result delivered to the client. An
                # outage after the last result has no such time (nothing was left to deliver);
                # the fresh job below shows the path works after it.
                if after:
                    fig.recover_s.append(round(min(after) - t_up, 3))
                else:
                    fig.notes["outages_after_the_last_result"] = fig.notes.get("outages_after_the_last_result", 0) + 1
                fig.notes.setdefault("outage_s", []).append(round(t_up - t_kill, 3))
            fig.notes["submit_retries"] = submitted.retries
            fig.notes["submit_errors_during_outage"] = submitted.errors
            fig.notes["workers_alive_after"] = len(procs.alive("w"))
            fig.expect(len(procs.alive("w")) == workers, "a worker process exited instead of reconnecting")
            await _settle_and_count_duplicates(fig, ledger, client)
            # Results keep arriving after the restart: a fresh job goes through end to end.
            handle = await client.submit(job_payload(0), min_version=0, idempotency_key="s2/after")
            with suppress(Exception):
                await handle.result(20)
            fig.expect(handle.done() and not handle._future.exception(), "a job submitted after the restart failed")
    finally:
        procs.close()
        broker.stop()
    fig.expect(fig.lost == 0, f"{fig.lost} acknowledged jobs lost")
    fig.expect(fig.duplicated == 0, f"{fig.duplicated} keys got more than one result")
    fig.expect(fig.submitted == jobs, f"only {fig.submitted}/{jobs} submissions were acknowledged")
    fig.seconds = time.monotonic() - t_start
    return fig


# -- scenario 3 --------------------------------------------------------------------------------


async def cluster_node_loss(
    workdir: Path,
    jobs: int = 150,
    rate: float = 30.0,
    workers: int = 2,
    timeout_s: float = 60.0,
    slack_s: float = 2.0,
) -> Figures:
    """A 3-node cluster (broker_config/cluster/) with R3 streams; the jobs stream leader's node is
    SIGKILLed under load. Fail-over: kill -> the jobs stream has a leader on a live node and
    accepts a write. Stall: the longest gap in result deliveries around the kill."""
    from harness import kill_stream_leader, start_cluster, wait_failover

    fig = Figures("3", "3-node cluster, R3 streams, stream leader's node SIGKILLed", {"jobs": jobs})
    t_start = time.monotonic()
    workdir.mkdir(parents=True, exist_ok=True)
    cluster = start_cluster(workdir, BROKER_CONFIG / "cluster")
    procs = ProcessGroup(workdir, cwd=REPO)
    ns = "rel3"
    topo = TopologyConfig(replicas=3, ack_wait_s=ACK_WAIT_S)
    try:
        client: RolloutClient | None = None
        deadline = time.monotonic() + 30
        while client is None:  # until the cluster has elected a meta leader
            try:
                client = await RolloutClient.connect(cluster.url, namespace=ns, client_id="trainer", topology=topo)
            except Exception:
                if time.monotonic() > deadline:
                    raise
                await asyncio.sleep(0.5)
        async with client:
            ledger = Ledger(client)
            for i in range(workers):
                args = ["--echo-latency", "0.05", "--ack-wait", str(ACK_WAIT_S), "--replicas", "3"]
                procs.worker(cluster.url, ns, f"w{i}", *args)
            ok = await wait_until(lambda: len(client.fleet.replicas()) >= workers, 30, retry_errors=True, default=False)
            if not fig.expect(ok, "workers did not register"):
                return fig
            names = client.names
            run_s = jobs / rate
            probe: dict[str, Any] = {}

            async def chaos() -> None:
                await asyncio.sleep(run_s * 0.4)
                probe["killed"] = await kill_stream_leader(cluster, client.js, names.jobs_stream)
                probe["t_kill"] = time.monotonic()
                errors: list[tuple[float, str]] = probe.setdefault("errors", [])
                probe["failover_s"] = await wait_failover(
                    client.js, names, probe["killed"], min_versions=[0], client_id="trainer", errors=errors
                )

            chaos_task = asyncio.create_task(chaos())
            submitted = await submit_paced(client, [f"s3/{i}" for i in range(jobs)], rate)
            await chaos_task
            results = await _count(fig, ledger, submitted.handles, timeout_s)
            fig.faults = 1
            failover = probe.get("failover_s", float("inf"))
            t_kill = probe.get("t_kill", t_start)
            # The stall: the longest stretch without a delivered result, from the kill until
            # deliveries resumed; compared with the gap before the kill (normal jitter).
            last = max(ledger.arrivals, default=t_kill)
            stall = max_gap(ledger.arrivals, t_kill, min(last, t_kill + failover + 10.0))
            before = max_gap(ledger.arrivals, t_kill - 1.5, t_kill)
            fig.recover_s.append(round(failover, 3))
            fig.notes.update(
                killed=probe.get("killed"),
                probe_errors=probe.get("errors", [])[:15],
                failover_s=round(failover, 3),
                stall_s=round(stall, 3),
                normal_gap_s=round(before, 3),
                submit_retries=submitted.retries,
                submit_errors=submitted.errors,
                workers_serving=sorted({r.worker_id for r in results.values()}),
            )
            fig.expect(stall <= failover + slack_s, f"result stall {stall:.2f}s exceeds fail-over {failover:.2f}s")
            await _settle_and_count_duplicates(fig, ledger, client)
    except BaseException:
        print(cluster.logs())
        raise
    finally:
        procs.close()
        cluster.stop()
    fig.expect(fig.lost == 0, f"{fig.lost} jobs lost")
    fig.expect(fig.duplicated == 0, f"{fig.duplicated} keys got more than one result")
    fig.expect(fig.submitted == jobs, f"only {fig.submitted}/{jobs} submissions were acknowledged")
    fig.seconds = time.monotonic() - t_start
    return fig
