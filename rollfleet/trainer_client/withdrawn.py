"""Keys whose job this client withdrew unanswered, remembered for the broker's duplicate window.

A job withdrawn before any answer (its deadline passed, no replica could serve it any more, its
trainer cancelled it) is gone from the stream, but the broker still takes its key for a
duplicate until the window ends, and stores nothing under it. A *different* request under that
key then found no earlier job to compare with, was stored in its place and ran; the first
request, asked again, was refused as the conflict (campaign 10, seed 73). Within the window the
key stays bound to the request it was first used for, as it is while its job lies in the stream.
Decided without I/O; time is an argument.
"""

from __future__ import annotations

_PRUNE_EVERY = 1024  # notes between sweeps of the entries past their window


class WithdrawnKeys:
    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._keys: dict[str, tuple[str, float]] = {}  # key -> (the request's fingerprint, until)
        self._notes = 0

    def note(self, key: str, fingerprint: str, now: float) -> None:
        """``key``'s job, for the request ``fingerprint``, was withdrawn unanswered at ``now``."""
        self._keys[key] = (fingerprint, now + self.window_s)
        self._notes += 1
        if self._notes % _PRUNE_EVERY == 0:
            self._keys = {k: v for k, v in self._keys.items() if v[1] > now}

    def conflicts(self, key: str, fingerprint: str, now: float) -> bool:
        """Whether ``key`` is bound, within the window, to a request other than ``fingerprint``."""
        entry = self._keys.get(key)
        if entry is None:
            return False
        if entry[1] <= now:
            del self._keys[key]
            return False
        return entry[0] != fingerprint

    def __len__(self) -> int:
        return len(self._keys)
