"""The oracle's ``second-client`` invariant: at most one live client holds the trainer's id.

A trainer restarting at the moment a second client connects with its id races it for the id's
lease; one of them wins and the other is refused ``ClientIdInUse`` (campaign seed 7: the
restarted trainer lost). Who won is not the promise; both holding the id at once is a violation.
"""

from __future__ import annotations

from typing import Any

import pytest

from tests.oracle_histories import history_oracle

T0 = 1_000.0


def _violations(journal: list[dict[str, Any]], second: dict[str, Any], trainers: list[dict[str, Any]]) -> list[str]:
    oracle = history_oracle(journal, timeline={"trainers": trainers, "second_clients": [second]})
    oracle._check_second_clients()
    return [v.message for v in oracle.violations if v.check == "second-client"]


TRAINERS = [
    {"incarnation": 0, "pid": 1, "start": T0, "end": T0 + 30.0, "how": "killed"},
    {"incarnation": 1, "pid": 2, "start": T0 + 31.4, "end": T0 + 70.0, "how": "exited 1"},
]
SECOND = {"t": T0 + 31.5, "trainer_incarnation": 1, "kind": "connected", "t_connected": T0 + 33.6,
          "t_closed": T0 + 33.7, "trainer_alive": True}  # fmt: skip
STARTS = [{"ev": "start", "inc": 0, "t": T0 + 0.5}, {"ev": "connected", "inc": 0, "t": T0 + 0.6},
          {"ev": "start", "inc": 1, "t": T0 + 32.0}]  # fmt: skip


def test_a_second_client_that_won_the_id_from_a_trainer_starting_at_that_moment_is_no_violation() -> None:
    # (Before: any second client that connected while a trainer process was alive was flagged.)
    assert _violations(STARTS, SECOND, TRAINERS) == []


@pytest.mark.parametrize("connected_at", [31.9, 33.65])
def test_a_second_client_connected_while_a_trainer_holds_the_id_is_a_violation(connected_at: float) -> None:
    journal = [*STARTS, {"ev": "connected", "inc": 1, "t": T0 + connected_at}]
    assert len(_violations(journal, SECOND, TRAINERS)) == 1


def test_a_trainer_that_connected_only_after_the_second_client_closed_is_no_violation() -> None:
    journal = [*STARTS, {"ev": "connected", "inc": 1, "t": T0 + 34.5}]
    assert _violations(journal, SECOND, TRAINERS) == []


def test_a_second_client_refused_is_no_violation_and_a_record_without_times_is_judged_as_held() -> None:
    refused = {"t": T0 + 31.5, "trainer_incarnation": 1, "cls": "ClientIdInUse", "trainer_alive": True}
    assert _violations(STARTS, refused, TRAINERS) == []
    older = {k: v for k, v in SECOND.items() if k not in ("t_connected", "t_closed")}
    assert len(_violations(STARTS, older, TRAINERS)) == 1
