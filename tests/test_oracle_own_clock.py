"""The oracle reads a time a worker wrote on its own clock as the harness's (milliseconds)."""

from __future__ import annotations

from types import SimpleNamespace

from reliability.adversary.oracle import Oracle


def proc(start: float, end: float | None, skew_s: float = 0.0) -> SimpleNamespace:
    return SimpleNamespace(worker_id="w2", start=start, end=end, skew_s=skew_s)


def test_a_time_is_read_on_the_clock_of_the_process_alive_when_it_was_written() -> None:
    # A skewed w2 (its clocks 1.93 s ahead) SIGKILLed at 25.86, an unskewed w2 started at 27.47.
    oracle = SimpleNamespace(tl=SimpleNamespace(workers=[proc(0.0, 5.0), proc(5.4, 25.86, 1.93), proc(27.47, None)]))
    assert Oracle.by_own_clock(oracle, "w2", 20.0 + 1.93) == 20.0  # written by the skewed one
    assert Oracle.by_own_clock(oracle, "w2", 27.8) == 27.8  # the new one's: no skew to take off
    alone = SimpleNamespace(tl=SimpleNamespace(workers=[proc(5.4, 25.86, 1.93)]))
    assert Oracle.by_own_clock(alone, "w2", 25.86 + 1.93 + 0.5) == 25.86 + 0.5  # an end noted late
    assert Oracle.by_own_clock(oracle, "w1", 27.8) == 27.8
