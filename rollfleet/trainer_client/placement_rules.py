"""A client's decisions about where a job lies, made without I/O; ``placement.JobPlacement`` and
``sessions.sticky`` carry them out against the broker.

- ``after_withdrawal``: what to do with a job it tried to withdraw: store it again elsewhere,
  leave it where it is, or first ask whether it was answered.
- ``HolderWatch``: whether the process holding a job (a replica running a session's turn) is
  gone, so that its claim may be marked stopped and the job stored again. A verdict of "gone"
  on a live holder runs an ``at_most_once`` job's copy as ``Interrupted`` (or a replayable one
  twice) while the holder finishes it, so it is made only from facts that a live holder could
  not show: the client connected long enough, after any outage of its own, for a live replica to
  have dialed the broker again and written its registry entry; no such write heard since; its
  claim not written; and probes of its connection unanswered ("no responders") repeatedly since.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rollfleet.schemas import ReplicaStatus

Withdrawal = Literal["removed", "gone", "unknown"]  # what withdrawing a stored job did
AfterWithdrawal = Literal["store_again", "leave", "ask_if_answered"]


def after_withdrawal(outcome: Withdrawal, settled: bool, can_ask: bool) -> AfterWithdrawal:
    """``removed``: this call took the job out, so it may be stored again elsewhere. ``gone``: a
    worker answered it (it stores the answer before it acknowledges) or the broker's store lost
    it; the stored answer tells which, so ask (none stored: lost, store it again). ``unknown`` (the
    broker did not answer), a handle settled meanwhile, or no way to ask: leave it, the next look
    decides."""
    if outcome == "removed":
        return "store_again"
    if outcome == "unknown" or settled or not can_ask:
        return "leave"
    return "ask_if_answered"


# A replica's connection dials again every 0.5 s (``broker.connection``): one that was connected when
# the broker went away is back within this of the broker, and of this client (a few tries: a
# broker whose JetStream is still recovering refuses the first), and writes its registry entry
# at once when it is (``Worker._on_reconnect``; if that write fails, the next comes a heartbeat on).
REDIAL_S = 2.0
GONE_PROBES = 2  # probes unanswered in a row (a replica's connection is either there or not)
PROBE_SPACING_S = 0.25  # between two of them (what a live replica may let a probe wait, ``_LISTENING_S``)

HolderVerdict = Literal["alive", "gone", "unsure"]


@dataclass
class HolderWatch:
    """Whether the process holding a job, a process of one replica, is gone: the client's verdict
    from facts fed as they come, pure (every time is an argument: seconds on this client's wall
    clock, as its registry view stamps what it hears).

    A registry entry goes stale during any outage of the broker (nobody's writes arrive), and a
    probe goes unanswered while the replica has not dialed again, which it does a moment after
    this client at best. So nothing is judged while this client is disconnected, nor before it has
    been connected long enough for a live replica to dial again and write its entry (``REDIAL_S``
    plus a heartbeat, ``judging_from``); then "gone" takes ``GONE_PROBES`` unanswered probes made
    after that, with no sign of life since the first: a registry write heard, the claim written,
    a probe answered. Short of that, a write heard since the connection came up, within the
    replica's liveness bound (``ReplicaStatus.stale_after_s``), is "alive"."""

    since: float | None = None  # when this client's connection last came up (None: down now)
    heard: ReplicaStatus | None = None  # the replica's newest registry entry (stamped on this client's clock)
    claim: object = None  # the job's claim as last read (its holder and stamp): a change is a write
    silent: list[float] = field(default_factory=list)  # unanswered probes since the last sign of life

    def connection(self, since: float | None) -> None:
        """This client's connection: up since ``since``, or down (None). A new connection starts
        the count of probes again (those before it say nothing of the replica now)."""
        if since != self.since:
            self.since = since
            self.silent.clear()

    def entry(self, status: ReplicaStatus) -> None:
        """The replica's registry entry as this client's view holds it now."""
        if self.heard is not None and status.heartbeat_at > self.heard.heartbeat_at:
            self.silent.clear()  # it wrote since the last look
        if self.heard is None or status.heartbeat_at >= self.heard.heartbeat_at:
            self.heard = status

    def claim_read(self, claim: object) -> None:
        """The job's claim as read now (None: there is none); its holder writing it is alive."""
        if claim is not None and self.claim is not None and claim != self.claim:
            self.silent.clear()
        self.claim = claim

    def probed(self, at: float, listening: bool | None) -> None:
        """A probe of the replica's connection made at ``at``: answered or let wait (True: some
        process listens), "no responders" (False), or no answer from the broker (None: nothing)."""
        if listening:
            self.silent.clear()
        elif listening is False:
            self.silent.append(at)

    def judging_from(self) -> float | None:
        """From when a probe may count: a live replica has dialed again and written by then."""
        if self.since is None:
            return None
        return self.since + REDIAL_S + (self.heard.heartbeat_interval_s if self.heard is not None else 0.0)

    def wants_probe(self, now: float) -> bool:
        """Whether a probe now would tell the verdict something."""
        start = self.judging_from()
        if start is None or now < start:
            return False
        return not self.silent or now - self.silent[-1] >= PROBE_SPACING_S

    def verdict(self, now: float) -> HolderVerdict:
        start = self.judging_from()
        if start is None or self.since is None:
            return "unsure"  # this client is cut off: it judges nothing
        # (Unanswered probes are kept only since its last write heard: ``entry`` drops them.)
        if now >= start and len([t for t in self.silent if t >= start]) >= GONE_PROBES:
            return "gone"
        heard = self.heard
        if heard is not None and heard.heartbeat_at >= self.since and now - heard.heartbeat_at < heard.stale_after_s():
            return "alive"
        return "unsure"
