"""``rollfleet status``: the fleet, queue depth per jobs subject, and the latest version."""

from __future__ import annotations

import json
import time
from typing import Any

import msgspec

from rollfleet.broker.buckets import KVBucket, open_bucket
from rollfleet.broker.connection import connect
from rollfleet.broker.kv import read_latest, read_replicas
from rollfleet.broker.topology import queue_depths
from rollfleet.runtime.secrets import redact_urls
from rollfleet.schemas import HeardClock, Names, ReplicaStatus, heartbeat_on_readers_clock
from rollfleet.schemas.errors import NotFound


async def collect_status(
    url: str, namespace: str, connect_timeout_s: float = 5.0, **connect_options: Any
) -> dict[str, Any]:
    """A snapshot of the namespace; a broker that does not answer within ``connect_timeout_s`` is
    one ``ServiceUnavailable`` (no retrying for minutes, no warning per attempt)."""
    names = Names(namespace)
    nc = await connect(
        url,
        name="rollfleet-status",
        initial_timeout=connect_timeout_s,
        log_errors=False,
        inbox_prefix=names.inbox_prefix("trainer"),
        **connect_options,
    )
    try:
        js = nc.jetstream()
        try:
            fleet = await open_bucket(js, names.fleet_bucket)
            policy = await open_bucket(js, names.policy_bucket)
        except NotFound:
            return {"namespace": namespace, "declared": False, "replicas": [], "queues": {}, "latest_version": None}
        replicas = list((await read_replicas(fleet.kv)).values())
        latest = await read_latest(policy.kv)
        depths = await queue_depths(js, names)
        autoscaler = await _autoscaler(fleet)
    finally:
        await nc.close()
    now = time.time()
    return {
        "autoscaler": autoscaler,
        "namespace": namespace,
        "declared": True,
        "latest_version": latest,
        "replicas": [
            msgspec.to_builtins(r)
            | _liveness(r, now)
            # an entry an older worker wrote may quote a URL with its credentials: never shown
            | {"degraded_reason": r.degraded_reason and redact_urls(r.degraded_reason)}
            for r in sorted(replicas, key=lambda r: r.worker_id)
        ],
        "queues": {f"{kind}-{v}": n for (kind, v), n in sorted(depths.items())},
    }


async def _autoscaler(fleet: KVBucket) -> dict[str, Any] | None:
    """The plan the acting controller (``rollfleet autoscale``) last wrote, if one ever ran."""
    entry = await fleet.read(Names.AUTOSCALER_STATUS_KEY)
    if entry is None:
        return None
    try:
        doc = json.loads(entry.value or b"null")
    except ValueError:
        return None
    return doc if isinstance(doc, dict) else None


def render_autoscaler(doc: dict[str, Any] | None, now: float) -> list[str]:
    if not doc:
        return []
    age = now - float(doc.get("at", now))
    policy = doc.get("policy", {})
    startup = doc.get("startup_s")
    how = "measured" if doc.get("startup_measured") else "assumed"
    start = "" if startup is None else f", start-up {startup:.1f}s ({how})"
    lines = [
        "",
        f"autoscaler {doc.get('holder')} ({age:.0f}s ago), bounds {policy.get('min')}..{policy.get('max')}{start}:",
        "  class     desired  actual  waiting  running  oldest wait  sessions  refused  awaiting activation",
    ]
    for name, c in doc.get("classes", {}).items():
        label = name if name == "latest" else f"v{name}"
        lines.append(
            f"  {label:<9} {c['desired']:>7}  {c['actual']:>6}  {c['backlog']:>7}  {c['running']:>7}  "
            f"{c['oldest_wait_s']:>10.1f}s  {c['sessions']:>8}  {c['refused']:>7}  {c['awaiting_activation']:>19}"
        )
    for d in doc.get("recent", [])[-3:]:
        who = f" {d['worker_id']}" if d.get("worker_id") else ""
        lines.append(f"  last: {d['klass']} {d['action']}{who} {d['before']}->{d['after']}: {d['reason']}")
    return lines


def _liveness(replica: ReplicaStatus, now: float) -> dict[str, Any]:
    """Judged as clients judge a snapshot entry (``heartbeat_on_readers_clock``): a stamp ahead of
    this machine's clock counts as now, so a replica whose clock runs ahead never looks alive
    longer than its silence allows."""
    heard, _ = heartbeat_on_readers_clock(HeardClock(), replica.started_at, replica.heartbeat_at, now, live=False)
    timed = msgspec.structs.replace(replica, heartbeat_at=heard)
    return {"live": timed.is_live(now), "heartbeat_age_s": round(now - heard, 1)}


def render_table(snapshot: dict[str, Any]) -> str:
    if not snapshot.get("declared"):
        return f"namespace {snapshot['namespace']}: not declared on this broker"
    lines = [f"namespace {snapshot['namespace']}   latest published version: {snapshot['latest_version']}", ""]
    cols = (
        "worker",
        "state",
        "active",
        "preparing",
        "in flight",
        "capacity",
        "sessions",
        "resumed (kept/regenerated tokens)",
        "heartbeat",
        "engine",
    )
    rows = [
        (
            r["worker_id"],
            r["state"] + ("" if r["live"] else " (stale)"),
            str(r["active_version"]),
            "-" if r["preparing_version"] is None else str(r["preparing_version"]),
            str(r["in_flight"]),
            str(r["capacity"]),
            str(r.get("sessions", 0)),
            f"{r.get('resumed', 0)} ({r.get('tokens_kept', 0)}/{r.get('tokens_regenerated', 0)})",
            f"{r['heartbeat_age_s']}s ago",
            r["engine"],
        )
        for r in snapshot["replicas"]
    ]
    widths = [max(len(c), *(len(row[i]) for row in rows)) if rows else len(c) for i, c in enumerate(cols)]
    lines.append("  ".join(c.ljust(w) for c, w in zip(cols, widths, strict=True)))
    lines += ["  ".join(v.ljust(w) for v, w in zip(row, widths, strict=True)) for row in rows]
    if not rows:
        lines.append("(no replicas registered)")
    reasons = [(r["worker_id"], r["state"], r.get("degraded_reason")) for r in snapshot["replicas"]]
    lines += [f"  {worker} is {state}: {reason}" for worker, state, reason in reasons if reason]
    lines += ["", "queue depth per jobs subject:"]
    queues = snapshot["queues"]
    lines += [f"  {name:<12} {count}" for name, count in queues.items()] or ["  (empty)"]
    lines += render_autoscaler(snapshot.get("autoscaler"), time.time())
    return "\n".join(lines)
