"""A rogue worker: a legitimate worker user of the namespace (its own id and password in the
generated auth config) that tries to read the other workers' job deliveries and to have its
forged answers accepted.

- **Snooping.** For a while (``snoop``) it subscribes to the worker inboxes of everyone
  (``_INBOX.<ns>.worker.>``, each other worker's own inbox, ``_INBOX.>``) and records every job
  delivery it receives: prompt, job id, fingerprint, ack subject. It never pulls a job itself,
  so every delivery it sees was meant for another replica. Where the broker lets it, that
  subscription alone also keeps every cancelled pull request of every worker alive (the broker
  sees interest in its reply subject), so jobs are delivered into the void until their
  ack-wait passes: the snooping windows are short, and part of the schedule.
- **Forging.** Before the trainer submits them, it stores answers for keys a trainer is likely
  to use (``k``, ``sample``, ...) with an empty fingerprint and a made-up job id, claiming to
  be ``w1``; and for a share of the deliveries it snooped it races the real worker with an
  answer that copies the job id, fingerprint and constraint. Every forged completion is made of
  ``FORGED_TOKEN`` only, and each forgery is journaled, so the oracle can tell one apart from
  anything a worker could generate.

Refusals by the broker (permission violations) are recorded too: they are what should happen.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from typing import Any

from reliability.adversary.journal import FORGED_TOKEN, Journal
from reliability.adversary.tap import parse_ack


class Rogue:
    def __init__(
        self,
        url: str,
        names: Any,
        *,
        worker_id: str,
        victims: list[str],
        client_id: str,
        journal: Journal,
        seed: int,
        user: str | None = None,
        password: str | None = None,
        copy_share: float = 0.2,
        max_copies: int = 40,
    ) -> None:
        self.url, self.names, self.worker_id, self.victims = url, names, worker_id, victims
        self.client_id = client_id
        self.journal = journal
        self.rng = random.Random(f"rogue:{seed}")
        self.user, self.password = user, password
        self.copy_share, self.max_copies = copy_share, max_copies
        self.nc: Any = None
        self.js: Any = None
        self.snooped = 0
        self.snooped_keys: set[str] = set()
        self.copies = 0
        self.forged = 0
        self.refusals: list[str] = []
        self.latest = 0
        self._tasks: set[asyncio.Task[Any]] = set()

    def log(self, record: dict[str, Any]) -> None:
        record.setdefault("t", time.time())
        self.journal.write(record, sync=False)

    async def start(self) -> Rogue:
        import nats

        async def error(exc: Exception) -> None:
            text = str(exc)
            self.refusals.append(text)
            self.log({"ev": "refused", "error": text[:300]})

        opts: dict[str, Any] = dict(
            servers=self.url.split(","),
            name=f"rollfleet-worker-{self.worker_id}",
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.3,
            error_cb=error,
            inbox_prefix=self.names.inbox_prefix("worker"),
        )
        if self.user:
            opts.update(user=self.user, password=self.password)
        self.nc = await nats.connect(**opts)
        self.js = self.nc.jetstream(timeout=2.0)
        return self

    async def snoop(self, for_s: float) -> None:
        """Subscribe to every other worker's inbox for ``for_s`` seconds (refusals are recorded)."""
        patterns = [self.names.inbox_prefix("worker") + ".>", f"_INBOX.{self.names.namespace}.>", "_INBOX.>"]
        for victim in self.victims:
            with contextlib.suppress(TypeError, Exception):  # (a per-worker inbox, where the layout has one)
                patterns.append(self.names.inbox_prefix("worker", victim) + ".>")
        subs = []
        for pattern in dict.fromkeys(patterns):
            with contextlib.suppress(Exception):
                subs.append(await self.nc.subscribe(pattern, cb=self._on_snooped))
                self.log({"ev": "snoop", "pattern": pattern, "for_s": for_s})
        with contextlib.suppress(Exception):
            await self.nc.flush()
        try:
            await asyncio.sleep(for_s)
        finally:
            for sub in subs:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()

    async def close(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.close()

    async def _on_snooped(self, msg: Any) -> None:
        from rollfleet.schemas import RolloutJob, decode

        ack = parse_ack(msg.reply or "")
        if ack is None or ack[0] != self.names.jobs_stream:
            return
        try:
            job = decode(msg.data, RolloutJob, what="rollout job")
        except Exception:
            return
        if job.job_id in self.snooped_keys:
            return  # the same delivery through a second pattern
        self.snooped_keys.add(job.job_id)
        self.snooped += 1
        self.log({"ev": "snooped", "job_id": job.job_id, "key": job.idempotency_key, "inbox": msg.subject})
        if self.copies < self.max_copies and self.rng.random() < self.copy_share:
            self.copies += 1
            task = asyncio.ensure_future(self.forge(job.idempotency_key, "copy", job=job))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _forged_result(self, key: str, job: Any | None, pretend: str) -> Any:
        from rollfleet.schemas import Completion, RolloutResult, VersionSpan

        version = job.constraint.version if job is not None else self.latest
        tokens = [FORGED_TOKEN] * 8
        return RolloutResult(
            job_id=job.job_id if job is not None else f"forged{self.rng.randrange(10**9)}",
            idempotency_key=key,
            client_id=self.client_id,
            outputs=[
                Completion(
                    token_ids=tokens,
                    finish_reason="stop",
                    logprobs=[0.0] * len(tokens),
                    weight_versions=[VersionSpan(version=version, start=0, end=len(tokens))],
                )
            ],
            version_start=version,
            version_end=version,
            worker_id=pretend,
            engine="echo",
            queue_wait_s=0.0,
            generation_s=0.01,
            delivery_attempt=1,
            finished_at=time.time(),
            session_id=job.session_id if job is not None else None,
            fingerprint=job.fingerprint if job is not None else "",
            constraint=job.constraint if job is not None else None,
        )

    def _subjects(self, key: str, job_id: str, pretend: str) -> list[str]:
        """Where an answer for ``key`` is stored, in whichever layout this code has."""
        n = self.names
        out: list[str] = []
        c = self.client_id
        layouts = ((c, key), (c, key, job_id, pretend), (c, key, job_id, self.worker_id))
        for args in layouts:
            with contextlib.suppress(TypeError, Exception):
                out.append(n.result_subject(*args))
        return list(dict.fromkeys(out))

    async def forge(self, key: str, mode: str, job: Any | None = None) -> None:
        from rollfleet.schemas import encode

        pretend = self.rng.choice(self.victims) if self.victims else "w1"
        result = self._forged_result(key, job, pretend)
        data = encode(result)
        async def one(subject: str) -> None:
            outcome = "stored"
            try:
                ack = await self.js.publish(subject, data, headers={"Nats-Msg-Id": key})
                outcome = "duplicate" if ack.duplicate else "stored"
            except Exception as exc:
                outcome = f"refused: {type(exc).__name__}"
            self.forged += 1
            self.log({"ev": "forge", "mode": mode, "key": key, "job_id": result.job_id, "pretend": pretend,
                      "subject": subject, "outcome": outcome, "fingerprint": result.fingerprint})

        await asyncio.gather(*(one(s) for s in self._subjects(key, result.job_id, pretend)))

    async def pre_forge(self, keys: list[str]) -> None:
        """Forge answers for ``keys`` at once (a refused publish costs its ack's time-out)."""
        await asyncio.gather(*(self.forge(key, "pre") for key in keys))
