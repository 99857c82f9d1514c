"""Per-session prefix caches for multi-turn rollouts, bounded by bytes and idle time, evicted LRU.

A session's next turn sends the whole context so far as its prompt: the previous turn's prompt,
its output, then new tokens (a tool's answer). An engine keeps, per session, the tokens its last
turn ended with and what it computed for them (the hf engine: per-layer KV tensors; the echo
engine: nothing but the tokens), as one branch per sample. The next turn takes the entry and
reuses the longest common prefix of its prompt with the best branch, so only the rest is
prefilled; when it finishes it leaves its own branches. A turn always prefills at least its last
prompt token, since that step yields the logits of the first output token.

Each branch carries the weights epoch its KV was computed on. An activation makes every branch
stale: the tensors are freed at once and a marker stays, so the session's next turn prefills
everything on the new weights and reports ``cache_rebuilt``. Stale KV is never handed out.

Bounds: ``max_bytes`` over all branches (the least recently used sessions go first) and
``ttl_s`` of idleness per session. Torch-free: the engine says how many bytes a branch holds.
Thread-safe: the hf engine takes and adds from its step thread, ends sessions from the loop.
"""

from __future__ import annotations

import math
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

DEFAULT_MAX_BYTES = 2 * 1024**3
DEFAULT_TTL_S = 600.0


@dataclass(eq=False)
class Branch:
    """The state an engine holds for ``tokens`` (a prefix of one sample's context), on ``epoch``'s weights."""

    tokens: Sequence[int]
    epoch: int
    kv: Any = None  # None: a stale marker (or an engine that keeps tokens only)
    nbytes: int = 0


@dataclass(frozen=True)
class Lookup:
    """What a turn got from its session's cache: a branch to reuse ``cached`` tokens of, or nothing."""

    branch: Branch | None = None
    cached: int = 0
    stale: bool = False  # the session's cache was from older weights: the turn rebuilds it


@dataclass(frozen=True)
class SessionCacheStats:
    entries: int  # sessions with an entry (stale markers included)
    bytes: int
    hits: int  # turns that reused at least one token
    misses: int  # turns of a session that reused nothing (stale ones included)
    evictions: int  # branches dropped for memory
    expirations: int  # sessions dropped for idleness
    rebuilds: int  # turns whose session cache was stale (an activation since the last turn)
    max_bytes: int
    ttl_s: float


@dataclass(eq=False)
class _Entry:
    branches: list[Branch] = field(default_factory=list)
    touched: float = 0.0

    @property
    def nbytes(self) -> int:
        return sum(b.nbytes for b in self.branches)


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


class SessionCache:
    def __init__(
        self,
        max_bytes: int = DEFAULT_MAX_BYTES,
        ttl_s: float = DEFAULT_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if max_bytes < 0 or not 0 < ttl_s < math.inf:
            raise ValueError(f"session cache bounds: need max_bytes >= 0 and 0 < ttl_s < inf, got {max_bytes}, {ttl_s}")
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self._clock = clock
        self._entries: OrderedDict[str, _Entry] = OrderedDict()  # least recently used first
        self._bytes = 0
        self._lock = threading.Lock()
        self._hits = self._misses = self._evictions = self._expirations = self._rebuilds = 0

    def take(self, session_id: str, prompt: Sequence[int], epoch: int) -> Lookup:
        """Remove the session's entry and pick what ``prompt`` can reuse on ``epoch``'s weights."""
        with self._lock:
            self._expire()
            entry = self._entries.pop(session_id, None)
            if entry is not None:
                self._bytes -= entry.nbytes
            best, cached, stale = None, 0, False
            limit = len(prompt) - 1  # the last prompt token is always prefilled
            for branch in entry.branches if entry else ():
                if branch.epoch != epoch:
                    stale = True
                    continue
                n = min(common_prefix(branch.tokens, prompt), limit)
                if n > cached:
                    best, cached = branch, n
            stale = stale and best is None
            if best is not None:
                self._hits += 1
            else:
                self._misses += 1
                self._rebuilds += stale
            return Lookup(best, cached, stale)

    def add(self, session_id: str, branch: Branch) -> None:
        """Keep ``branch`` for the session's next turn, evicting the least recently used to fit."""
        with self._lock:
            self._expire()
            if branch.nbytes > self.max_bytes:  # could never fit: keep it out, and everyone else in
                self._evictions += 1
                return
            entry = self._entries.pop(session_id, None) or _Entry()
            self._bytes -= entry.nbytes
            entry.branches.append(branch)
            entry.touched = self._clock()
            # Other sessions go first, then this session's own older branches.
            while self._entries and self._bytes + entry.nbytes > self.max_bytes:
                _, victim = self._entries.popitem(last=False)
                self._bytes -= victim.nbytes
                self._evictions += sum(1 for b in victim.branches if b.nbytes)
            while entry.nbytes > self.max_bytes:
                entry.branches.pop(0)
                self._evictions += 1
            self._entries[session_id] = entry
            self._bytes += entry.nbytes

    def drop(self, session_id: str) -> None:
        with self._lock:
            entry = self._entries.pop(session_id, None)
            if entry is not None:
                self._bytes -= entry.nbytes

    def invalidate(self, epoch: int) -> None:
        """The weights changed: free every branch not computed on ``epoch``, keep a stale marker."""
        with self._lock:
            for entry in self._entries.values():
                fresh = [b for b in entry.branches if b.epoch == epoch]
                if len(fresh) < len(entry.branches):
                    entry.branches = [*fresh, Branch(tokens=(), epoch=-1)]
            self._bytes = sum(e.nbytes for e in self._entries.values())

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0

    def expire(self) -> None:
        with self._lock:
            self._expire()

    def _expire(self) -> None:
        deadline = self._clock() - self.ttl_s
        while self._entries:
            session_id, entry = next(iter(self._entries.items()))
            if entry.touched > deadline:
                break  # entries are in order of last use
            del self._entries[session_id]
            self._bytes -= entry.nbytes
            self._expirations += 1

    def stats(self) -> SessionCacheStats:
        with self._lock:
            self._expire()
            return SessionCacheStats(
                entries=len(self._entries),
                bytes=self._bytes,
                hits=self._hits,
                misses=self._misses,
                evictions=self._evictions,
                expirations=self._expirations,
                rebuilds=self._rebuilds,
                max_bytes=self.max_bytes,
                ttl_s=self.ttl_s,
            )
