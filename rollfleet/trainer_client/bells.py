"""Waking a replica for a job it would not otherwise pull at once: a core-NATS message to one
replica (``Names.bell_subject``) naming the subject with work on it. A bell may be lost;
``JobWatch.stalls`` rings again where jobs wait unpulled. A bell to a replica that is gone comes
back as "no responders" on this client's bell inbox: the replica is dropped from the fleet view,
and the next one is rung."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from rollfleet.broker.errors import no_responders
from rollfleet.broker.types import NATS, Msg
from rollfleet.runtime.logs import get_logger
from rollfleet.schemas import Names, VersionConstraint
from rollfleet.schemas.bell_wire import bell_payload, bell_waited_headers, parse_bell_payload
from rollfleet.trainer_client.fleet import FleetView

log = get_logger("rollfleet.client")

INTERVAL_S = 0.05  # at most one bell per subject per interval (but a stalled subject's)


class Bells:
    def __init__(self, nc: NATS, names: Names, fleet: FleetView, spawn: Callable[[Any], None]) -> None:
        self._nc, self._names, self._fleet, self._spawn = nc, names, fleet, spawn
        self._rung: dict[tuple[str, int], float] = {}  # subject -> when it was last rung
        self.inbox = ""

    async def start(self) -> None:
        self.inbox = self._nc.new_inbox()
        await self._nc.subscribe(self.inbox + ".>", cb=self._on_unanswered)

    @property
    def probe_reply(self) -> str:
        """Where "no responders" to a liveness probe comes back (``JobPlacement.probe``)."""
        return f"{self.inbox}.p"

    def ring(
        self, constraint: VersionConstraint, *, stalled: bool = False, fresh: bool = False, waited_s: float = 0.0
    ) -> None:
        """Wake one replica for a job just stored on a subject outside every live replica's
        window (``FleetView.covered``: no request is surely waiting there): a core message to that
        replica alone, chosen round robin among those whose version can take it, at most one per
        subject per interval. ``fresh``: the subject's consumer may have been missing when
        replicas looked (they do not create it), so even a listened subject gets a bell.
        ``waited_s``: how long the subject's oldest job has waited (a stalled bell says it, so
        the replica ages the subject by the jobs' wait, not from when it heard)."""
        if not stalled and not fresh and self._fleet.covered(constraint):
            return
        key = (constraint.kind, constraint.version)
        now = time.monotonic()
        if not stalled and now - self._rung.get(key, 0.0) < INTERVAL_S:
            return
        target = self._fleet.bell_target(constraint)
        if target is None:
            return  # nobody serves it yet; a replica activating the version pulls it then
        self._rung[key] = now
        log.debug("bell rung", kind=constraint.kind, version=constraint.version, stalled=stalled, to=target.worker_id)
        data = bell_payload(constraint.kind, constraint.version, stalled=stalled)
        reply = f"{self.inbox}.{constraint.kind}.{constraint.version}{'.stalled' if stalled else ''}"
        headers = bell_waited_headers(waited_s)
        self._spawn(self._nc.publish(self._names.bell_subject(target.worker_id), data, reply=reply, headers=headers))

    def ring_replica(self, worker_id: str) -> None:
        """Wake a replica for a turn stored on its own subject (no responders: it is gone, and
        the sticky watch moves the turn)."""
        bell = self._names.bell_subject(worker_id)
        self._spawn(self._nc.publish(bell, Names.REPLICA_BELL, reply=f"{self.inbox}.r"))

    async def _on_unanswered(self, msg: Msg) -> None:
        """No responders for a bell: that replica is gone. Drop it and ring the next one."""
        headers = msg.headers or {}
        if not no_responders(headers):
            return
        self._fleet.mark_gone(headers.get("Nats-Subject", "").rpartition(".")[2])
        parsed = parse_bell_payload(msg.subject[len(self.inbox) + 1 :].encode())
        if parsed is not None:
            (kind, version), _ = parsed
            self.ring(VersionConstraint(kind, version), stalled=True)
