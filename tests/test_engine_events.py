"""The engine server events of the machine adversary (``reliability.adversary.engines``): drawn from their
own stream only with sglang workers, and what the oracle reads of them (pure; milliseconds)."""

from __future__ import annotations

from types import SimpleNamespace

from reliability.adversary.engines import back_moments, engine_out, serves_again
from reliability.adversary.schedule import engines, make_schedule


def test_engine_events_come_only_with_sglang_workers_and_leave_every_other_event_in_place() -> None:
    for seed in (3, 5, 19):
        plain = make_schedule(seed, 45)
        with_engines = make_schedule(seed, 45, sglang=True)
        assert not any(e.kind.startswith("engine_") for e in plain)
        mine = [e for e in with_engines if e.kind.startswith("engine_")]
        assert mine and [(e.t, e.kind, e.params) for e in mine] == [(e.t, e.kind, e.params) for e in engines(seed, 45)]
        others = [(e.t, e.kind, e.params) for e in with_engines if not e.kind.startswith("engine_")]
        assert others == [(e.t, e.kind, e.params) for e in plain]
    kinds = {e.kind for seed in range(30) for e in engines(seed, 120)}
    assert kinds == {"engine_kill", "engine_pause_error", "engine_freeze"}


def _life(start: float, end: float | None, stops: list[list[float]] = [], refusing: list[list[float]] = []) -> object:  # noqa: B006
    return SimpleNamespace(start=start, end=end, stops=stops, refusing=refusing)


def test_a_worker_whose_server_is_dead_or_frozen_cannot_serve() -> None:
    lives = [_life(0.0, 10.0, stops=[[3.0, 5.0]]), _life(12.0, None)]
    assert not engine_out(lives, 1.0) and engine_out(lives, 4.0) and not engine_out(lives, 6.0)
    assert engine_out(lives, 11.0)  # killed, not restarted yet
    assert not engine_out(lives, 13.0) and engine_out([], 1.0)
    moments = back_moments([_life(0.0, 10.0, stops=[[3.0, 5.0]], refusing=[[6.0, 8.0]]), _life(12.0, None)])
    assert [t for t, _ in moments] == [5.0, 8.0, 12.0]


def test_a_replica_serves_again_once_its_server_is_back() -> None:
    assert serves_again(10.0, 15.0, [9.0, 12.0], [13.0], [14.0]) == (True, "")
    assert serves_again(10.0, 15.0, [12.0], [], []) == (True, "")  # nothing delivered: the registry says
    ok, why = serves_again(10.0, 15.0, [9.0, 26.0], [], [])  # down (or degraded) until after the bound
    assert not ok and "registry" in why
    ok, why = serves_again(10.0, 15.0, [12.0], [13.0, 14.0], [9.0, 40.0])  # a gate left closed: jobs, no answers
    assert not ok and "none answered" in why
