"""A cancel heard before its job's delivery registered its run is kept a while (campaign seed
2024: handled first on waking from a freeze, it found nothing running, and the job ran to its
end for a caller long gone). Pure: time is an argument."""

from __future__ import annotations

from rollfleet.workers.recent_cancels import RecentCancels


def test_a_cancel_heard_before_its_run_cancels_the_run_registered_within_its_ttl() -> None:
    book = RecentCancels(ttl_s=60.0)
    book.note("digest-a", now=100.0)
    assert not book.taken("digest-b", now=100.5)  # another job's delivery runs
    assert book.taken("digest-a", now=100.5)
    assert not book.taken("digest-a", now=100.6)  # taken once: a later delivery of it is not held


def test_a_cancel_is_forgotten_after_its_ttl_and_the_book_stays_bounded() -> None:
    book = RecentCancels(ttl_s=60.0, max_kept=3)
    book.note("old", now=0.0)
    assert not book.taken("old", now=60.5)
    for i in range(10):  # (anyone may publish digests: the oldest go first)
        book.note(f"d{i}", now=100.0 + i)
    assert [book.taken(f"d{i}", now=110.0) for i in range(10)] == [False] * 7 + [True] * 3
