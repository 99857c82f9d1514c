"""The version a worker serves: the one fact that routing, the registry and version sync read.

It moves only after the engine has activated a version and the activation was announced,
so a worker never pulls a version's jobs before it said it serves that version. The engine
keeps its own record of its live weights only to stamp each generation step with it.
"""

from __future__ import annotations

from dataclasses import dataclass

from rollfleet.schemas import ConstraintKind, VersionConstraint

Subject = tuple[ConstraintKind, int]


def compatible(version: int, subject: Subject) -> bool:
    """Whether a worker serving ``version`` may take jobs from ``subject``."""
    kind, v = subject
    return v == version if kind == "exact" else v <= version


@dataclass
class ServedVersion:
    version: int

    def accepts(self, subject: Subject) -> bool:
        return compatible(self.version, subject)

    def allows(self, constraint: VersionConstraint) -> bool:
        return constraint.allows(self.version)
