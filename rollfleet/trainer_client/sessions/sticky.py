"""The watch over a session's turn: when the job stored on a replica's own subject moves, and
when a turn whose holder died is stored again.

A turn waits on the subject of the replica holding the session's context. It moves to the
shared subject of its constraint, as the same job (one answer wherever it runs), when:

- the replica has not taken it within ``affinity_wait_s`` (busy, or gone without a word);
- the replica is gone: stale in the registry, or no responders to a probe (sent every second
  while it holds the turn); its claim on the turn is then marked stopped, so the replica that
  takes the moved turn runs it (``replayable``) or answers ``Interrupted`` (``at_most_once``)
  at once instead of waiting out the claim. A replica that was delivered the turn may be running
  it: its claim is marked only once ``placement_rules.HolderWatch`` judges it gone (never while
  this client is cut off from the broker, nor before a live replica could have dialed it again
  after an outage, and only after repeated unanswered probes); until then the moved turn waits
  on the claim, which the replica that takes it judges by its own rules (``workers.claims``);
- the replica is live and at a version that cannot serve the turn (it activated a newer one:
  an exact turn it held was drained or handed back before that);
- the replica was delivered the turn but holds no claim on it past ``affinity_wait_s``: it
  handed it back (it was not at the turn's version yet) and has not taken it again. Its pull
  request on its own subject may be gone (a cluster's consumer leader moved while its link was
  stalled; campaign 8, seed 103: an exact turn waited 15.8 s on a live, idle replica's subject
  and expired). A turn that runs is claimed first, so an unclaimed one runs nowhere; moved, it
  is on a shared subject, where the stall watch rings replicas for what waits unpulled.

A turn the replica has taken is never moved while the replica is draining or activating: a
draining replica finishes what it holds, an activating one drains its exact jobs first (a
hand-back then shows as the last case above). Moving a turn that is running would run it twice.

A turn on a shared subject (moved there, or never sticky) is watched by its claim: the claim
names the process holding it, and when that process is gone (no registry entry, a restarted
replica under the same id, or no responders to a probe) the claim is marked stopped and the same
job stored again at once, instead of waiting for the broker to redeliver it after ``ack_wait``
(gone as ``HolderWatch`` judges it, as above).
"""

from __future__ import annotations

import asyncio
import time
from contextlib import suppress

from rollfleet.schemas import ReplicaStatus, RolloutResult, VersionConstraint
from rollfleet.trainer_client.handle import RolloutHandle
from rollfleet.trainer_client.placement_rules import GONE_PROBES, PROBE_SPACING_S, HolderWatch
from rollfleet.trainer_client.sessions.host import TurnPlacement

POLL_S = 0.2  # how often the watch looks at the replica
PROBE_S = 1.0  # a replica holding a sticky turn is probed this often (no responders: gone)
UNCLAIMED_LOOKS = 2  # looks a second apart that find a delivered turn unclaimed before it moves
_LEAVING = ("draining", "activating")  # finishing what it holds before it stops or moves on


async def await_turn(host: TurnPlacement, handle: RolloutHandle, wait_s: float) -> RolloutResult:
    """The answer of a turn, moving it off its replica when it must move (``handle.replica``) and
    storing it again when the process holding it is gone."""
    started = time.monotonic()
    taken = False
    unclaimed_looks = 0  # consecutive looks, a second apart, that found it delivered and unclaimed
    probe_at = claim_at = started + PROBE_S
    watches: dict[str, HolderWatch] = {}  # what is known of each replica that held it
    while True:
        with suppress(TimeoutError):
            return await handle.result(timeout=POLL_S)
        replica = handle.replica
        now = time.monotonic()
        if replica is None:  # on a shared subject: moved there, or never sticky
            if now >= probe_at:
                probe_at = now + PROBE_S
                await _requeue_if_holder_gone(host, handle, watches)
            continue
        if not taken:
            taken = await host.taken(handle)
        waited = now - started >= wait_s
        if taken and waited and now >= claim_at:
            claim_at = now + PROBE_S
            unclaimed_looks = unclaimed_looks + 1 if await _claimed(host, handle) is False else 0
        status = host.fleet.replica(replica)
        _heard(watches, replica, status)  # (the view forgets a replica a probe found silent: keep it here)
        reason = move_reason(status, handle.job.constraint, taken, unclaimed_looks, waited)
        if reason is not None:
            # Moved, a turn its replica may still be running waits on its claim wherever it goes;
            # only a holder judged gone from facts has its claim marked stopped (then the turn's
            # copy is run, or answered Interrupted, at once).
            if reason == "replica_gone" and taken and await _holder_gone(host, handle, replica, watches):
                await host.holder_stopped(handle, replica)
            if await host.move_to_shared(handle):
                host.metrics.affinity_fallbacks.labels(client_id=host.client_id, reason=reason).inc()
                probe_at = now + PROBE_S
                continue
            # Not withdrawn: answered meanwhile (the answer is on its way), or the broker did not
            # answer; the next look decides again (taken or not) rather than assume either.
            taken = await host.taken(handle)
        if taken and now >= probe_at:  # no responders means its connection is gone
            probe_at = now + PROBE_S
            host.probe(replica)


async def _requeue_if_holder_gone(host: TurnPlacement, handle: RolloutHandle, watches: dict[str, HolderWatch]) -> None:
    claim = await host.holder(handle)
    if claim is None:
        return  # not started anywhere (or answered): the pulls and the stall watch see to it
    status = host.fleet.replica(claim.worker_id)
    _heard(watches, claim.worker_id, status)
    if status is not None and status.is_live():
        if claim.process.startswith(f"{status.pid}-"):
            host.probe(claim.worker_id)  # alive by the registry; no responders marks it gone for the next look
            return
        # Another process of that replica wrote its entry: the holder was restarted, its run gone.
    elif not await _holder_gone(host, handle, claim.worker_id, watches):
        return
    if await host.holder_stopped(handle) and await host.requeue(handle):
        host.metrics.affinity_fallbacks.labels(client_id=host.client_id, reason="holder_gone").inc()


async def _holder_gone(
    host: TurnPlacement, handle: RolloutHandle, worker_id: str, watches: dict[str, HolderWatch]
) -> bool:
    """Whether the process of ``worker_id`` holding the turn is gone, by ``HolderWatch``'s verdict:
    the facts read now (this client's connection, the replica's registry entry, the claim) and,
    where they could tell, probes of its connection, a few spaced ones."""
    watch = watches.setdefault(worker_id, HolderWatch())
    for probes in range(1, GONE_PROBES + 1):
        watch.connection(host.connected_since())
        _heard(watches, worker_id, host.fleet.replica(worker_id))
        with suppress(Exception):  # (the broker away: the claim says nothing this time)
            watch.claim_read(await host.holder(handle, strict=True))
        now = time.time()
        verdict = watch.verdict(now)
        if verdict == "gone" or not watch.wants_probe(now):
            return verdict == "gone"
        listening = await host.listening(worker_id)
        watch.probed(now, listening)
        if listening is not False:
            return False  # answered, or the broker did not: the next look judges again
        if watch.verdict(time.time()) == "gone":
            return True
        if probes < GONE_PROBES:
            await asyncio.sleep(PROBE_SPACING_S)
    return False


def _heard(watches: dict[str, HolderWatch], worker_id: str, status: ReplicaStatus | None) -> None:
    if status is not None:
        watches.setdefault(worker_id, HolderWatch()).entry(status)


async def _claimed(host: TurnPlacement, handle: RolloutHandle) -> bool | None:
    """Whether a process claims the turn now (None: the broker did not say)."""
    try:
        return await host.holder(handle, strict=True) is not None
    except Exception:  # (the broker away: the next look decides)
        return None


def move_reason(
    status: ReplicaStatus | None, constraint: VersionConstraint, taken: bool, unclaimed_looks: int, waited: bool
) -> str | None:
    """Why a sticky turn must move off its replica now, or None while it stays. ``status``: the
    replica's registry entry; ``taken``: it was delivered the turn; ``unclaimed_looks``: looks in
    a row, a second apart, that found no process claiming it (a broker that did not say starts
    the count again); ``waited``: the turn has waited ``affinity_wait_s``. Unclaimed at
    ``UNCLAIMED_LOOKS`` looks is handed back: a replica claims a turn moments after its delivery."""
    if status is None or not status.is_live():
        return "replica_gone"
    if status.takes_now(constraint):
        if not taken:
            return "not_taken_in_time" if waited else None
        return "handed_back" if waited and unclaimed_looks >= UNCLAIMED_LOOKS else None
    if status.state in _LEAVING:
        return None if taken else "replica_leaving"
    return "replica_incompatible"  # live at a version that cannot serve it: it holds nothing of it
