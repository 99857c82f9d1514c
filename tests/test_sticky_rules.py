"""When a session's turn moves off the replica holding its context (``sessions.sticky``), and
whether the process holding a turn is gone (``placement_rules.HolderWatch``), decided without
I/O (milliseconds)."""

from __future__ import annotations

import time

from rollfleet.schemas import ReplicaStatus, VersionConstraint
from rollfleet.trainer_client.placement_rules import GONE_PROBES, PROBE_SPACING_S, REDIAL_S, HolderWatch
from rollfleet.trainer_client.sessions.sticky import UNCLAIMED_LOOKS, move_reason


def _replica(state: str = "ready", version: int = 13, *, stale: bool = False) -> ReplicaStatus:
    now = time.time()
    return ReplicaStatus(
        worker_id="w6", state=state, active_version=version, engine="echo", capacity=3, in_flight=0,  # type: ignore[arg-type]
        heartbeat_at=now - (60.0 if stale else 0.0), heartbeat_interval_s=1.0, started_at=now - 100.0,
    )  # fmt: skip


EXACT = VersionConstraint("exact", 13)


def test_a_turn_stays_while_its_replica_may_still_take_it_or_runs_it() -> None:
    assert move_reason(_replica(), EXACT, taken=False, unclaimed_looks=0, waited=False) is None
    assert move_reason(_replica(), EXACT, taken=True, unclaimed_looks=0, waited=True) is None  # claimed: running
    # one look unclaimed: it may be claimed a moment after its delivery
    assert move_reason(_replica(), EXACT, taken=True, unclaimed_looks=UNCLAIMED_LOOKS - 1, waited=True) is None
    assert move_reason(_replica("draining"), EXACT, taken=True, unclaimed_looks=0, waited=True) is None


def test_a_turn_delivered_but_claimed_by_nobody_moves_once_it_has_waited() -> None:
    # Campaign 8, seed 103: the replica handed the turn back (not at v13 yet), then activated v13
    # but never took it again; the turn waited on its subject until it expired.
    assert move_reason(_replica(), EXACT, taken=True, unclaimed_looks=UNCLAIMED_LOOKS, waited=True) == "handed_back"
    assert move_reason(_replica(), EXACT, taken=True, unclaimed_looks=UNCLAIMED_LOOKS, waited=False) is None


def test_a_turn_moves_off_a_gone_leaving_or_incompatible_replica() -> None:
    assert move_reason(None, EXACT, taken=True, unclaimed_looks=0, waited=False) == "replica_gone"
    assert move_reason(_replica(stale=True), EXACT, taken=True, unclaimed_looks=0, waited=False) == "replica_gone"
    assert move_reason(_replica("draining"), EXACT, taken=False, unclaimed_looks=0, waited=False) == "replica_leaving"
    moved_on = _replica(version=14)
    assert move_reason(moved_on, EXACT, taken=True, unclaimed_looks=0, waited=False) == "replica_incompatible"
    assert move_reason(_replica(), EXACT, taken=False, unclaimed_looks=0, waited=True) == "not_taken_in_time"


# -- whether a holder is gone (``placement_rules.HolderWatch``), as sequences of facts -------------


def _entry(heartbeat_at: float, interval_s: float = 0.5) -> ReplicaStatus:
    return ReplicaStatus(
        worker_id="w6", state="ready", active_version=13, engine="echo", capacity=3, in_flight=1,
        heartbeat_at=heartbeat_at, heartbeat_interval_s=interval_s, started_at=0.0,
    )  # fmt: skip


def _watch(since: float | None, heard_at: float) -> HolderWatch:
    watch = HolderWatch()
    watch.entry(_entry(heard_at))
    watch.connection(since)
    return watch


def test_a_holder_is_not_judged_before_it_could_have_dialed_again_after_an_outage() -> None:
    # The campaign's case: the broker was away; this client is back at 100.0, the holder's last
    # write was heard at 98.0 (stale, as every replica's is), and its bell is silent because it
    # redials a moment after this client. No verdict before 100 + REDIAL_S + a heartbeat.
    watch = _watch(since=100.0, heard_at=98.0)
    start = 100.0 + REDIAL_S + 0.5
    assert watch.judging_from() == start
    assert not watch.wants_probe(100.05)
    for t in (100.04, 100.27, 100.5):  # probes made anyway count for nothing
        watch.probed(t, listening=False)
    assert watch.verdict(100.6) == "unsure"
    watch.entry(_entry(100.9))  # it is back: its registry write heard after this client's return
    assert watch.verdict(101.0) == "alive"
    assert watch.verdict(start + 5.0) == "unsure"  # (a write is life only within its staleness)


def test_a_holder_that_never_comes_back_is_gone_after_repeated_probes() -> None:
    watch = _watch(since=100.0, heard_at=98.0)
    start = watch.judging_from()
    assert start is not None and watch.wants_probe(start)
    watch.probed(start, listening=False)
    assert watch.verdict(start) == "unsure"  # one probe is not enough
    assert not watch.wants_probe(start + PROBE_SPACING_S / 2)  # (spaced)
    assert watch.wants_probe(start + PROBE_SPACING_S)
    watch.probed(start + PROBE_SPACING_S, listening=False)
    assert GONE_PROBES == 2 and watch.verdict(start + PROBE_SPACING_S) == "gone"


def test_a_holder_is_never_judged_while_this_client_is_cut_off() -> None:
    watch = _watch(since=0.0, heard_at=90.0)
    watch.probed(100.0, listening=False)
    watch.connection(None)  # the broker away: probes found no responders (nobody could answer)
    watch.probed(100.3, listening=False)
    assert watch.verdict(100.5) == "unsure" and not watch.wants_probe(100.5)
    watch.connection(103.0)  # back: the count starts again, after the grace
    assert watch.silent == [] and watch.verdict(103.1) == "unsure"


def test_a_sign_of_life_between_probes_starts_the_count_again() -> None:
    # Connected all along (no outage): a replica that stopped writing is judged by probes alone.
    watch = _watch(since=0.0, heard_at=90.0)
    watch.probed(100.0, listening=False)
    watch.probed(100.3, listening=True)  # it answered (a slow link, not a dead one)
    watch.probed(100.6, listening=False)
    assert watch.verdict(100.6) == "unsure"
    watch.probed(100.9, listening=None)  # the broker did not answer: says nothing
    assert watch.verdict(100.9) == "unsure"
    watch.claim_read(("w6:1-a", 100.0))
    watch.claim_read(("w6:1-a", 101.0))  # its holder refreshed its claim: alive then
    watch.probed(101.2, listening=False)
    assert watch.verdict(101.2) == "unsure"
    watch.probed(101.5, listening=False)
    assert watch.verdict(101.5) == "gone"
    watch.entry(_entry(101.6))  # a registry write after all: the count starts again
    assert watch.silent == [] and watch.verdict(101.7) == "alive"


def test_probes_unanswered_after_its_last_write_outweigh_that_write() -> None:
    # Connected all along; the replica wrote 0.5 s ago and was then SIGKILLed: the broker says
    # nobody holds its connection, twice. Its fresh entry does not keep it alive (a dead one costs
    # about a second, as before).
    watch = _watch(since=0.0, heard_at=99.5)
    assert watch.verdict(100.0) == "alive"
    watch.probed(100.0, listening=False)
    watch.probed(100.25, listening=False)
    assert watch.verdict(100.25) == "gone"
