"""The client's watch rules (``trainer_client.watch_rules``), as pure functions: deadlines, the
withdrawal of exact jobs nobody can serve, how many replicas a stalled subject wakes, and what
a withdrawn job does next (``trainer_client.placement_rules``).
Milliseconds; the process tests (test_versions, test_pull) show the loops carry them out."""

from __future__ import annotations

import itertools

from hypothesis import given
from hypothesis import strategies as st

from rollfleet.broker.connection import logs_in
from rollfleet.broker.topology import topology_step
from rollfleet.schemas import VersionConstraint
from rollfleet.schemas.bell_wire import BELL_WAITED_HEADER, BELL_WAITED_MAX_S, bell_waited_headers, bell_waited_s
from rollfleet.trainer_client.job_watch_rules import (
    ORPHAN_GRACE_S,
    STALL_BELLS_MAX,
    STALL_JOBS_PER_BELL,
    OrphanWatch,
    expired,
    queued_since,
    stall_bells,
    stalled_since,
)
from rollfleet.trainer_client.placement_rules import after_withdrawal


def test_a_deadline_passes_only_after_its_grace() -> None:
    deadlines = [("early", 100.0), ("edge", 102.0), ("late", 102.5)]
    assert expired(deadlines, now=104.0, grace_s=2.0) == ["early", "edge"]
    assert expired(deadlines, now=101.9, grace_s=2.0) == []


@given(st.integers(0, 5), st.integers(0, 10_000), st.integers(0, 50))
def test_stall_bells_ring_one_replica_per_few_waiting_jobs_bounded(waiting: int, pending: int, acked: int) -> None:
    bells = stall_bells(waiting, pending, acked)
    if waiting:
        assert bells == 0  # a replica is already asking there
        return
    stuck = pending + (acked > 0)
    assert 0 <= bells <= STALL_BELLS_MAX
    assert (bells == 0) == (stuck == 0)
    if bells < STALL_BELLS_MAX:  # enough replicas for every job (each pulls a few), no more
        assert (bells - 1) * STALL_JOBS_PER_BELL < stuck <= bells * STALL_JOBS_PER_BELL


def test_an_exact_job_nobody_can_serve_is_withdrawn_after_the_grace_then_looked_at_again() -> None:
    w = OrphanWatch()
    assert w.verdict("k", servable=False, holders=[], now=10.0) == "waiting"
    assert w.verdict("k", servable=False, holders=[], now=10.0 + ORPHAN_GRACE_S - 0.01) == "waiting"
    assert w.verdict("k", servable=False, holders=[], now=10.0 + ORPHAN_GRACE_S) == "withdraw"
    # Could not be withdrawn (the broker away): another full grace before the next try.
    assert w.verdict("k", servable=False, holders=[], now=10.0 + ORPHAN_GRACE_S + 1.0) == "waiting"
    assert w.verdict("k", servable=False, holders=[], now=10.0 + 2 * ORPHAN_GRACE_S) == "withdraw"


def test_a_replica_that_can_serve_it_again_resets_the_grace() -> None:
    w = OrphanWatch()
    assert w.verdict("k", servable=False, holders=[], now=0.0) == "waiting"
    assert w.verdict("k", servable=True, holders=[], now=1.5) == "servable"
    assert w.verdict("k", servable=False, holders=[], now=2.5) == "waiting"  # counted from 2.5, not 0
    assert w.verdict("k", servable=False, holders=[], now=2.5 + ORPHAN_GRACE_S) == "withdraw"


def test_a_job_a_draining_replica_may_hold_waits_for_it_and_the_grace_starts_when_it_is_gone() -> None:
    w = OrphanWatch()
    for t in (0.0, 5.0, 30.0):  # an activation draining its exact jobs, for as long as it takes
        assert w.verdict("k", servable=False, holders=["w1"], now=t) == "held"
    assert w.verdict("k", servable=False, holders=[], now=31.0) == "waiting"
    assert w.verdict("k", servable=False, holders=[], now=31.0 + ORPHAN_GRACE_S) == "withdraw"


def test_a_job_whose_caller_waits_for_a_replica_is_never_withdrawn_and_says_its_demand() -> None:
    """``submit(..., wait_for_replica=True)``: the job stays queued until its deadline, each look
    says ``wants_replica`` (the watch then says its demand again); once a replica can serve it,
    or holds it, that verdict wins as for any job."""
    w = OrphanWatch()
    for t in (0.0, ORPHAN_GRACE_S, 10 * ORPHAN_GRACE_S, 1e6):
        assert w.verdict("k", servable=False, holders=[], now=t, waits_for_replica=True) == "wants_replica"
    assert w.verdict("k", servable=False, holders=["w1"], now=1e6, waits_for_replica=True) == "held"
    assert w.verdict("k", servable=True, holders=[], now=1e6, waits_for_replica=True) == "servable"
    # (a job that does not wait, looked at beside it, is withdrawn after its grace as before)
    assert w.verdict("other", servable=False, holders=[], now=0.0) == "waiting"
    assert w.verdict("other", servable=False, holders=[], now=ORPHAN_GRACE_S) == "withdraw"


def test_whether_a_holder_may_hold_the_job_is_asked_at_most_once_a_probe_interval() -> None:
    w = OrphanWatch(probe_s=1.0)
    assert w.may_be_held("k")  # not asked yet: it may
    assert w.hold_check_due("k", 100.0)
    w.checked("k", 100.0, False)
    assert not w.may_be_held("k")
    assert not w.hold_check_due("k", 100.9)
    assert w.hold_check_due("k", 101.0)
    w.checked("k", 101.0, True)
    assert w.may_be_held("k")


def test_each_holder_is_probed_at_most_once_a_probe_interval_across_jobs() -> None:
    w = OrphanWatch(probe_s=1.0)
    assert w.probes_due(["w1", "w2"], 0.0) == ["w1", "w2"]
    assert w.probes_due(["w1", "w3"], 0.5) == ["w3"]  # w1 was probed for another job just now
    assert w.probes_due(["w1", "w2", "w3"], 1.0) == ["w1", "w2"]


def test_jobs_no_longer_pending_are_forgotten() -> None:
    w = OrphanWatch()
    w.verdict("gone", servable=False, holders=[], now=0.0)
    w.checked("gone", 0.0, False)
    w.verdict("kept", servable=False, holders=[], now=0.0)
    w.keep_only({"kept"})
    assert w.may_be_held("gone")  # asked again from scratch if it ever came back
    assert w.verdict("gone", servable=False, holders=[], now=ORPHAN_GRACE_S) == "waiting"
    assert w.verdict("kept", servable=False, holders=[], now=ORPHAN_GRACE_S) == "withdraw"


def test_a_pinned_sessions_version_may_be_served_only_by_a_replica_that_can_still_reach_it() -> None:
    from rollfleet.trainer_client.sessions.version_policy import pin_may_be_served

    # At the pin: serving, or its engine down (it may come back), but not stopping for good.
    assert pin_may_be_served([("ready", 5, None)], 5, 7)
    assert pin_may_be_served([("down", 5, None)], 5, 7)
    assert not pin_may_be_served([("draining", 5, None)], 5, 7)
    assert pin_may_be_served([("preparing", 4, 5)], 5, 5)
    # At it and preparing a newer one: a failed prepare keeps it there; once activating the newer
    # one (prepared, no more exact jobs for the pin) it is leaving for good.
    assert pin_may_be_served([("preparing", 5, 7)], 5, 7)
    assert not pin_may_be_served([("activating", 5, 7)], 5, 7)
    assert pin_may_be_served([("activating", 4, 5)], 5, 5)  # activating the pin itself
    # Behind it: only while it is the newest commit (a replica catching up goes to the newest).
    assert pin_may_be_served([("starting", 0, None)], 5, 5)
    # A starting replica's active version 0 is a placeholder: it serves nothing yet and catches
    # up to the newest commit (or prepares what it is held at), so it never serves a pin of 0
    # once newer versions exist (seed 101: "fleet: w2@0" called retryable).
    assert not pin_may_be_served([("starting", 0, None)], 0, 7)
    assert not pin_may_be_served([("starting", 0, 7)], 0, 7)
    assert pin_may_be_served([("starting", 0, 0)], 0, 7)  # held at it (rollfleet worker --hold-version 0)
    assert pin_may_be_served([("starting", 0, None)], 0, 0)
    assert not pin_may_be_served([("down", 0, None), ("ready", 7, None), ("ready", 7, None)], 5, 7)
    # Past it: never (versions only move forward).
    assert not pin_may_be_served([("ready", 6, None), ("preparing", 6, 7)], 5, 7)


def test_a_withdrawn_job_is_stored_again_only_when_it_was_removed_or_lost_unanswered() -> None:
    """Every case of ``after_withdrawal``: removed by this call, stored again; gone (answered, or
    lost with the broker's store), ask whether it was answered first; not known, or the handle
    settled meanwhile, or no way to ask, left where it is."""
    for outcome, settled, can_ask in itertools.product(("removed", "gone", "unknown"), (False, True), (False, True)):
        decision = after_withdrawal(outcome, settled, can_ask)  # type: ignore[arg-type]
        if outcome == "removed":
            assert decision == "store_again"
        elif outcome == "gone" and not settled and can_ask:
            assert decision == "ask_if_answered"
        else:
            assert decision == "leave", (outcome, settled, can_ask)


def test_a_starting_worker_declares_only_a_namespace_never_declared_or_long_lost() -> None:
    assert topology_step(0, 8, 0.0, False, 30.0) == "ready"
    assert topology_step(8, 8, 0.0, False, 30.0) == "declare"  # a bare broker: the worker came first
    assert topology_step(1, 8, 0.0, False, 30.0) == "wait"  # lost with the store: a trainer declares it
    assert topology_step(1, 8, 29.9, False, 30.0) == "wait"
    assert topology_step(1, 8, 30.0, False, 30.0) == "declare"
    assert topology_step(8, 8, 60.0, True, 30.0) == "wait"  # tried and refused: a trainer must
    # A worker logged in as a user gives a trainer a moment first: all of it missing may be a
    # wiped broker, and its own declaration would be refused (campaign seed 3).
    assert topology_step(8, 8, 4.9, False, 30.0, 5.0) == "wait"
    assert topology_step(8, 8, 5.0, False, 30.0, 5.0) == "declare"
    assert topology_step(1, 8, 5.0, False, 30.0, 5.0) == "wait"
    # Who logs in: a user in the URL (of any server of a cluster's list), a token, a creds file.
    assert logs_in("nats://a:4222,nats://w3:pw@b:4222", {}) and logs_in("nats://a:4222", {"token": "t"})
    assert logs_in("nats://a:4222", {"creds_file": "/x.creds"}) and not logs_in("nats://a:4222,nats://b:4222", {})


def test_a_stalled_subject_is_rung_with_the_wait_of_its_oldest_job() -> None:
    """The stall watch rings, per subject, with how long its oldest unanswered job has waited
    (by this client's clock: submitted and now alike), so a replica hearing of it late ages it
    by that wait (``SubjectScheduler.note_pending``), not from the bell."""
    old, new, turn = VersionConstraint("min", 0), VersionConstraint("min", 33), VersionConstraint("exact", 35)
    jobs = [(old, 90.0, None), (old, 94.0, None), (new, 99.5, None), (turn, 80.0, "w2"), (new, 95.0, None)]
    # (a job stored under a second ago is not stalled yet; a sticky turn is watched apart)
    assert stalled_since(jobs, now=100.0, after_s=1.0) == {old: 90.0, new: 95.0}
    assert stalled_since(jobs, now=95.5, after_s=1.0) == {old: 90.0}


def test_a_stalled_bell_says_the_wait_of_the_oldest_job_still_queued_not_of_one_a_replica_runs() -> None:
    """Seed 101 of a campaign: a long job a replica ran for 16 s kept ``min-0``'s oldest unanswered
    job 16 s old, so the bells for it made the woken replicas drain ``min-0``'s newer jobs first
    while a turn on ``min-13`` expired. A job stored after the consumer's delivered floor was
    never delivered (it delivers in stream order): only those are queued work."""
    jobs = [(10.0, 5), (30.0, 9), (20.0, 12), (40.0, None)]  # (submitted at, stream sequence)
    assert queued_since(jobs, delivered_floor=9) == 20.0  # 5 and 9 were delivered (run, or held)
    assert queued_since(jobs, delivered_floor=4) == 10.0
    assert queued_since(jobs, delivered_floor=12) is None  # all delivered: the caller keeps its own
    assert queued_since([], delivered_floor=0) is None


def test_a_bells_wait_crosses_the_wire_as_a_header_old_workers_ignore() -> None:
    headers = bell_waited_headers(6.25)
    assert headers == {BELL_WAITED_HEADER: "6250"}
    assert bell_waited_s(headers) == 6.25
    assert bell_waited_headers(0.0) is None  # (a fresh job's bell carries nothing)
    for bad in (None, {}, {BELL_WAITED_HEADER: "x"}, {BELL_WAITED_HEADER: "-5"}):
        assert bell_waited_s(bad) == 0.0
    assert bell_waited_s({BELL_WAITED_HEADER: str(10**12)}) == BELL_WAITED_MAX_S
