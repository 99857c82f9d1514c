"""The oracle's ``_unseen_delivery`` (used by ``delivered`` and ``resumed``) across a broker rollback:
the broker restarted on an older copy of its store counts a job's deliveries from 1 again, so a
first delivery the wiretap missed before the rollback leaves no hole in the attempts it saw after.
Seed 10 (``--autoscale 3:5``): a resumable job answered by a replica 1 s into the rollback's lost
window, its delivery unseen (the replica had started 5 s before), delivered again as attempt 1
after the restart: flagged "tokens by a replica which was never delivered the job"."""

from __future__ import annotations

from reliability.adversary.oracle import Oracle
from reliability.adversary.tap import Delivery
from tests.oracle_histories import history_oracle

T = 1_000_000.0


def _oracle(stores_lost: list[dict[str, float | str]]) -> Oracle:
    again = Delivery(
        t=T + 9.0,
        inbox="_INBOX.adv.worker.w2.x.1",
        ack="$JS.ACK.RF_ADV_JOBS.min-5.1.111.5.1.0",
        job_id="j",
        key="k",
        client_id="trainer",
        constraint=("min", 5),
        retry="resume",
        session_id=None,
        fingerprint="f",
        stream_seq=111,
        attempt=1,
        consumer="min-5",
        worker="w2",
    )
    oracle = history_oracle([], timeline={"stores_lost": stores_lost}, build=False,
                            tap={"deliveries": [again], "stored_jobs": {"j": 1}},
                            cfg={"seed": 10, "ack_wait": 2.0, "duplicate_window": 15.0, "duration": 60})  # fmt: skip
    oracle.deliveries_by_job = {"j": [again]}
    return oracle


def test_a_delivery_before_a_rollback_that_the_wiretap_missed_is_not_verifiable() -> None:
    rollback = {"kind": "rollback", "lost_from": T + 1.0, "at": T + 6.0, "back": T + 8.0}
    assert _oracle([rollback])._unseen_delivery("j", T, T + 3.0, 1) is not None


def test_with_no_store_lost_the_attempts_seen_are_every_delivery() -> None:
    assert _oracle([])._unseen_delivery("j", T, T + 3.0, 1) is None
    # (a rollback whose lost writes came after the run lost no delivery of it)
    later = {"kind": "rollback", "lost_from": T + 4.0, "at": T + 6.0, "back": T + 8.0}
    assert _oracle([later])._unseen_delivery("j", T, T + 3.0, 1) is None
