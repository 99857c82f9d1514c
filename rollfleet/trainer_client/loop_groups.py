"""The rollout loop machine's state of a group in flight: its prompt, a slot per sample (what
earlier runs made of it, and the sample once finished), and its jobs (pieces) still out. Small
state holders; ``loop_machine.LoopMachine`` owns them and decides what happens to them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from rollfleet.schemas import RolloutPayload, RolloutResult
from rollfleet.trainer_client.loop_types import Group, Sample, StopCause


@dataclass
class QueuedPrompt:
    no: int
    item: Any
    payload: RolloutPayload
    attempts: int = 0  # tries begun


@dataclass
class Slot:
    prefix: Sample | None = None  # what earlier runs made of a continued sample
    done: Sample | None = None


@dataclass
class Piece:
    key: str
    group: int
    indices: tuple[int, ...]
    round: int
    payload: RolloutPayload
    floor: int
    stopping: Literal["refresh", "group"] | None = None
    refresh_floor: int = 0  # where a refreshed job's samples go on


@dataclass
class GroupInFlight:
    no: int
    prompt: QueuedPrompt
    admitted_at: float
    slots: list[Slot]
    pieces: dict[str, Piece] = field(default_factory=dict)
    results: list[RolloutResult] = field(default_factory=list)
    generated: int = 0  # tokens of every answer it received, every round
    stop: StopCause | None = None
    error: BaseException | None = None
    continued_at: int | None = None
    scoring: Group | None = None  # complete, being scored

    @property
    def running(self) -> bool:
        """Generating: neither being stopped nor being scored."""
        return self.stop is None and self.scoring is None

    def pinned(self) -> int | None:
        """The oldest judged version of its finished samples (None: none finished yet)."""
        finished = [s.done.judged_version for s in self.slots if s.done is not None]
        return min(finished) if finished else None

    def oldest_judged(self) -> int | None:
        """The oldest version the group can be judged from once complete (rule 6): its finished
        samples' judged versions and the floors of its jobs (a job stopped to go on at a fresher
        floor may still answer whole before its stop lands). None for a group being stopped (it
        will not complete)."""
        if self.stop is not None:
            return None
        if self.scoring is not None:
            return self.scoring.judged_version
        versions = [s.done.judged_version for s in self.slots if s.done is not None]
        versions += [p.floor for p in self.pieces.values()]
        return min(versions) if versions else None

    def complete(self) -> Group | None:
        """What the trainer receives of it, once every sample finished and no job is out."""
        if self.pieces or any(s.done is None for s in self.slots):
            return None
        return Group(
            prompt=self.prompt.item,
            payload=self.prompt.payload,
            samples=[s.done for s in self.slots if s.done is not None],
            results=self.results,
            attempts=self.prompt.attempts,
            admitted=self.no,
            continued_at=self.continued_at,
            prompt_no=self.prompt.no,
        )
