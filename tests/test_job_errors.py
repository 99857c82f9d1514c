"""A job whose handling fails in a way nothing expected (a defect, a broker error no step
caught) is handed back at once and said in the log: left unacknowledged it would come back only
after ``ack_wait`` (30 s), past its deadline, with nothing in any log. Real processes and
nats-server; the error is injected in the worker process (``ROLLFLEET_FAULT=raise:<point>``)."""

from __future__ import annotations

from pathlib import Path

from harness import running_worker
from harness.processes import start_worker_process, stop_all
from rollfleet.runtime import faults
from rollfleet.trainer_client import RolloutClient
from tests.helpers import payload


async def test_a_job_whose_handling_fails_unexpectedly_is_handed_back_at_once(
    nats_url: str, namespace: str, tmp_path: Path
) -> None:
    log = tmp_path / "faulty.log"
    faulty = start_worker_process(
        nats_url, namespace, "faulty", log_path=log, env=faults.env("raise", "worker:job-delivered")
    )
    try:
        async with (
            await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client,
            running_worker(nats_url, namespace, worker_id="good"),
        ):
            await client.wait_for_version(0, replicas=2, timeout=30)
            failed = 0
            for tag in range(12):  # until the faulty replica has failed a few (both pull there)
                handle = await client.submit(payload([tag]), min_version=0, timeout=20.0)
                # ack_wait is 30 s: a job dropped unacknowledged would not be answered in time.
                result = await handle.result(6)
                assert result.worker_id == "good"
                failed = log.read_text().count("handling a job failed; handed back")
                if failed >= 2:
                    break
            assert failed >= 1, "no job reached the faulty replica"
            assert faulty.poll() is None  # it lives on, and serves again once its defect is fixed
    finally:
        stop_all([faulty])
