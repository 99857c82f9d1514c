"""What a session needs from the client it runs on, as explicit interfaces.

``RolloutClient`` is a ``SessionHost`` and its ``JobPlacement`` a ``TurnPlacement``; the sessions
room never imports the client, so the two stay one-way (client -> sessions).
"""

from __future__ import annotations

from typing import Protocol

from rollfleet.broker.buckets import KVBucket
from rollfleet.schemas import Claim, Names, RetryPolicy, RolloutPayload, RolloutResult, VersionConstraint
from rollfleet.trainer_client.client_metrics import ClientMetrics
from rollfleet.trainer_client.fleet import FleetView
from rollfleet.trainer_client.handle import RolloutHandle


class OpenSession(Protocol):
    """What a client keeps of each open session (``Session`` is one)."""

    @property
    def session_id(self) -> str: ...

    @property
    def replica(self) -> str | None: ...

    @property
    def placed_on(self) -> str | None: ...


class TurnPlacement(Protocol):
    """Where a sticky turn's job lies, and how it is moved (the client's job mechanics)."""

    fleet: FleetView
    metrics: ClientMetrics
    client_id: str

    async def taken(self, handle: RolloutHandle) -> bool:
        """Whether a worker was ever delivered the handle's job where it is stored now."""
        ...

    async def move_to_shared(self, handle: RolloutHandle) -> bool:
        """Withdraw the job from its replica's own subject and store it, as is, on the shared
        subject of its constraint (also when the broker's store lost it); False if it could not be
        withdrawn (it was answered, or the broker did not answer)."""
        ...

    def probe(self, worker_id: str) -> None:
        """Ask whether the replica's connection is alive (no responders: it is marked gone)."""
        ...

    async def listening(self, worker_id: str) -> bool | None:
        """Whether some process listens on the replica's bell now (False: "no responders"); None
        if the broker could not be asked."""
        ...

    def connected_since(self) -> float | None:
        """When the client's connection to the broker last came up (wall clock); None while down."""
        ...

    async def holder(self, handle: RolloutHandle, *, strict: bool = False) -> Claim | None:
        """The handle's job's claim, naming the process holding it; None when it is not claimed
        (or its claim is marked stopped). ``strict``: a broker error is raised, not taken for
        "unclaimed"."""
        ...

    async def requeue(self, handle: RolloutHandle) -> bool:
        """Store the job (the same bytes) again on the shared subject it lies on, withdrawing the
        copy a dead holder was delivered (or none, if the broker's store lost it); False if it
        could not be withdrawn (it was answered, or the broker did not answer)."""
        ...

    async def holder_stopped(self, handle: RolloutHandle, worker_id: str | None = None) -> bool:
        """If the process holding the handle's job (a process of ``worker_id``, when given) is gone
        now (no responders on its bell), mark the job's claim stopped, so the replica that takes
        the job over need not wait for the claim to go stale; whether it was marked. Only the
        claim as read before asking is marked (compare-and-set): a claim a live replica took
        meanwhile is left alone."""
        ...


class SessionHost(Protocol):
    """Everything a ``Session`` uses of its client."""

    client_id: str
    names: Names
    fleet: FleetView
    metrics: ClientMetrics
    placement: TurnPlacement  # where its turns lie, and how they move
    default_timeout_s: float
    sessions: dict[str, OpenSession]  # this client's open sessions, by id

    @property
    def latest_version(self) -> int | None: ...

    async def sessions_kv(self) -> KVBucket: ...

    async def submit_turn(
        self,
        payload: RolloutPayload,
        constraint: VersionConstraint,
        *,
        written: str,
        key: str,
        timeout: float | None,
        retry_policy: RetryPolicy,
        session_id: str,
        replica: str | None,
        asked_at: float,
    ) -> RolloutHandle: ...

    async def result(self, idempotency_key: str, timeout: float | None = None) -> RolloutResult: ...

    async def end_session(self, replica: str, session_id: str) -> None:
        """Tell the replica holding the session's context to drop it."""
        ...
