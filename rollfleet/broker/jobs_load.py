"""What the jobs stream holds on each subject: jobs waiting, jobs delivered and not yet
acknowledged, and when the oldest waiting one was stored (the fleet's control loop sizes the
fleet on these).

One look costs one stream-info request (the stored count per subject), and for each subject that
holds jobs one consumer-info request (its ``NumPending`` and ``NumAckPending``) and, when jobs
wait, one message get (the first job past those delivered: its broker timestamp). An idle
namespace costs the one request. Every subject's consumer has a name the namespace gives it
(``Names.job_consumer``, ``Names.replica_consumer``); a subject whose consumer is not declared
yet counts every stored job as waiting.
"""

from __future__ import annotations

from dataclasses import dataclass

import nats.js.errors
from nats.js import JetStreamContext

from rollfleet.schemas import Names


@dataclass(frozen=True)
class SubjectJobs:
    stored: int  # in the stream (a work queue: waiting, or delivered and not yet acknowledged)
    pending: int  # not yet delivered
    in_flight: int  # delivered, not yet acknowledged
    oldest_at: float | None  # unix time the broker stored the oldest waiting job (None: none waits)


def _consumer(names: Names, subject: str) -> str | None:
    parsed = names.parse_job_subject(subject)
    if parsed is not None:
        return names.job_consumer(*parsed)
    worker_id = names.parse_replica_job_subject(subject)
    return names.replica_consumer(worker_id) if worker_id is not None else None


async def jobs_on_subjects(js: JetStreamContext, names: Names) -> dict[str, SubjectJobs]:
    """Every jobs subject that holds a job, by subject."""
    info = await js.stream_info(names.jobs_stream, subjects_filter=names.jobs_wildcard)
    out: dict[str, SubjectJobs] = {}
    for subject, stored in (info.state.subjects or {}).items():
        if not stored:
            continue
        pending, in_flight, delivered = int(stored), 0, 0
        consumer = _consumer(names, subject)
        if consumer is not None:
            try:
                ci = await js.consumer_info(names.jobs_stream, consumer)
            except nats.js.errors.NotFoundError:
                pass
            else:
                pending, in_flight = int(ci.num_pending or 0), int(ci.num_ack_pending or 0)
                delivered = int(ci.delivered.stream_seq or 0) if ci.delivered is not None else 0
        oldest_at = None
        if pending > 0:
            try:
                msg = await js.get_msg(names.jobs_stream, seq=delivered + 1, subject=subject, next=True)
            except nats.js.errors.NotFoundError:
                pass  # (taken meanwhile)
            else:
                oldest_at = msg.time.timestamp() if msg.time is not None else None
        out[subject] = SubjectJobs(stored=int(stored), pending=pending, in_flight=in_flight, oldest_at=oldest_at)
    return out
