"""The job consumers a trainer declares: workers only bind (they may not change how jobs are
delivered), so the client creates each subject's shared consumer before its first job is stored,
every version's listened subjects when it commits or a replica serves it, and a replica's own
consumer with the first session turn sent there.

Each is looked up once and then believed to exist for ``RECHECK_S`` (an idle consumer is removed
after ``consumer_inactive_s``); the belief is dropped at once when one is found missing, and all
of them after a reconnect (the broker may have come back on an older store). A look-up is asked
again while the broker recovers, as storing the job would be (``broker.retry_call``).
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from contextlib import suppress

from rollfleet.broker.errors import typed_errors
from rollfleet.broker.retry_call import call_retrying
from rollfleet.broker.topology import TopologyConfig, declare_job_consumer, declare_replica_consumer
from rollfleet.broker.types import NATS, JetStreamContext
from rollfleet.runtime.logs import get_logger
from rollfleet.schemas import Names, VersionConstraint
from rollfleet.schemas.errors import RollfleetError
from rollfleet.schemas.names import listened_subjects
from rollfleet.trainer_client.fleet import FleetView
from rollfleet.trainer_client.placement import PUBLISH_BUDGET_S

log = get_logger("rollfleet.client")

RECHECK_S = 600.0


class JobConsumers:
    def __init__(
        self,
        js: JetStreamContext,
        nc: NATS,
        names: Names,
        topology: TopologyConfig,
        *,
        ring: Callable[[VersionConstraint], None],
    ) -> None:
        self._js, self._nc, self._names, self._topology = js, nc, names, topology
        self._ring = ring  # wake a replica for a subject whose consumer was just declared again
        self._known: dict[str, float] = {}  # consumer -> until when it is believed to exist

    def forget(self) -> None:
        """Every belief that a consumer exists is dropped (each is looked up again)."""
        self._known.clear()

    async def shared(self, constraint: VersionConstraint, until: float | None = None) -> bool:
        """The subject's shared consumer exists; True when this call created it: replicas may
        have found it missing before. ``until``: as ``declared``."""
        kind, version = constraint.kind, constraint.version
        return await self._declared(
            str(constraint), lambda: declare_job_consumer(self._js, self._names, kind, version, self._topology), until
        )

    async def replica(self, worker_id: str, until: float | None = None) -> bool:
        """A replica's own consumer, created with the first turn sent there."""
        return await self._declared(
            f"replica {worker_id}",
            lambda: declare_replica_consumer(self._js, self._names, worker_id, self._topology),
            until,
        )

    async def replica_again(self, worker_id: str) -> bool:
        """A replica's own consumer found missing: declared again (the belief dropped)."""
        self._known.pop(f"replica {worker_id}", None)
        return await self.replica(worker_id)

    async def shared_again(self, constraint: VersionConstraint) -> None:
        """A subject's consumer vanished (deleted, or cleaned up while this client believed it
        existed): create it again, tell replicas to look again, and ring one."""
        self._known.pop(str(constraint), None)
        try:
            with typed_errors():
                if await self.shared(constraint):
                    log.warning("job consumer was missing; declared it again", subject=str(constraint))
                    await self._nc.publish(self._names.consumers_declared, b"")
        except RollfleetError as exc:  # (the broker's errors are ones)
            log.debug("declaring a missing job consumer failed", subject=str(constraint), error=str(exc))
            return
        self._ring(constraint)

    async def version(self, version: int) -> None:
        """A version's job consumers (its replicas' listened subjects), declared before replicas
        look for them. Replicas that found one missing are told to look again (one core message)."""
        created = False
        until = time.time() + PUBLISH_BUDGET_S  # (one wait for the broker, not one per subject)
        for kind, v in listened_subjects(version):
            try:
                created |= await self.shared(VersionConstraint(kind, v), until)
            except RollfleetError as exc:  # a submit there creates it later
                log.debug("declaring job consumer failed", version=v, error=exc.message)
        if created:
            with suppress(Exception):
                await self._nc.publish(self._names.consumers_declared, b"")

    async def follow(self, fleet: FleetView) -> None:
        """Keep the listened subjects of every version some live replica serves declared (a
        replica at a fixed version, or one that started before any commit)."""
        declared: set[int] = set()
        while True:
            changed = fleet.changed()
            for version in sorted({r.active_version for r in fleet.replicas()} - declared):
                await self.version(version)
                declared.add(version)
            await changed.wait()

    def known(self, what: str) -> bool:
        """Whether ``what`` (``str(constraint)``, or ``"replica <id>"``) was declared lately: it
        is not looked up again until then."""
        return time.monotonic() < self._known.get(what, 0.0)

    async def _declared(self, what: str, declare: Callable[[], Awaitable[bool]], until: float | None) -> bool:
        """Run ``declare`` unless it ran for ``what`` lately; whether it created the consumer.
        Asked again while the broker recovers, until ``until`` (unix time; by default the publish
        budget). An attempt that failed may have created the consumer unanswered, so the result
        is then True: replicas are told once too often, never once too few."""
        if self.known(what):
            return False
        attempts = 0

        async def attempt() -> bool:
            nonlocal attempts
            attempts += 1
            return await declare()

        deadline = time.time() + PUBLISH_BUDGET_S if until is None else until
        created = await call_retrying(attempt, until=deadline, what=f"create the consumer of {what}", nc=self._nc)
        self._known[what] = time.monotonic() + RECHECK_S
        return created or attempts > 1
