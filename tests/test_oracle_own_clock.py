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


def test_a_time_both_lives_contain_is_read_on_the_clock_of_the_one_alive_when_its_answer_was_seen() -> None:
    # Campaign 15, seed 1409: a w4 skewed 1.146 s ahead, ended at 31.0; an unskewed w4 from 31.024
    # activated v9 (committed at 30.931) and answered at 31.536 by its clock. 31.536 - 1.146 also
    # falls in the skewed life: read by it, the answer "finished" before v9's commit.
    lives = [proc(21.955, 31.0, 1.146), proc(31.024, None)]
    for p in lives:
        p.worker_id = "w4"
    oracle = SimpleNamespace(tl=SimpleNamespace(workers=lives))
    assert Oracle.by_own_clock(oracle, "w4", 31.536) == 31.536 - 1.146  # ambiguous without the wiretap
    assert Oracle.by_own_clock(oracle, "w4", 31.536, seen=31.55) == 31.536  # published after the old life ended
    assert Oracle.by_own_clock(oracle, "w4", 25.0 + 1.146, seen=25.01) == 25.0  # the skewed life's own answer
