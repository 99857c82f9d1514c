"""Version-constrained routing: each job is served only by a compatible replica."""

from __future__ import annotations

import pytest

from harness import running_worker
from rollfleet.schemas.errors import NoCompatibleReplica
from rollfleet.trainer_client import RolloutClient
from rollfleet.workers.scheduler import SubjectScheduler
from rollfleet.workers.served_version import ServedVersion, compatible
from tests.helpers import payload


async def test_jobs_reach_only_compatible_workers(nats_url: str, namespace: str) -> None:
    async with (
        running_worker(nats_url, namespace, version=2, worker_id="v2") as w2,
        running_worker(nats_url, namespace, version=5, worker_id="v5") as w5,
        await RolloutClient.connect(nats_url, namespace=namespace, client_id="trainer") as client,
    ):
        cases = {
            "min1": dict(min_version=1),
            "min4": dict(min_version=4),
            "exact2": dict(exact_version=2),
            "exact5": dict(exact_version=5),
        }
        handles = {name: await client.submit(payload(), idempotency_key=name, **kw) for name, kw in cases.items()}
        # Many jobs at min 1 so both workers get some; each must still be compatible.
        many = [await client.submit(payload(), min_version=1) for _ in range(20)]
        results = {name: await h.result(15) for name, h in handles.items()}
        assert results["min4"].worker_id == "v5" and results["min4"].version_start == 5
        assert results["exact2"].worker_id == "v2" and results["exact2"].version_start == 2
        assert results["exact5"].worker_id == "v5" and results["exact5"].version_end == 5
        assert results["min1"].version_start >= 1
        for r in [await h.result(15) for h in many]:
            assert r.version_start >= 1 and r.worker_id in ("v2", "v5")
        exact3 = await client.submit(payload(), exact_version=3)
        with pytest.raises(NoCompatibleReplica) as info:
            await exact3.result(5)
        assert info.value.retryable
        assert w2.jobs_done + w5.jobs_done == 24  # exact 3 ran nowhere


def test_worker_subjects_are_exact_w_and_min_up_to_w() -> None:
    assert compatible(5, ("exact", 5)) and not compatible(5, ("exact", 4)) and not compatible(5, ("exact", 6))
    assert compatible(5, ("min", 0)) and compatible(5, ("min", 5)) and not compatible(5, ("min", 6))


def test_scheduler_prefers_constrained_work_and_ages_loose_work() -> None:
    served = ServedVersion(5)
    s = SubjectScheduler(served, aging_s=2.0)
    for subject in [("min", 1), ("exact", 5), ("min", 4), ("exact", 3), ("min", 7)]:
        s.note_pending(subject, now=0.0)  # type: ignore[arg-type]
    # exact-3 and min-7 are not ours; exact first, then the highest min
    assert s.order(now=1.0) == [("exact", 5), ("min", 4), ("min", 1)]
    s.note_served(("exact", 5), now=1.0)
    s.note_served(("min", 4), now=1.0)
    # min-1 has waited 2.5 s (> aging_s) while tighter work kept being served: it goes first
    assert s.starving(now=2.5) and not s.starving(now=1.5)
    assert s.order(now=2.5)[0] == ("min", 1)
    # ...and keeps its place after a pull while more waits there (what is behind is as old),
    # instead of one job per aging_s behind the tighter work
    s.note_served(("min", 1), now=2.6)
    assert s.order(now=2.7)[0] == ("min", 1)
    s.note_empty(("min", 1))
    assert ("min", 1) not in s.order(now=3.0)
    served.version = 6  # version 6 was activated and announced
    s.note_pending(("exact", 5), now=3.0)
    assert ("exact", 5) not in s.order(now=3.0)


def test_work_a_replica_hears_of_late_is_aged_by_its_own_wait() -> None:
    """A job that waited 6 s on a subject outside every window before this replica heard of it
    (the bells went to replicas that died, or it just started; campaign seed 747109: a turn moved
    to ``min-0`` expired behind ``min-33`` and exact turns submitted after it) is starving the
    moment the client's stalled bell says how long it has waited: it goes before newer, tighter
    work heard at the same moment, not ``aging_s`` later."""
    s = SubjectScheduler(ServedVersion(35), aging_s=5.0)
    s.note_pending(("min", 33), now=100.0)  # newer work in the window
    s.note_pending(("min", 0), now=100.0, waited_s=6.0)  # the client's bell: it waited 6 s
    assert s.starving(now=100.0)
    assert s.order(now=100.0) == [("min", 0), ("min", 33)]
    # A later bell never makes the subject younger; a longer wait heard later makes it older.
    s.note_pending(("min", 0), now=101.0, waited_s=0.5)
    s.note_pending(("min", 33), now=101.0, waited_s=9.0)
    assert s.order(now=101.0) == [("min", 33), ("min", 0)]
    # Nonsense from the wire (negative) counts as no wait.
    s.note_pending(("min", 1), now=101.0, waited_s=-50.0)
    assert s.order(now=101.0)[-1] == ("min", 1)


def test_a_starving_subject_gives_way_once_what_it_serves_is_newer_than_an_older_subjects_work() -> None:
    """Seed 101 of a campaign: a replica drained ``min-0`` (starving: a resubmitted job there had
    waited long) job after job, newer ones included, while a turn moved to ``min-13`` 37 s into
    the run waited behind them until it expired. A delivery says how old the job it brings was
    (its stored time) and whether more wait behind it; those were stored no earlier, so the
    subject's age becomes that job's: the older subject goes next."""
    s = SubjectScheduler(ServedVersion(15), aging_s=5.0)
    s.note_pending(("min", 0), now=100.0, waited_s=30.0)  # a resubmitted job, long waiting
    s.note_pending(("min", 13), now=100.0, waited_s=6.0)  # the moved turn's subject
    assert s.order(now=100.0) == [("min", 0), ("min", 13)]
    # The old job is pulled; behind it, jobs stored 2 s ago at most.
    s.note_delivered(("min", 0), now=100.1, age_s=2.0, pending=3)
    s.note_served(("min", 0), now=100.0)  # (the pull that brought it: its delivery's word stands)
    assert s.order(now=100.2) == [("min", 13), ("min", 0)]
    # A delivery whose queue is as old keeps its place (one job per aging_s would starve it).
    s.note_delivered(("min", 13), now=100.3, age_s=6.2, pending=2)
    assert s.order(now=100.4)[0] == ("min", 13)
    # The last job of a subject: it is empty, and the pull's own note does not bring it back.
    s.note_delivered(("min", 13), now=100.5, age_s=6.3, pending=0)
    s.note_served(("min", 13), now=100.4)
    assert s.order(now=100.6) == [("min", 0)]
    # A clock behind the broker's (a negative age) counts as no wait.
    s.note_delivered(("min", 0), now=100.7, age_s=-3.0, pending=1)
    assert not s.starving(now=100.8)
