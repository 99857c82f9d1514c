"""The version a worker serves: the one fact that routing, the registry and version sync read.

It moves only after the engine has activated a version and the activation was announced,
so a worker never pulls a version's jobs before it said it serves that version. The engine
keeps its own record of its live weights only to stamp each generation step with it.

While an activation to a newer version is under way (``activating``), exact jobs for the
served version are no longer taken: they could not finish before the weights change. Jobs
with a minimum version still are; they may span the activation and report both versions.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rollfleet.schemas import ConstraintKind, VersionConstraint
from rollfleet.schemas.messages import refuses_while_activating, version_allows

Subject = tuple[ConstraintKind, int]
_DIGESTS_KEPT = 16  # versions: a job in flight spans a few at most


def compatible(version: int, subject: Subject) -> bool:
    """Whether a worker serving ``version`` may take jobs from ``subject``."""
    kind, bound = subject
    return version_allows(kind, bound, version)


@dataclass
class ServedVersion:
    version: int
    activating: int | None = None  # the version being activated, from the end of its prepare to its announcement
    down: bool = False  # the engine is dead or hung: nothing is taken until it is back
    # The content digest (``policy_store.digest.content_digest``) of the newest versions this
    # replica materialized, by version: what each result's replay coordinate records.
    content_digests: dict[int, bytes] = field(default_factory=dict)

    def record_digest(self, version: int, digest: bytes) -> None:
        """``version``'s content digest, as its materialization found it (the newest few kept)."""
        self.content_digests.pop(version, None)
        self.content_digests[version] = digest
        while len(self.content_digests) > _DIGESTS_KEPT:
            del self.content_digests[next(iter(self.content_digests))]

    def accepts(self, subject: Subject) -> bool:
        """Whether to pull from ``subject`` now."""
        if self.down:
            return False
        if self.activating is not None and refuses_while_activating(subject[0]):
            return False
        return compatible(self.version, subject)

    def allows(self, constraint: VersionConstraint) -> bool:
        """Whether a pulled job with ``constraint`` may start now."""
        return self.accepts((constraint.kind, constraint.version))
