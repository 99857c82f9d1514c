"""The oracle's floor for a session turn with no constraint of its own: the newest version the
trainer may have seen as `latest` when it sent the turn. A racing publisher's commit lands
anywhere in its window, and the harness notes it only once the race is over; campaign 6, seed
844418: a turn was stored at min:18 while the race for v18 was being noted, was judged as min:17,
and the replicas serving 17 were taken for ones that let it starve."""

from __future__ import annotations

import time
from typing import Any

from tests.oracle_histories import echo_worker, history_oracle


def _turn_floor(race_started_before_s: float, race_noted_after_s: float) -> tuple[str, int] | None:
    t = time.time()
    journal: list[dict[str, Any]] = [
        {"ev": "session_open", "sid": "s0", "policy": "free", "constraint": {}, "retry": "at_most_once",
         "t": t - 1.0, "inc": 0},
        {"ev": "turn", "rid": "0:1", "op": "turn", "sid": "s0", "turn": 0, "key": "s0/0",
         "payload": {"prompt": [1, 5], "max_tokens": 8, "n": 1}, "timeout": 14.0, "t": t, "inc": 0},
    ]  # fmt: skip
    commits = [(17, t - 9.0, t - 8.9), (18, t - race_started_before_s, t + race_noted_after_s)]
    oracle = history_oracle(journal, timeline={"workers": [echo_worker("w1", t - 10)], "commits": commits})
    (turn,) = [c for c in oracle.calls if c.key == "s0/0"]
    return oracle._turn_constraint(turn)


def test_a_turn_sent_while_a_commit_was_under_way_may_have_asked_for_it() -> None:
    assert _turn_floor(race_started_before_s=0.14, race_noted_after_s=0.06) == ("min", 18)


def test_a_commit_begun_after_the_turn_is_not_its_floor() -> None:
    assert _turn_floor(race_started_before_s=-0.5, race_noted_after_s=0.7) == ("min", 17)
