"""What the planner looks ahead with: the load's trend per class, and how long a replica takes
to start, both learnt from what the planner saw at its own ticks.

A replica asked for now serves only a start-up time later (a GPU server's start takes tens of
seconds), so a class is sized for the load it will have then, not only for the load it has:

- **The load's trend.** The load (``ClassDemand.load``: jobs waiting or running) is what a
  class's slots must hold. With slots to spare it is the arrival rate times the service time
  (Little's law), so a rising rate raises it; with too few, the backlog grows by the arrivals
  the fleet does not complete. Either way the load's slope over the last ``window_s`` is how fast
  demand outgrows the fleet (``LoadHistory.trend``: between the means of the window's two halves,
  and only where both halves rise and the rise stands out of the load's wavering: a step is no
  trend, and noise is none either). ``projected_load`` extends it over the start-up time; a
  falling trend projects nothing below the load there is now.
- **The start-up time.** Measured from the plan that asked for a replica (the controller
  launches right after its plan) to the first tick its registry entry says it serves
  (``ReplicaFacts.serving`` and not ``coming``): at most one interval late, never early. A
  replica nobody here asked for (another controller's, an operator's, one still starting when
  this controller took over) is not measured: its launch was not seen. The estimate is the
  median of the last ``KEPT_SAMPLES`` measurements, the policy's configured ``startup_s`` until
  there is one. The same clock says when a class none of whose replicas serves yet should have
  one serving (``serving_in``): what a refused request may be told to wait.

Plain data and pure functions: every sample and timer is in the state passed in and returned,
time is an argument, and an empty state (a restarted controller) only looks ahead less until it
has seen a window and a start again.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from rollfleet.autoscale.signal import ClassKey, ReplicaFacts

KEPT_SAMPLES = 5  # start-up measurements the estimate is the median of


# -- the load's trend ------------------------------------------------------------------------


@dataclass(frozen=True)
class LoadHistory:
    """A class's load at the planner's last ticks within the window: ``(when, load)``."""

    samples: tuple[tuple[float, int], ...] = ()

    def observe(self, now: float, load: int, window_s: float) -> LoadHistory:
        kept = tuple((t, n) for t, n in self.samples if now - t <= window_s and t < now)
        return LoadHistory((*kept, (now, load)))

    def trend(self, window_s: float) -> float:
        """Jobs per second the load keeps growing by, from the window's two halves: the slowest
        of each half's least-squares slope and the rise of their mean loads over the time between
        them, counted only where it is a trend and not a step or noise: each half rises on its own
        (a step, a burst or a trickle starting from nothing, rises in one half only), and the
        rise is at least one job and twice its standard error (a load that only wavers about a
        level rises by less). 0 until each half holds two samples."""
        if not self.samples:
            return 0.0
        middle = self.samples[-1][0] - window_s / 2
        older = [p for p in self.samples if p[0] < middle]
        newer = [p for p in self.samples if p[0] >= middle]
        if len(older) < 2 or len(newer) < 2:
            return 0.0
        slopes = _slope(older), _slope(newer)
        (t_old, n_old, var_old), (t_new, n_new, var_new) = _moments(older), _moments(newer)
        rise = n_new - n_old
        noise = 2 * math.sqrt(var_old / len(older) + var_new / len(newer))
        if min(slopes) <= 0 or rise < max(1.0, noise) or t_new <= t_old:
            return 0.0
        # (as fast as its slowest evidence: a step in one half and a waver in the other is slow)
        return min(*slopes, rise / (t_new - t_old))


def _moments(points: list[tuple[float, int]]) -> tuple[float, float, float]:
    """The mean time, the mean load and the load's sample variance of ``points`` (two or more)."""
    mean_t = sum(t for t, _ in points) / len(points)
    mean_n = sum(n for _, n in points) / len(points)
    var = sum((n - mean_n) ** 2 for _, n in points) / (len(points) - 1)
    return mean_t, mean_n, var


def _slope(points: list[tuple[float, int]]) -> float:
    """The least-squares slope of ``(when, load)`` points; 0 for fewer than two instants."""
    mean_t, mean_n, _ = _moments(points)
    spread = sum((t - mean_t) ** 2 for t, _ in points)
    if spread <= 0:
        return 0.0
    return sum((t - mean_t) * (n - mean_n) for t, n in points) / spread


def projected_load(load: int, trend: float, lead_s: float) -> float:
    """The load ``lead_s`` from now if it keeps its trend; never below the load now (a falling
    trend is left to the scale-in rules, which wait out their grace)."""
    return load + max(0.0, trend) * max(0.0, lead_s)


# -- the start-up time -----------------------------------------------------------------------


@dataclass(frozen=True)
class StartupClock:
    """Launches asked for and not yet seen, replicas seen starting, and the measurements."""

    asked: tuple[tuple[ClassKey, float], ...] = ()  # (class, when the plan asked), oldest first
    # worker id -> (when its launch was asked, its host): a container's replica registers under
    # an id of its own (``<hostname>-<pid>``), found again by its host (``controller.fleet_of``)
    starting: Mapping[str, tuple[float, str]] = field(default_factory=dict)
    known: frozenset[str] = frozenset()  # every replica the last tick saw
    samples: tuple[float, ...] = ()  # seconds from the ask to serving, the newest last

    def estimate(self, default_s: float) -> float:
        return statistics.median(self.samples) if self.samples else default_s

    def ask(self, launches: Iterable[tuple[ClassKey, int]], now: float) -> StartupClock:
        """The plan of ``now`` asks for these launches (class, count)."""
        more = tuple((klass, now) for klass, count in launches for _ in range(count))
        return replace(self, asked=(*self.asked, *more)) if more else self

    def see(self, fleet: Iterable[ReplicaFacts], now: float, forget_after_s: float) -> StartupClock:
        """One tick's fleet: a replica not seen before takes the oldest ask of its class (its
        launch), or the launch of the one seen starting on its host; one seen starting that now
        serves is a measurement; one gone is forgotten (it died starting: no measurement). An ask
        no replica took within ``forget_after_s`` is dropped (the launch failed, or the controller
        lost its lease before it)."""
        asked = [(k, t) for k, t in self.asked if now - t <= forget_after_s]
        on_host = {host: since for since, host in self.starting.values() if host}
        starting: dict[str, tuple[float, str]] = {}
        samples = list(self.samples)
        seen = set()
        for r in fleet:
            seen.add(r.worker_id)
            if r.worker_id in self.starting:
                since = self.starting[r.worker_id][0]
            elif r.worker_id in self.known:
                continue
            elif r.host and r.host in on_host:
                since = on_host.pop(r.host)
            else:
                match = next((i for i, (k, _) in enumerate(asked) if k == r.klass), None)
                if match is None:
                    continue  # (nobody here asked for it: its start is not measured)
                since = asked.pop(match)[1]
            if r.serving and not r.coming:
                samples.append(now - since)
            elif r.coming:
                starting[r.worker_id] = (since, r.host)
        return StartupClock(tuple(asked), starting, frozenset(seen), tuple(samples[-KEPT_SAMPLES:]))

    def serving_in(self, replicas: Iterable[ReplicaFacts], launched: int, estimate: float, now: float) -> float | None:
        """Seconds until the first of a class's replicas serves, as this clock expects it: None
        when one serves already, or none is starting or launched; else the soonest of each
        starting one's launch plus ``estimate`` (one whose launch was not seen: the whole
        estimate, an upper bound), and ``estimate`` for one launched now; 0 at least (one late
        past the estimate is due any moment)."""
        etas = [estimate] * launched
        for r in replicas:
            if r.serving and not r.coming:
                return None
            if r.coming:
                known = self.starting.get(r.worker_id)
                etas.append(estimate if known is None else known[0] + estimate - now)
        return max(0.0, min(etas)) if etas else None
