"""What a trainer's client puts back when the broker lost part of its namespace.

A broker restarted on an empty store (a disk replaced), or on an older copy of it (a single
node's power loss), or a stream or bucket deleted through the JetStream API: the
``TopologyKeeper`` declares the lost streams and buckets again, and this restores what lived in
them that this client owns, so the fleet comes back to service by itself:

- the jobs stream: its consumers (the shared consumer of every version live replicas serve, and
  the latest one's), and the replicas told to bind again (``consumers_declared``);
- the results stream: this client's results consumer, its pull requests renewed (a shared id's
  instance consumer starts at new answers, so its waiting handles look up what was stored meanwhile);
- the sessions bucket: this client id's job-id secret (a restarted trainer, or a re-ask, must
  recognise the ids issued under it);
- the fleet bucket: this client's lease key; and its watches of the registry and the policy
  (a watcher of a lost bucket may wait for ever on a consumer that no longer exists).

Jobs and answers the broker lost are not restored: a call whose job was lost is answered by its
deadline (``Expired``) like any job nobody served, and may be submitted again.
"""

from __future__ import annotations

from typing import Protocol

from rollfleet.broker.types import NATS
from rollfleet.runtime.logs import get_logger
from rollfleet.schemas import Names
from rollfleet.trainer_client.fleet import FleetView

log = get_logger("rollfleet.trainer_client.restore")


class RestoreHost(Protocol):
    """What restoring needs of the client whose part of the namespace it puts back
    (``RolloutClient`` is one); each step idempotent."""

    names: Names
    nc: NATS
    fleet: FleetView
    shared: bool

    def forget_consumers(self) -> None:
        """Every cached belief that a consumer exists is dropped (each is looked up again)."""

    async def restore_results_consumer(self) -> None:
        """This client's results consumer declared again, and its pull requests renewed."""

    async def restore_job_ids(self) -> None:
        """This client id's job-id secret written back to the sessions bucket."""

    async def restore_lease(self) -> None:
        """This client's lease key written back to the fleet bucket."""

    async def declare_version_consumers(self, version: int) -> None:
        """A version's job consumers declared (replicas told to bind again)."""


def versions_to_declare(live: list[int], latest: int | None) -> list[int]:
    """The versions whose job consumers a re-declared jobs stream needs at once: every version a
    live replica serves, and the latest commit (jobs for it are submitted next)."""
    return sorted(set(live) | ({latest} if latest is not None else set()))


async def restore_namespace(client: RestoreHost, created: list[str]) -> None:
    """Restore this client's part of what the streams ``created`` (lost: declared again, or after
    a reconnect, possibly rolled back) held. Each step is idempotent."""
    names = client.names
    client.forget_consumers()
    if names.results_stream in created:
        await client.restore_results_consumer()
    if f"KV_{names.sessions_bucket}" in created:
        await client.restore_job_ids()
    if f"KV_{names.fleet_bucket}" in created and not client.shared:
        await client.restore_lease()
    if f"KV_{names.fleet_bucket}" in created or f"KV_{names.policy_bucket}" in created:
        await client.fleet.rewatch()
    if names.jobs_stream in created or f"KV_{names.fleet_bucket}" in created:
        live = [r.active_version for r in client.fleet.replicas()]
        for version in versions_to_declare(live, client.fleet.latest_version):
            await client.declare_version_consumers(version)
        await client.nc.publish(names.consumers_declared, b"")
    # (After every reconnect this runs for all of them, as a precaution: a warning only says what
    # ``TopologyKeeper`` found lost.)
    log.info("restored this client's part of the namespace", streams=created)
