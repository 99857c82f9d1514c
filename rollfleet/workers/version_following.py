"""Which committed version a replica moves to next: the pure rules behind ``VersionSync``.

Plain data in, a decision out, time as an argument (monotonic seconds); no I/O.

A version that failed on this replica (its prepare, staging or activation, or at start-up) is
tried again after a backoff, not only when a newer version is committed: many failures are
transient (a shard that was being rewritten, a store that answered an error, a read that timed
out), and a trainer that has stopped publishing would otherwise leave the replica one version
behind for good. The backoff doubles from ``FIRST_RETRY_S`` to ``MAX_RETRY_S`` per failure of
the same version, so a version that is broken for good costs one attempt a minute, and a newer
commit is followed at once, whatever failed before it.

A newest version that failed here lately is not waited for idly: the replica moves meanwhile to
the newest committed version between its own and that one which has not failed here
(``fall_back_to``), and tries the newest again at its retry.

A prepare that runs past its bound (a read that is slow, or never returns) is not a verdict on
the version: its thread goes on, holding the checkpoint directory it writes, and its work is kept.
While it runs, a serving replica keeps its version and moves nowhere (``follow``'s ``busy``); its
return wakes the follow loop, and a success clears the failure it was counted as
(``after_late_prepare``). A replica that serves nothing yet (``start_step``) tries the versions it
could serve newest first, each in a checkpoint directory no stuck prepare holds, serves the
first that materializes, and waits while one may still return: it gives up only when every
committed version failed, never because a read was slow.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Literal

from rollfleet.runtime.backoff import Backoff

FIRST_RETRY_S = 2.0
MAX_RETRY_S = 60.0
# A version that failed here, asked again: soon at first (most failures pass), then once a minute.
VERSION_RETRY = Backoff(first_s=FIRST_RETRY_S, max_s=MAX_RETRY_S)


@dataclass(frozen=True, slots=True)
class FailedVersion:
    """A version that failed on this replica: how often in a row, and when it may be tried again."""

    version: int
    failures: int
    retry_at: float  # monotonic seconds


@dataclass(frozen=True, slots=True)
class FollowDecision:
    """``target``: the version to move to now (None: none). ``wake_at``: when to look again
    although nothing was announced (a failed version's retry), None: only on the next notice."""

    target: int | None
    wake_at: float | None = None


def after_failure(
    previous: FailedVersion | None,
    version: int,
    now: float,
    *,
    retry: Backoff = VERSION_RETRY,
) -> FailedVersion:
    """The record of ``version`` failing at ``now``: one more failure in a row if it is the version
    that failed last, else the first."""
    failures = previous.failures + 1 if previous is not None and previous.version == version else 1
    return FailedVersion(version, failures, retry.retry_at(failures - 1, now))


def follow(
    latest: int | None, served: int, failed: FailedVersion | None, now: float, *, held: bool, busy: bool = False
) -> FollowDecision:
    """Where to go given the newest commit known (``latest``, None: unknown), the version served,
    the last failure here and the time; ``held``: the replica serves one version and no other;
    ``busy``: a prepare abandoned past its bound still holds the checkpoint (its return wakes the
    loop; trying again meanwhile could only fail, and back off, once per look)."""
    if held or busy or latest is None or latest <= served:
        return FollowDecision(None)
    if failed is not None and latest <= failed.version and now < failed.retry_at:
        return FollowDecision(None, wake_at=failed.retry_at)  # that version failed here lately
    return FollowDecision(latest)


def fall_back_to(older: Sequence[int], served: int, failures: Mapping[int, FailedVersion], now: float) -> int | None:
    """While the newest commit has failed here lately (``follow`` waits for its retry): the
    newest committed version between the one served and it (``older``, newest first, as
    ``fallback_versions`` lists them) that has not failed here lately, to serve meanwhile; None if
    none. A replica behind serves fewer of the trainer's requests than one a version or two below
    the newest (seed 366222: three replicas stayed at v13 for 19.5 s, the store hiding v21, v22's
    chain broken, v23 corrupt, while v19 and v20 were whole; nothing was served for 18.6 s). The
    newest is tried again at its retry, as before."""

    def cooling(version: int) -> bool:
        failed = failures.get(version)
        return failed is not None and now < failed.retry_at

    return next((v for v in older if v > served and not cooling(v)), None)


def after_late_prepare(failed: FailedVersion | None, version: int) -> FailedVersion | None:
    """The failure record once a prepare abandoned past its bound returned with ``version``
    materialized after all: a failure of that version or an older one is moot (the checkpoint
    holds it now, and the next prepare continues from it)."""
    return None if failed is None or failed.version <= version else failed


def fallback_versions(present: Iterable[int], latest: int, committed: Iterable[int]) -> list[int]:
    """The versions a replica that cannot serve ``latest`` at start-up tries instead, newest first:
    every one in the store below it (a retired one is not there to try) whose record says it was
    committed. A directory alone is not a version: a publisher killed before its commit leaves a
    complete one (and its record, without the mark) that the fleet must never serve."""
    return sorted({v for v in present if v < latest} & set(committed), reverse=True)


Attempt = Literal["running", "stuck", "failed", "done"]
"""How one start-up prepare went: within its bound, past it and still running, failed, materialized."""


@dataclass(frozen=True, slots=True)
class StartStep:
    """What a replica that serves nothing yet does next: ``try`` materializing ``version`` (in a
    checkpoint directory no prepare holds), ``serve`` ``version`` (it materialized), ``list`` the
    older committed versions it could fall back to, ``wait`` for a prepare still running, or
    ``give_up`` (every version it could serve failed: ``NoServableVersion``)."""

    action: Literal["try", "serve", "list", "wait", "give_up"]
    version: int | None = None


def start_step(latest: int, older: Sequence[int] | None, attempts: Mapping[int, Attempt], free_slots: int) -> StartStep:
    """The next step of a start-up: ``latest``, the version to start on; ``older``, the versions to
    fall back to, newest first (``fallback_versions``; None: not listed yet; empty for a held
    replica); ``attempts``, how each tried version went; ``free_slots``, the checkpoint
    directories no running prepare holds.

    The newest version that materialized is served at once, even while a newer one's prepare
    runs on (availability first; the follow loop takes the newer one later). A prepare within its
    bound is given its time; one past it no longer blocks the others, which are tried in another
    directory. Only when no attempt is left running and none untried is there nothing to serve."""
    done = [v for v, a in attempts.items() if a == "done"]
    if done:
        return StartStep("serve", max(done))
    if "running" in attempts.values():
        return StartStep("wait")
    if latest not in attempts:
        return StartStep("try", latest) if free_slots > 0 else StartStep("wait")
    if older is None:
        return StartStep("list")
    untried = [v for v in older if v not in attempts]
    if untried:  # (no free directory: a prepare holds each, and its return frees one)
        return StartStep("try", untried[0]) if free_slots > 0 else StartStep("wait")
    if "stuck" in attempts.values():
        return StartStep("wait")
    return StartStep("give_up")
