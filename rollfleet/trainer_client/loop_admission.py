"""Rules 2 and 3, what admission goes by: the trainer's latest version, whether a replica is at or
preparing it (and since when none is: the fresh version's grace), and whether the next batch will
be judged at latest. ``admission_room`` decides how many groups may be admitted, ``submit_floor``
which version new jobs ask for; ``Admission`` holds their inputs for ``loop_machine.LoopMachine``.
"""

from __future__ import annotations

from rollfleet.trainer_client.loop_config import LoopConfig


def admission_room(
    *,
    max_staleness: int,
    batch_groups: int,
    ready: int,
    in_flight: int,
    next_at_latest: bool = True,
    max_in_flight: int | None = None,
) -> int:
    """How many more groups may be admitted now (rule 2; never negative). ``in_flight``: groups
    admitted and not complete (generating, stopping or being scored); ``ready``: complete, not yet
    handed out. Dropped, filtered, failed and handed-out groups are in neither: their room is back.
    ``next_at_latest``: the next batch will be judged at the latest version (else the trainer may
    commit first, and one batch of room is held back). Nothing is ever admitted beyond the bound:
    every group held may complete at once, and one more than the batches left before its last
    chance would go stale."""
    batches = max_staleness + (1 if next_at_latest else 0)
    room = batches * batch_groups - (ready + in_flight)
    if max_in_flight is not None:
        room = min(room, max_in_flight - in_flight)
    return max(0, room)


def submit_floor(
    *, latest: int, first: int, max_staleness: int, fresh_served: bool, waited_s: float, grace_s: float
) -> int | None:
    """The minimum version new jobs ask for (rule 3): the trainer's latest once a replica is at or
    preparing it; None (wait) until then, for at most ``grace_s``; then ``max_staleness`` below it
    (never below the loop's first version)."""
    if fresh_served:
        return latest
    if waited_s < grace_s:
        return None
    return max(min(first, latest), latest - max_staleness)


class Admission:
    """The versions admission goes by, as the driver reports them (``version_seen``)."""

    def __init__(self, config: LoopConfig, first_version: int) -> None:
        self.config = config
        self.first_version = first_version
        self.latest = first_version
        self.fresh = True
        self._fresh_wait_since: float | None = None
        # Whether the next batch will be judged at ``latest``: False from a batch handed out until
        # the trainer asks again or a newer version is seen (rule 2).
        self.next_at_latest = True

    def version_seen(self, now: float, latest: int, fresh_served: bool) -> None:
        """The trainer's latest version, and whether a replica is at or preparing it."""
        if fresh_served:
            self._fresh_wait_since = None
        elif self._fresh_wait_since is None or latest > self.latest:
            self._fresh_wait_since = now  # (a newer version: its grace starts now)
        if latest > self.latest:
            self.next_at_latest = True
        self.latest = max(self.latest, latest)
        self.fresh = fresh_served

    def floor(self, now: float) -> int | None:
        waited = 0.0 if self._fresh_wait_since is None else now - self._fresh_wait_since
        return submit_floor(
            latest=self.latest,
            first=self.first_version,
            max_staleness=self.config.max_staleness,
            fresh_served=self.fresh,
            waited_s=waited,
            grace_s=self.config.activation_grace_s,
        )

    def room(self, *, ready: int, in_flight: int) -> int:
        cfg = self.config
        return admission_room(
            max_staleness=cfg.max_staleness,
            batch_groups=cfg.batch_groups,
            ready=ready,
            in_flight=in_flight,
            next_at_latest=self.next_at_latest,
            max_in_flight=cfg.max_in_flight,
        )
