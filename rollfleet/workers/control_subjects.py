"""The core subjects that steer a replica, and what each message on them does: its bell (work
waits for it on a subject, or a session's turn on its own subject, or a session ended), a
trainer's cancel, job consumers declared, and a jobs consumer's leader moving.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine
from typing import Any

from rollfleet.broker.types import NATS, Msg
from rollfleet.schemas import Names
from rollfleet.schemas.bell_wire import bell_waited_s, parse_bell_payload, parse_end_session
from rollfleet.workers.engines import Engine
from rollfleet.workers.job_puller import JobPuller
from rollfleet.workers.job_runner import JobRunner


class ControlSubjects:
    def __init__(
        self,
        names: Names,
        worker_id: str,
        *,
        pulling: JobPuller,
        jobs: JobRunner,
        engine: Engine,
        spawn: Callable[[Coroutine[Any, Any, Any]], None],
    ) -> None:
        self._names = names
        self._worker_id = worker_id
        self._pulling = pulling
        self._jobs = jobs
        self._engine = engine
        self._spawn = spawn

    async def subscribe(self, nc: NATS) -> None:
        """Its bell, cancels, consumers declared, leader moves."""
        names = self._names
        await nc.subscribe(names.bell_subject(self._worker_id), cb=self._on_bell)
        await nc.subscribe(names.cancel_subject(), cb=self._on_cancel)
        await nc.subscribe(names.consumers_declared, cb=self._on_declared)
        await nc.subscribe(names.consumer_leader_advisory(names.jobs_stream), cb=self._on_leader)

    async def _on_cancel(self, msg: Msg) -> None:
        """A trainer cancelled a job: if it runs here, it stops and is answered with what it made."""
        self._jobs.cancel(msg.data.decode(errors="replace")[:64])

    async def _on_bell(self, msg: Msg) -> None:
        if msg.data == Names.REPLICA_BELL:  # a session's turn waits on this replica's own subject
            self._pulling.own_pending()
            return
        ended = parse_end_session(msg.data)
        if ended is not None:
            self._spawn(self._engine.end_session(ended))
            return
        parsed = parse_bell_payload(msg.data)
        if parsed is None:
            return  # (a client's liveness probe, or noise)
        subject, stalled = parsed
        self._pulling.bell(subject, stalled, waited_s=bell_waited_s(msg.headers))

    async def _on_declared(self, _: Msg) -> None:
        self._pulling.declared()

    async def _on_leader(self, msg: Msg) -> None:
        self._pulling.leader_changed(msg.subject.rpartition(".")[2])
