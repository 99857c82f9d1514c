"""The rollout loop machine's state of a group in flight: its prompt, a slot per sample (what
earlier runs made of it, and the sample once finished), and its jobs (pieces) still out. Small
state holders, and ``InFlight``, the table of groups in flight and their jobs;
``loop_machine.LoopMachine`` owns them and decides what happens to them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Literal

from rollfleet.schemas import RolloutPayload, RolloutResult
from rollfleet.trainer_client.loop_keys import job_key
from rollfleet.trainer_client.loop_types import Group, Sample, StopCause, Submit


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


class InFlight:
    """Groups admitted and not complete (generating, stopping or being scored), by admission
    number, and their jobs asked for and not answered, by key."""

    def __init__(self, loop_id: str) -> None:
        self.loop_id = loop_id
        self.groups: dict[int, GroupInFlight] = {}
        self.pieces: dict[str, Piece] = {}
        self._numbers = itertools.count()  # admission numbers

    def admit(self, prompt: QueuedPrompt, now: float, group_size: int) -> GroupInFlight:
        g = GroupInFlight(next(self._numbers), prompt, now, [Slot() for _ in range(group_size)])
        self.groups[g.no] = g
        return g

    def ask(
        self, g: GroupInFlight, indices: tuple[int, ...], round_: int, payload: RolloutPayload, floor: int, latest: int
    ) -> Submit:
        """A job of ``g`` for samples ``indices`` at ``floor`` (written as its distance below
        ``latest``, rule 3), under its key (rule 5)."""
        allowance = max(0, latest - floor)
        key = job_key(self.loop_id, g.prompt.no, g.prompt.attempts, round_, indices, allowance)
        piece = Piece(key, g.no, indices, round_, payload, latest - allowance)
        g.pieces[key] = piece
        self.pieces[key] = piece
        return Submit(key, g.no, payload, allowance)

    def settle(self, key: str) -> tuple[Piece, GroupInFlight] | None:
        """The job under ``key`` answered or failed: it is out no more. None: no job waits for it."""
        piece = self.pieces.pop(key, None)
        if piece is None:
            return None
        g = self.groups[piece.group]
        del g.pieces[key]
        return piece, g
