"""What crosses the rollout loop machine's boundary (``loop_machine.LoopMachine``): the groups and
samples the trainer receives, the actions the driver (``loop.RolloutLoop``) carries out, and what
``take`` decides. Plain frozen data; the rules over it live in the modules named in
``loop_machine``'s docstring.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from rollfleet.schemas import ReplayCoordinate, RolloutPayload, RolloutResult, VersionSpan, coordinate_wire

StalePolicy = Literal["drop", "requeue", "keep"]
FailurePolicy = Literal["requeue", "report"]
WasteCause = Literal["stale", "filtered", "failed", "deadline", "closed", "unused", "orphaned"]
WASTE_CAUSES: tuple[WasteCause, ...] = ("stale", "filtered", "failed", "deadline", "closed", "unused", "orphaned")
StopCause = Literal["failed", "deadline", "closed"]


# -- what the trainer receives -------------------------------------------------------------------


@dataclass(frozen=True)
class SampleRun:
    """One run that made a sample's tokens from ``start`` on: the job's key (its whole answer is
    ``client.result(key)``), the sample's index in that answer, and the answer's replay
    coordinate (None: stored by a replica that stamps none)."""

    start: int
    key: str
    index: int
    coordinate: ReplayCoordinate | None

    def wire(self) -> dict[str, Any] | None:
        """The coordinate as every door carries it (``schemas.replay.coordinate_wire``)."""
        return coordinate_wire(self.coordinate, self.index)


@dataclass(frozen=True)
class Sample:
    tokens: list[int]
    logprobs: list[float] | None  # the behaviour policy's, per token
    spans: list[VersionSpan]  # which version generated which tokens (never zero-width)
    finish_reason: str
    version_start: int  # the oldest version that made any of its tokens
    version_end: int
    reward: float = 0.0
    # A continued sample: its tokens before this index were made by earlier runs (the context its
    # last run was conditioned on); 0 for a sample made in one run.
    continued_from: int = 0
    judged_version: int = 0  # what its staleness is judged from (rule 6)
    # What it takes to generate it again: each run that made its tokens, in order (a continued
    # sample has one per run), with that run's replay coordinate.
    replay: tuple[SampleRun, ...] = ()


@dataclass
class Group:
    prompt: Any  # the source's item, as it came
    payload: RolloutPayload
    samples: list[Sample]
    results: list[RolloutResult]
    attempts: int
    admitted: int  # admission number (order of admission over the loop's life)
    staleness: int = 0  # at consume time, by rule 6: the trainer's version minus the judged version
    # A partial rollout or refreshed tail: the newest version a sample of it was continued at.
    continued_at: int | None = None
    prompt_no: int = 0  # the item's number in the source's order
    token_staleness: int = 0  # at consume time: the trainer's version minus its oldest token's

    @property
    def rewards(self) -> list[float]:
        return [s.reward for s in self.samples]

    @property
    def tokens(self) -> int:
        return sum(len(s.tokens) for s in self.samples)

    @property
    def judged_version(self) -> int:
        return min(s.judged_version for s in self.samples)


@dataclass(frozen=True)
class FailedGroup:
    prompt: Any
    reason: str
    attempts: int
    error: BaseException | None = None


# -- actions (what the driver carries out) and take's decisions -----------------------------------


@dataclass(frozen=True)
class Submit:
    key: str
    group: int
    payload: RolloutPayload
    max_staleness: int  # the floor, written as its distance below latest (rule 3)


@dataclass(frozen=True)
class Cancel:
    key: str
    cause: str


@dataclass(frozen=True)
class Score:
    group: int
    candidate: Group


@dataclass(frozen=True)
class Wasted:
    cause: WasteCause
    tokens: int


@dataclass(frozen=True)
class Note:
    """A line for the log."""

    event: str
    fields: dict[str, Any]


Action = Submit | Cancel | Score | Wasted | Note


@dataclass(frozen=True)
class Handout:
    step: int
    version: int
    groups: list[Group]
    failed: list[FailedGroup]
    waste_tokens: dict[str, int]  # since the last batch
    waste_groups: dict[str, int]
    staleness: dict[int, int]  # staleness -> groups


@dataclass(frozen=True)
class Wait:
    """Nothing to hand over yet; more can come."""


@dataclass(frozen=True)
class End:
    """Nothing left and nothing more can come."""


@dataclass(frozen=True)
class Raise:
    error: BaseException


Decision = Handout | Wait | End | Raise
