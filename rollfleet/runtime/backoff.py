"""How long to wait before asking again something that failed for a passing reason (a broker
recovering, an object store's link reset): short at first, then at most a second. One rule for
every retry loop of the package."""

from __future__ import annotations


def backoff_s(attempt: int) -> float:
    """The pause before retry ``attempt`` (0 first): short at first, at most a second."""
    return min(0.1 * 2**attempt, 1.0)
