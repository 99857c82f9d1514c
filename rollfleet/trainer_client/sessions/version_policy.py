"""A session's version policy: which versions a turn may be served at.

``pinned``: every turn exactly at the version of the first (the newest a live replica serves
when the session starts); ``monotonic``: each turn at a version at least that of the previous
turn's last token; ``free``: each turn by the session's constraint alone. A turn may carry its
own constraint; the policy narrows it, never widens it: a turn is never answered outside what it
asked. A pinned session whose version no live replica serves any more fails before its turn is
spent, and says whether waiting could help (``pin_may_be_served``).

The rules read the session's record and the client's view of the fleet; the record's version
(``last_version``) is the only thing they change.
"""

from __future__ import annotations

from rollfleet.schemas import RolloutResult, SessionRecord, VersionConstraint
from rollfleet.schemas.asked import AskedConstraint
from rollfleet.schemas.errors import InvalidRequest, NoCompatibleReplica, RollfleetError
from rollfleet.schemas.messages import refuses_while_activating
from rollfleet.trainer_client.fleet import FleetView

POLICIES = ("pinned", "monotonic", "free")


def session_asked(r: SessionRecord) -> AskedConstraint:
    """The session's own constraint, as its record keeps it (checked when it was opened)."""
    return AskedConstraint.of(r.min_version, r.exact_version, r.max_staleness)


def written(r: SessionRecord, own: AskedConstraint | None = None) -> str:
    """The turn's request as its caller wrote it: the session's settings, or the turn's own
    constraint (for the fingerprint: a key asked again with another constraint is another request)."""
    return f"session:{r.version_policy}:{(own or session_asked(r)).written}"


def turn_constraint(
    r: SessionRecord, own: AskedConstraint | None, fleet: FleetView, latest: int | None
) -> VersionConstraint:
    """The turn's constraint: its own (else the session's), under the version policy. The
    policy narrows it, never widens it: a turn is never answered outside what it asked."""
    base = (own or session_asked(r)).resolve(latest)
    if r.version_policy == "pinned":
        if r.last_version is None:
            r.last_version = pin_version(base, fleet)
        if own is not None and not base.allows(r.last_version):  # (the session's own moved on with latest)
            raise InvalidRequest(f"session {r.session_id!r} is pinned to version {r.last_version}, "
                                 f"which this turn's constraint {base} does not allow")  # fmt: skip
        check_pin_served(r.session_id, r.last_version, fleet)
        return VersionConstraint("exact", r.last_version)
    if r.version_policy == "monotonic" and r.last_version is not None:
        if base.kind == "min":
            return VersionConstraint("min", max(base.version, r.last_version))
        if base.version < r.last_version:  # (an exact turn older than the session has gone)
            raise InvalidRequest(f"session {r.session_id!r} is monotonic and its last turn ran at "
                                 f"version {r.last_version}: a turn cannot ask for {base}")  # fmt: skip
    return base


def asked_again_constraint(r: SessionRecord, own: AskedConstraint | None, latest: int | None) -> VersionConstraint:
    """A turn asked again under the caller's key, if its job must be built again (its job and
    answer gone): at the constraint as asked, or at the pin; the policy's floor has moved with
    the turns since, and is not this turn's."""
    constraint = (own or session_asked(r)).resolve(latest)
    if r.version_policy == "pinned" and r.last_version is not None:
        constraint = VersionConstraint("exact", r.last_version)
    return constraint


def note_served(r: SessionRecord, result: RolloutResult) -> None:
    """Where the session's context is cached now, and the version its policy holds it to."""
    r.replica = result.worker_id
    if r.version_policy == "monotonic":
        r.last_version = max(r.last_version or 0, result.version_end)
    elif r.version_policy == "pinned":
        # The pin is the version its turns were served at: a resumed session's first turn
        # may be the one a dead client stored, pinned to the newest version of its moment
        # (its pin was never saved); this handle's own guess yields to it.
        r.last_version = result.version_end


def pin_version(base: VersionConstraint, fleet: FleetView) -> int:
    """A pinned session's version: the newest a live replica serves within the constraint."""
    if base.kind == "exact":
        return base.version
    serving = [r.active_version for r in fleet.compatible(base) if base.allows(r.active_version)]
    if not serving:
        raise NoCompatibleReplica(f"no live replica serves a version allowed by {base} to pin the session to")
    return max(serving)


def check_pin_served(session_id: str, pin: int, fleet: FleetView) -> None:
    """A pinned session whose version no live replica serves any more fails here, before its
    turn is spent, with an error that says so. Replicas only move forward: once every live
    replica is past the pin, or behind it while a newer version is committed (a replica
    catching up goes to the newest), it is hopeless (not retryable) unless an operator starts
    one held at that version (``rollfleet worker --hold-version``): ``pin_may_be_served``."""
    if fleet.compatible(VersionConstraint("exact", pin)):
        return
    live = fleet.replicas()
    hopeless = bool(live) and not pin_may_be_served(
        [(r.state, r.active_version, r.preparing_version) for r in live], pin, fleet.latest_version
    )
    seen = ", ".join(f"{r.worker_id}@{r.active_version}" for r in live) or "empty"
    err = NoCompatibleReplica(
        f"session {session_id!r} is pinned to version {pin} (version_policy='pinned'), and no live "
        f"replica serves version {pin} (fleet: {seen}). "
        + (
            f"Every replica has moved past it: start one held at it (rollfleet worker --store STORE "
            f"--hold-version {pin}) to finish this session, or open a new session."
            if hopeless
            else f"A replica at version {pin} may come back; retry, or start one held at it "
            f"(rollfleet worker --store STORE --hold-version {pin})."
        )
    )
    err.retryable = not hopeless
    raise err


def explained(r: SessionRecord, exc: RollfleetError, fleet: FleetView) -> RollfleetError:
    """A pinned session's turn refused or withdrawn for want of a replica at its pin (the fleet
    moved on between the check and the submit, or while the turn waited) says so, as the
    check before the turn does; any other error as it is."""
    pinned_to = r.last_version
    if r.version_policy != "pinned" or pinned_to is None or not isinstance(exc, NoCompatibleReplica):
        return exc
    try:
        check_pin_served(r.session_id, pinned_to, fleet)
    except NoCompatibleReplica as pinned:
        return pinned
    return exc


def pin_may_be_served(replicas: list[tuple[str, int, int | None]], pin: int, latest: int | None) -> bool:
    """Whether a live replica (state, active version, preparing version) may yet serve a pinned
    session's version: one at it that is neither stopping nor activating a newer one (its engine
    down, or preparing: a failed prepare keeps it at the pin), one preparing it, or one behind it
    while it is the newest commit (catching up to it). A replica past it never comes back
    (versions only move forward), nor does one behind it once a newer version is committed (a
    replica catching up goes to the newest), nor one at it that is activating a newer version
    (it has prepared it and takes no more exact jobs for the pin: only a failing engine load would
    leave it there, a guess no caller should wait on; campaign 12, seed 211). A starting replica
    serves no version yet: only what it prepares, or catching up, counts."""
    for state, active, preparing in replicas:
        if state == "starting":
            active = -1  # (its active version is a placeholder: it serves nothing yet, see ``can_serve``)
        # (a pinned turn is an exact job: the rule for those while activating is the replicas' own)
        leaving = state == "draining" or (state == "activating" and refuses_while_activating("exact"))
        if active == pin and not leaving:
            return True
        if preparing == pin:
            return True
        if active < pin and (latest is None or latest <= pin):
            return True
    return False
