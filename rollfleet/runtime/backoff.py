"""How long to wait before asking again something that failed for a passing reason (a broker
recovering, an object store's link reset, a version that could not be read, no replica yet).

The one rule of every retry loop of the package, written once: the pause before retry
``attempt`` (0 first) is ``first_s * factor ** attempt``, never more than ``max_s``, optionally
spread by ``jitter``. Each loop names its own parameters as a ``Backoff`` beside it (a fixed pause
is ``first_s == max_s``); none computes a delay of its own.

Pure: an attempt number in, a delay out. No clock and no global random state: a caller that
wants a time adds its own ``now`` (``retry_at``), and a caller that wants jitter passes its own
random source, so tests replay a schedule exactly.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Backoff:
    """A retry schedule: ``first_s`` before the first retry, times ``factor`` per retry after it,
    at most ``max_s``. ``jitter`` (0 to 1): each pause is drawn from ``delay * [1 - jitter,
    1 + jitter)`` with the random source the caller passes, so processes that failed together
    do not all ask again together."""

    first_s: float
    max_s: float
    factor: float = 2.0
    jitter: float = 0.0

    def __post_init__(self) -> None:
        if not 0 <= self.first_s <= self.max_s:  # (NaN too)
            raise ValueError(f"a backoff needs 0 <= first_s <= max_s, got {self.first_s} and {self.max_s}")
        if not self.factor >= 1:
            raise ValueError(f"a backoff's factor is at least 1, got {self.factor}")
        if not 0 <= self.jitter <= 1:
            raise ValueError(f"a backoff's jitter is between 0 and 1, got {self.jitter}")

    @classmethod
    def fixed(cls, pause_s: float) -> Backoff:
        """The same pause before every retry."""
        return cls(first_s=pause_s, max_s=pause_s)

    def delay_s(self, attempt: int, rng: random.Random | None = None) -> float:
        """The pause before retry ``attempt`` (0 first). ``rng`` is required when ``jitter`` is set."""
        if attempt < 0:
            raise ValueError(f"attempts count from 0, got {attempt}")
        try:
            delay = min(self.max_s, self.first_s * self.factor**attempt)
        except OverflowError:  # (a loop that has failed a thousand times waits the most, never raises)
            delay = self.max_s
        if not self.jitter:
            return delay
        if rng is None:
            raise ValueError("a backoff with jitter needs the caller's random source")
        return delay * (1 - self.jitter + 2 * self.jitter * rng.random())

    def retry_at(self, attempt: int, now: float, rng: random.Random | None = None) -> float:
        """When retry ``attempt`` is due, for a failure at ``now`` (any clock: the caller's)."""
        return now + self.delay_s(attempt, rng)


# Asking the broker or an object store again (``broker.retry_call``, ``broker.retry_publish``,
# ``policy_store.bucket``): short at first, since a leader elected or a link reset is often over
# within a tenth of a second, then at most a second, so a recovered service is used within one.
TRANSIENT_RETRY = Backoff(first_s=0.1, max_s=1.0)
