"""One request's life at the gateway, as a state machine: events in, actions out.

Every door goes through this one machine: a plain request (one job), a batch of inputs (one job
an input), a session's turn (one job, stored by the session), each streamed or not. What a
client is promised is decided here, once, for all of them:

- **A client that leaves.** A job under no key of the client's can never be asked for again: it
  is cancelled in the fleet whenever the client leaves, while the job is being stored (cancelled
  as soon as it is), while it waits, while it streams. A job under the client's key runs on, so
  that a retry gets its one answer (``on_leaving``).
- **The status.** Decided before anything is sent. A stream's 200 goes out only once its job is
  stored and was not refused: a request no replica can serve is a 409 with ``Retry-After``,
  streamed or not. One that chose to wait for a replica (``weight_version.wait_for_replica``)
  is not refused: its job is stored and waits like any other (its stream opens, kept alive while
  a replica starts; its deadline passing is an ``Expired``), so this machine needs no rule of
  its own for it. An error after a stream's 200 ends the stream with an error event. A batch
  fails whole on the first error, its keyless siblings cancelled with it.
- **The metrics label.** The status the request ended with: 200, the error's status (also when
  it came after a stream's 200), or 499 when the client left first (nginx's "client closed
  request"): a client going away is never counted as a 5xx.

The machine never awaits, reads a clock or touches a socket: ``app.py`` feeds it what happened
and carries out what it returns. An event that cannot happen in the current state (a job stored
twice, an answer after the client left) raises ``RequestStateError``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rollfleet.trainer_client.cancelling import on_leaving

Door = Literal["plain", "batch", "turn"]
Phase = Literal["storing", "waiting", "streaming", "done"]

CLIENT_CLOSED = 499  # nginx's "client closed request": the label of a request whose client left first


@dataclass(frozen=True)
class CancelJob:
    """Cancel job ``index`` in the fleet (its handle is held)."""

    index: int


@dataclass(frozen=True)
class Respond:
    """Send the whole response: ``status`` 200 with the answer, or the error's status and body."""

    status: int


@dataclass(frozen=True)
class OpenStream:
    """Send the stream's 200 and its headers: nothing can change its status after this."""


@dataclass(frozen=True)
class EndStream:
    """Send the last event (the answer, or the error's body when ``status`` is not 200), then ``[DONE]``."""

    status: int


Action = CancelJob | Respond | OpenStream | EndStream


class RequestStateError(RuntimeError):
    """An event the request's state does not allow (a defect in the driver)."""


@dataclass
class RequestState:
    """One request: its door, whether it streams, and the client's key for each of its jobs
    (``None``: the client gave none; a turn's job has the session's own key then)."""

    door: Door
    stream: bool
    keys: tuple[str | None, ...]
    phase: Phase = "storing"
    stored: set[int] = field(default_factory=set)  # jobs whose handles are held
    settled: set[int] = field(default_factory=set)  # jobs answered (a result or an error)
    client_gone: bool = False
    opened: bool = False  # the stream's 200 was sent
    status: int | None = None  # how the request ended, once it did

    def __post_init__(self) -> None:
        if not self.keys or (self.door != "batch" and len(self.keys) != 1):
            raise RequestStateError(f"a {self.door} request has one job, a batch at least one; got {len(self.keys)}")
        if self.stream and self.door == "batch":
            raise RequestStateError("a batch of inputs is not streamed")

    @property
    def label(self) -> str | None:
        """The metrics label: the status it ended with (499 when its client left first)."""
        return None if self.status is None else str(self.status)

    def _cancels(self, indexes: set[int]) -> list[Action]:
        return [CancelJob(i) for i in sorted(indexes) if on_leaving(self.keys[i]) == "cancel"]

    def may_start(self) -> bool:
        """Whether a job may be started now (a turn waits for its trajectory's previous turn
        first): not once the client left or the request ended, since nothing of it is stored yet."""
        return not self.client_gone and self.phase != "done"

    # -- events ---------------------------------------------------------------------------------
    def job_stored(self, index: int) -> list[Action]:
        """Job ``index`` is stored and its handle held. A client that already left gets it
        cancelled now (the handle could not be cancelled before it existed)."""
        if not 0 <= index < len(self.keys) or index in self.stored:
            raise RequestStateError(f"job {index} stored twice, or not a job of this request")
        self.stored.add(index)
        if self.client_gone or self.phase == "done":
            return self._cancels({index} - self.settled)
        return []

    def all_stored(self) -> list[Action]:
        """Every job is stored and none was refused: a stream's status is 200 now (a plain or
        batch request waits for its answers; a turn streams once answered, since it may move)."""
        if self.phase != "storing" or len(self.stored) != len(self.keys):
            raise RequestStateError(f"all_stored in phase {self.phase} with {len(self.stored)} of {len(self.keys)}")
        if self.client_gone:
            return []
        self.phase = "waiting"
        if self.stream and self.door != "turn":
            self.phase, self.opened = "streaming", True
            return [OpenStream()]
        return []

    def job_settled(self, index: int) -> None:
        """Job ``index`` has its answer (a result or an error): nothing is left to cancel of it."""
        self.settled.add(index)

    def answered(self) -> list[Action]:
        """Every job answered: the answer is sent (a turn's stream opens now, and comes whole)."""
        if self.client_gone or self.phase == "done":
            return []
        self.settled.update(range(len(self.keys)))
        self.phase, self.status = "done", 200
        if not self.stream:
            return [Respond(200)]
        actions: list[Action] = [] if self.opened else [OpenStream()]
        self.opened = True
        return [*actions, EndStream(200)]

    def failed(self, status: int) -> list[Action]:
        """The request failed with an error of ``status`` (refused at parse or submit, or a job's
        answer was an error): its status if nothing was sent yet, else the stream's last event;
        the keyless jobs still under way are cancelled (nobody reads them now)."""
        if self.client_gone or self.phase == "done":
            return []
        self.phase, self.status = "done", status
        cancels = self._cancels(self.stored - self.settled)
        return [*cancels, EndStream(status) if self.opened else Respond(status)]

    def client_left(self) -> list[Action]:
        """The client closed its connection: 499, and its keyless jobs cancelled (those still
        being stored are cancelled as they are stored)."""
        if self.client_gone or self.phase == "done":
            return []  # (a client leaving after its answer was sent changes nothing)
        self.client_gone, self.phase, self.status = True, "done", CLIENT_CLOSED
        return self._cancels(self.stored - self.settled)
