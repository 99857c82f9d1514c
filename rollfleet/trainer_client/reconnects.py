"""What a client does when its connection comes back, or the broker under it changes.

A reconnect may follow a broker restart (its duplicate detection rebuilt, its store empty or
older) or a partition (another client may have taken the id over meanwhile). So after one: keys
are looked up among the stored answers again for a duplicate window (``EarlierAnswers``), the
results pull is asked again at once, the fleet view and the placement note it, the namespace is
looked at again (``TopologyKeeper``, which restores what the broker lost: ``restore``), and the
lease is checked: a client whose id was taken over stops taking results. A cluster fail-over of
the results consumer's leader, or a stream deleted, is heard as an advisory.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from rollfleet.broker.topology import TopologyConfig, TopologyKeeper, topology_streams
from rollfleet.broker.types import NATS, JetStreamContext, Msg
from rollfleet.runtime.logs import get_logger
from rollfleet.schemas import Names
from rollfleet.schemas.errors import ClientIdInUse
from rollfleet.trainer_client.earlier_answers import EarlierAnswers
from rollfleet.trainer_client.fleet import FleetView
from rollfleet.trainer_client.handle import RolloutHandle
from rollfleet.trainer_client.inbox import ResultsInbox
from rollfleet.trainer_client.lease import ClientLease
from rollfleet.trainer_client.placement import JobPlacement

log = get_logger("rollfleet.client")


class ReconnectHost(Protocol):
    """What the reactions need of their client (``RolloutClient`` is one)."""

    nc: NATS
    js: JetStreamContext
    names: Names
    client_id: str
    inbox: ResultsInbox
    fleet: FleetView
    placement: JobPlacement
    earlier: EarlierAnswers


class Reconnects:
    """A client's reactions to its connection and to the broker's advisories."""

    def __init__(
        self,
        host: ReconnectHost,
        lease: ClientLease | None,
        handles: dict[str, RolloutHandle],
        spawn: Callable[[Any], None],
    ) -> None:
        self.nc, self.js, self.names, self.client_id = host.nc, host.js, host.names, host.client_id
        self.inbox, self.fleet, self.placement, self.earlier = host.inbox, host.fleet, host.placement, host.earlier
        self._lease = lease  # (None for a shared client id: no lease)
        self._handles = handles
        self._spawn = spawn
        self.keeper: TopologyKeeper | None = None  # declares again what the broker lost (restore.py)

    async def listen_leader(self) -> None:
        """Hear the results consumer's leader change (its pull request is gone with the old one)."""
        advisory = self.names.consumer_leader_advisory(self.names.results_stream)
        await self.nc.subscribe(advisory, cb=self._on_results_leader)

    async def keep_topology(self, topology: TopologyConfig, restore: Callable[[list[str]], Awaitable[None]]) -> None:
        """Keep the namespace declared (``restore``: what the client puts back of what was lost)."""
        self.keeper = TopologyKeeper(self.js, self.names, topology, on_declared=restore)
        self._spawn(self.keeper.run())
        for stream in topology_streams(self.names):  # (looked at again only when one is deleted)
            await self.nc.subscribe(self.names.stream_deleted_advisory(stream), cb=self._on_stream_deleted)

    def on_reconnect(self) -> None:
        self.earlier.note_reconnected()  # (see EarlierAnswers.answered_before)
        self.inbox.renew()  # re-request at once instead of waiting out the old one
        self.fleet.note_reconnected()
        self.placement.note_reconnected()  # (a holder is judged only once it could be back: HolderWatch)
        if self.keeper is not None:  # (the broker may be back on an empty or older store)
            self.keeper.poke()
        self._spawn(self._check_lease())

    async def _check_lease(self) -> None:
        """After a partition another client may have taken the id over: then stop taking results."""
        if self._lease is None:
            return
        try:
            held = await self._lease.held()
        except Exception:  # the broker went away again; the next reconnect checks again
            return
        if held or not self.inbox.receiving:
            return
        log.error("client_id taken over by another client while disconnected; no longer receiving results")
        await self.inbox.stop()
        for handle in list(self._handles.values()):
            handle.set_error(ClientIdInUse(f"client_id {self.client_id!r} was taken over by another client"))
        self._handles.clear()

    async def _on_results_leader(self, msg: Msg) -> None:
        """The results consumer has a new leader (a cluster fail-over): our request is gone."""
        self.inbox.on_leader_change(msg.subject.rpartition(".")[2])

    async def _on_stream_deleted(self, _: Msg) -> None:
        if self.keeper is not None:
            self.keeper.poke()
