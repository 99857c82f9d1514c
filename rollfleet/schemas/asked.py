"""A version constraint as its caller wrote it, from every door to the job: the one place that
checks it.

A caller says which versions may serve a request in one of three ways: ``min:N`` (N or newer),
``exact:N`` (N alone), or ``staleness:S`` (at most S versions below the trainer's newest commit
when the job is built). The Python client's keyword arguments, a session's settings and its turns,
the rollout loop, miles, and the HTTP endpoint's Stitch ``weight_version`` object all build an
``AskedConstraint`` (``AskedConstraint.of`` checks the keyword form: exactly one, whole numbers);
a job carries only its resolved ``VersionConstraint`` (``resolve``), and its fingerprint covers
the written form (``written``), so a request asked again after a commit moved the newest version
is the same request.
"""

from __future__ import annotations

import numbers
from typing import Literal

import msgspec

from rollfleet.schemas.errors import InvalidRequest
from rollfleet.schemas.messages import VersionConstraint

AskedKind = Literal["min", "exact", "staleness"]
MAX_VERSION = 2**63 - 1  # (versions and staleness travel as MessagePack int64)


def whole_number(name: str, value: object, low: int = 0) -> int:
    """``value`` as an int in ``[low, 2**63)``; bools, floats and strings are refused, not coerced."""
    # (A plain int, as nearly always, skips the ABC check: bool is a type of its own.)
    if type(value) is not int and (isinstance(value, bool) or not isinstance(value, numbers.Integral)):
        raise InvalidRequest(f"{name} must be an integer, got {type(value).__name__} {value!r}")
    if not low <= int(value) <= MAX_VERSION:
        raise InvalidRequest(f"{name} must be in [{low}, 2**63), got {value}")
    return int(value)


class AskedConstraint(msgspec.Struct, frozen=True):
    """``kind:value`` as written: ``min:3``, ``exact:3``, ``staleness:1``. Build it with ``of``
    (keyword form, checked) or directly from values already checked as whole numbers."""

    kind: AskedKind
    value: int

    @classmethod
    def of(
        cls, min_version: object = None, exact_version: object = None, max_staleness: object = None
    ) -> AskedConstraint:
        """The constraint of ``submit``'s keywords: exactly one of them, a whole number."""
        given = (min_version is not None) + (exact_version is not None) + (max_staleness is not None)
        if given != 1:
            raise InvalidRequest("give exactly one of min_version, exact_version or max_staleness")
        if exact_version is not None:
            return cls("exact", whole_number("exact_version", exact_version))
        if min_version is not None:
            return cls("min", whole_number("min_version", min_version))
        return cls("staleness", whole_number("max_staleness", max_staleness))

    def resolve(self, latest: int | None) -> VersionConstraint:
        """The versions that may serve it now: ``staleness:S`` is ``min:(latest - S)``, at least 0."""
        if self.kind == "staleness":
            return VersionConstraint("min", max(0, (latest or 0) - self.value))
        return VersionConstraint(self.kind, self.value)

    @property
    def written(self) -> str:
        """As its caller wrote it (``staleness:1``, not the version that resolved to): what a
        request's fingerprint covers."""
        return f"{self.kind}:{self.value}"


ANY_VERSION = AskedConstraint("min", 0)
