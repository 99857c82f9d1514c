"""The oracle's own eyes on the broker: a wiretap that trusts nothing the project counts.

A privileged connection (the tap user the adversary adds to the generated auth config, or
anyone on a broker without auth) subscribes to:

- each worker inbox that is waiting for jobs, exactly (``<inbox>.*``, never a wildcard over
  all inboxes): each job delivery, decoded as a RolloutJob, attributed to the worker whose
  connection holds that inbox subscription, as the broker's monitoring endpoint says
  (``/connz?subs=1``; worker connections are named ``rollfleet-worker-<worker_id>``). An inbox
  is mirrored as soon as a pull request names it (the tap hears the requests) or /connz shows
  it, and dropped as soon as /connz no longer does: a subscription that outlives the worker's
  would keep a cancelled pull request alive at the broker (it checks the reply subject's
  interest) and jobs would be delivered into the void. A wildcard over every worker inbox
  does exactly that, which is why the tap never holds one (and why a rogue worker that does
  hurts everyone, see ``rogue``);
- every jobs subject: each job as its client stored it (its id, when, and its prompt's digest),
  whoever it is then delivered to;
- every results subject: each answer as published (before the results stream deduplicates
  it), chunks reassembled and checked against their head;
- the jobs stream's ack subjects: acks, naks (hand-backs), progress, terms, per delivery;
- version announcements, the fleet registry's writes and the claims bucket's writes;
- the broker's advisories of every stream and jobs consumer it creates, each then described by
  the broker itself (``stream_info``, ``consumer_info``): the settings a declaration really got,
  whoever declared it (a gateway once declared the fleet's consumers with its own defaults).

It also records when it was disconnected (a broker restart): what happened then is
unverifiable, never a finding. Nothing here judges; ``oracle`` does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Any

import xxhash

from reliability.adversary.journal import FORGED_TOKEN, describe_result, prompt_digest
from rollfleet.broker.topology import topology_streams

WORKER_CONN_PREFIX = "rollfleet-worker-"


@dataclass
class Delivery:
    t: float
    inbox: str
    ack: str
    job_id: str | None
    key: str | None
    client_id: str | None
    constraint: tuple[str, int] | None
    retry: str | None
    session_id: str | None
    fingerprint: str | None
    stream_seq: int | None
    attempt: int | None
    consumer: str | None
    max_tokens: int = 0
    submitted_at: float = 0.0
    deadline: float = 0.0  # the job's, as its client stored it
    worker: str | None = None  # resolved from /connz
    also: list[str] = field(default_factory=list)  # other workers a mirror of the same inbox named
    prompt: str | None = None  # ``journal.prompt_digest`` of the job's prompt tokens


@dataclass
class Published:
    t: float
    subject: str
    kind: str  # result | failure | chunked | undecodable
    key: str | None
    job_id: str | None
    worker: str | None  # as the answer claims it
    digest: str  # of the message bytes
    desc: dict[str, Any] | None = None  # describe_result of a result (or of a reassembled chunked one)
    code: str | None = None
    assembled: bool | None = None  # chunked: whether the chunks seen add up to the head


def parse_ack(reply: str) -> tuple[str, str, int, int] | None:
    """(stream, consumer, delivered count, stream sequence) of a JetStream ack subject."""
    t = reply.split(".")
    if len(t) < 9 or t[0] != "$JS" or t[1] != "ACK":
        return None
    try:
        if len(t) == 9:
            return t[2], t[3], int(t[4]), int(t[5])
        return t[4], t[5], int(t[6]), int(t[7])  # v2: domain and account hash come first
    except ValueError:
        return None


class Tap:
    def __init__(
        self,
        url: str,
        names: Any,
        monitor_ports: int | list[int],
        *,
        user: str | None = None,
        password: str | None = None,
    ) -> None:
        self.url = url
        self.names = names
        # One port per broker node: a cluster's /connz shows only the connections of its own node.
        self.monitor_ports = [monitor_ports] if isinstance(monitor_ports, int) else list(monitor_ports)
        self.user, self.password = user, password
        self.nc: Any = None
        self.deliveries: list[Delivery] = []
        self._by_ack: dict[str, Delivery] = {}
        self._tapped: set[str] = set()  # worker inbox subscriptions the tap mirrored, ever
        self._mirrors: dict[str, tuple[Any, str, float]] = {}  # inbox sub -> (subscription, worker, since)
        self.acks: dict[str, list[tuple[float, str]]] = defaultdict(list)  # ack subject -> (t, kind)
        self.published: list[Published] = []
        # job id -> how many times it was stored on a jobs subject (a turn moved off its replica, or
        # stored again because its holder died, is the same job stored twice)
        self.stored_jobs: dict[str, int] = {}
        # (t, job id, subject) of every job stored: where a job lay, and when it moved
        self.job_stores: list[tuple[float, str, str]] = []
        self.job_submitted: dict[str, float] = {}  # job id -> its ``submitted_at``, as its client stamped it
        # job id -> [its client id, ``prompt_digest`` of its prompt], as its client stored it: heard
        # whoever the job is then delivered to (an inbox is mirrored only once a pull request names
        # it, so the first deliveries to a fresh one can pass unseen)
        self.job_prompts: dict[str, list[str | None]] = {}
        self.activations: list[tuple[float, Any]] = []
        self.announced: list[tuple[float, Any]] = []  # versions.published
        self.fleet: list[tuple[float, str, Any]] = []  # (t, worker_id, ReplicaStatus | None)
        # (t, key, value, op, status): status "stored" / "refused" from the broker's reply to the
        # worker (a refused create is published on the subject all the same), None if unseen.
        self.claims: list[list[Any]] = []
        self._claim_replies: dict[str, int] = {}
        self.gaps: list[list[float]] = []  # [disconnected, reconnected]
        # [t, "stream" | "consumer", name, settings | None]: what the broker says it created (None:
        # gone, or the broker away, before it could be read)
        self.declared: list[list[Any]] = []
        self._describing: set[asyncio.Task[None]] = set()
        self.subs_seen: dict[str, tuple[str, str]] = {}  # subscription subject -> (connection name, user)
        self.unresolved = 0
        self._chunks: dict[str, list[tuple[float, bytes]]] = defaultdict(list)
        self._poll_task: asyncio.Task[None] | None = None
        self._poll_now = asyncio.Event()
        self.polls = 0
        self.poll_errors = 0
        # A connection's inboxes share the first 12 characters of their NUID token: learnt from
        # /connz, it names the worker of an inbox the tap has not mirrored yet (a pull request's).
        self.nuid_owner: dict[str, str] = {}

    # -- connecting --------------------------------------------------------------------------
    async def start(self) -> Tap:
        import nats

        async def disconnected() -> None:
            self.gaps.append([time.time(), float("inf")])

        async def reconnected() -> None:
            if self.gaps and self.gaps[-1][1] == float("inf"):
                self.gaps[-1][1] = time.time()
            self._poll_now.set()

        async def error(exc: Exception) -> None:
            pass

        opts: dict[str, Any] = dict(
            servers=self.url.split(","),
            name="adversary-tap",
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.2,
            disconnected_cb=disconnected,
            reconnected_cb=reconnected,
            error_cb=error,
            pending_size=256 * 1024 * 1024,
        )
        if self.user:
            opts.update(user=self.user, password=self.password)
        self.nc = await nats.connect(**opts)
        n = self.names
        await self.nc.subscribe(n.results_wildcard, cb=self._on_result, pending_msgs_limit=-1)
        await self.nc.subscribe(n.jobs_wildcard, cb=self._on_job_stored, pending_msgs_limit=-1)
        await self.nc.subscribe(f"$JS.ACK.{n.jobs_stream}.>", cb=self._on_ack, pending_msgs_limit=-1)
        await self.nc.subscribe(f"$JS.API.CONSUMER.MSG.NEXT.{n.jobs_stream}.>", cb=self._on_pull, pending_msgs_limit=-1)
        await self.nc.subscribe(n.events_wildcard, cb=self._on_version, pending_msgs_limit=-1)
        await self.nc.subscribe(f"$KV.{n.fleet_bucket}.>", cb=self._on_fleet, pending_msgs_limit=-1)
        await self.nc.subscribe(f"$KV.{n.claims_bucket}.>", cb=self._on_claim, pending_msgs_limit=-1)
        await self.nc.subscribe("$JS.EVENT.ADVISORY.STREAM.CREATED.*", cb=self._on_stream_created)
        await self.nc.subscribe(
            f"$JS.EVENT.ADVISORY.CONSUMER.CREATED.{n.jobs_stream}.*", cb=self._on_consumer_created
        )
        await self.nc.flush()
        await self._describe_existing()
        self._poll_task = asyncio.create_task(self._poll_connz())
        return self

    # -- what the broker created -----------------------------------------------------------
    async def _describe_existing(self) -> None:
        """What the namespace already had when the tap started (declared before it listened)."""
        for stream in topology_streams(self.names):
            await self._describe(stream)
        with contextlib.suppress(Exception):
            for info in await self.nc.jetstream().consumers_info(self.names.jobs_stream):
                self._record("consumer", info.name, _consumer_settings(info.config))

    async def _on_stream_created(self, msg: Any) -> None:
        stream = msg.subject.rsplit(".", 1)[-1]
        if stream in topology_streams(self.names):
            self._spawn_describe(stream)

    async def _on_consumer_created(self, msg: Any) -> None:
        self._spawn_describe(self.names.jobs_stream, msg.subject.rsplit(".", 1)[-1])

    def _spawn_describe(self, stream: str, consumer: str | None = None) -> None:
        task = asyncio.ensure_future(self._describe(stream, consumer))
        self._describing.add(task)
        task.add_done_callback(self._describing.discard)

    async def _describe(self, stream: str, consumer: str | None = None) -> None:
        """Record ``stream`` (or its ``consumer``) as the broker describes it now."""
        js = self.nc.jetstream()
        kind, name = ("stream", stream) if consumer is None else ("consumer", consumer)
        try:
            if consumer is None:
                settings = _stream_settings((await js.stream_info(stream)).config)
            else:
                settings = _consumer_settings((await js.consumer_info(stream, consumer)).config)
        except Exception:  # deleted meanwhile, or the broker away: unverifiable, never a finding
            settings = None
        self._record(kind, name, settings)

    def _record(self, kind: str, name: str, settings: dict[str, Any] | None) -> None:
        self.declared.append([time.time(), kind, name, settings])

    async def described(self) -> None:
        """Every creation seen so far described (before the oracle reads ``declared``)."""
        if self._describing:
            await asyncio.wait(list(self._describing), timeout=5.0)

    async def close(self) -> None:
        await self.described()
        if self._poll_task is not None:
            self._poll_task.cancel()
            with contextlib.suppress(BaseException):
                await self._poll_task
        if self.nc is not None:
            with contextlib.suppress(Exception):
                await self.nc.close()

    # -- attribution ---------------------------------------------------------------------------
    def _connz_of(self, port: int) -> dict[str, Any]:
        url = f"http://127.0.0.1:{port}/connz?subs=1&limit=4096"
        with urllib.request.urlopen(url, timeout=3 if len(self.monitor_ports) == 1 else 1) as resp:
            return json.loads(resp.read())

    async def _connz(self) -> tuple[dict[str, Any], bool]:
        """Every node's connections, and whether every node answered (a node killed or frozen
        does not: its connections are then unknown, not gone)."""
        docs = await asyncio.gather(
            *(asyncio.to_thread(self._connz_of, port) for port in self.monitor_ports), return_exceptions=True
        )
        answered = [d for d in docs if isinstance(d, dict)]
        if not answered:
            raise next(d for d in docs if isinstance(d, BaseException))
        connections = [c for d in answered for c in d.get("connections") or []]
        return {"connections": connections}, len(answered) == len(docs)

    async def poll_once(self) -> None:
        try:
            doc, complete = await self._connz()
        except Exception:
            self.poll_errors += 1
            return
        self.polls += 1
        inboxes = self.names.inbox_prefix("worker") + "."
        held: dict[str, str] = {}  # worker inbox subscriptions live now -> worker id
        for conn in doc.get("connections") or []:
            name = conn.get("name") or ""
            user = conn.get("authorized_user") or ""
            worker = name[len(WORKER_CONN_PREFIX) :] if name.startswith(WORKER_CONN_PREFIX) else None
            for sub in conn.get("subscriptions_list") or []:
                self.subs_seen.setdefault(sub, (name, user))
                if worker is None or not sub.startswith(inboxes) or sub.endswith(">"):
                    continue
                held[sub] = worker
                nuid = _nuid(sub)
                if nuid:
                    self.nuid_owner.setdefault(nuid[:12], worker)
        now = time.monotonic()
        for sub, worker in held.items():
            await self._mirror(sub, worker, confirmed=True)
        for sub, m in list(self._mirrors.items()):
            if not complete:
                break  # (a node that did not answer may hold it)
            if sub not in held and now - m[2] > 0.3:  # the worker let it go: so does the tap, at once
                del self._mirrors[sub]
                with contextlib.suppress(Exception):
                    await m[0].unsubscribe()

    async def _mirror(self, sub: str, worker: str, confirmed: bool) -> None:
        m = self._mirrors.get(sub)
        if m is not None:
            if confirmed and m[1] != worker:
                self._mirrors[sub] = (m[0], worker, m[2])
            return
        if self.nc is None:
            return
        self._mirrors[sub] = (None, worker, time.monotonic())  # (claimed before the await)
        try:
            s = await self.nc.subscribe(sub, cb=self._deliver_cb(sub))
        except Exception:
            self._mirrors.pop(sub, None)
            return
        self._tapped.add(sub)
        if sub in self._mirrors:
            _, owner, since = self._mirrors[sub]
            self._mirrors[sub] = (s, owner, since)
        else:  # dropped meanwhile
            with contextlib.suppress(Exception):
                await s.unsubscribe()

    async def _poll_connz(self) -> None:
        while True:
            await self.poll_once()
            self._poll_now.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._poll_now.wait(), 0.1)

    async def resolve(self) -> None:
        self.unresolved = sum(1 for d in self.deliveries if d.worker is None)

    # -- what the tap hears ----------------------------------------------------------------------
    async def _on_pull(self, msg: Any) -> None:
        """A worker's pull request: mirror its inbox at once, its owner known by its NUID prefix
        (confirmed by the next look at /connz)."""
        inboxes = self.names.inbox_prefix("worker") + "."
        reply = msg.reply or ""
        if not reply.startswith(inboxes):
            return
        sub = reply.rsplit(".", 1)[0] + ".*"
        if sub in self._mirrors:
            return
        owner = self.subs_seen.get(sub, ("", ""))[0]
        owner = owner[len(WORKER_CONN_PREFIX) :] if owner.startswith(WORKER_CONN_PREFIX) else None
        nuid = _nuid(sub)
        owner = owner or (self.nuid_owner.get(nuid[:12]) if nuid else None)
        self._poll_now.set()
        if owner is not None:
            await self._mirror(sub, owner, confirmed=False)

    def _deliver_cb(self, sub: str) -> Any:
        async def cb(msg: Any) -> None:
            m = self._mirrors.get(sub)
            self._on_delivery(msg, m[1] if m else None)

        return cb

    def _on_delivery(self, msg: Any, worker: str | None) -> None:
        from rollfleet.schemas import RolloutJob, decode

        if self._claim_replies and self._on_reply(msg):
            return
        reply = msg.reply or ""
        ack = parse_ack(reply)
        if ack is None or ack[0] != self.names.jobs_stream:
            return  # an API reply or a status, not a job
        d = self._by_ack.get(reply)
        if d is None:
            try:
                job: Any = decode(msg.data, RolloutJob, what="rollout job")
            except Exception:
                job = None
            d = Delivery(
                t=time.time(),
                inbox=msg.subject,
                ack=reply,
                job_id=getattr(job, "job_id", None),
                key=getattr(job, "idempotency_key", None),
                client_id=getattr(job, "client_id", None),
                constraint=(job.constraint.kind, job.constraint.version) if job is not None else None,
                retry=getattr(job, "retry_policy", None),
                session_id=getattr(job, "session_id", None),
                fingerprint=getattr(job, "fingerprint", None),
                stream_seq=ack[3],
                attempt=ack[2],
                consumer=ack[1],
                max_tokens=(job.payload.sampling.max_tokens * job.payload.n) if job is not None else 0,
                submitted_at=float(getattr(job, "submitted_at", 0.0) or 0.0),
                deadline=float(getattr(job, "deadline", 0.0) or 0.0),
                prompt=prompt_digest(job.payload.prompt_token_ids) if job is not None else None,
            )
            self._by_ack[reply] = d
            self.deliveries.append(d)
        if worker is not None:
            if d.worker is None:
                d.worker = worker
            elif d.worker != worker and worker not in d.also:
                d.also.append(worker)

    async def _on_ack(self, msg: Any) -> None:
        data = bytes(msg.data or b"")
        kind = data.split(b" ", 1)[0].decode(errors="replace") or "+ACK"
        self.acks[msg.subject].append((time.time(), kind))

    async def _on_result(self, msg: Any) -> None:
        from rollfleet.schemas import ChunkedOutcome, RolloutFailure, RolloutResult, decode_outcome

        now = time.time()
        data = bytes(msg.data or b"")
        digest = xxhash.xxh3_64_hexdigest(data)
        try:
            outcome = decode_outcome(data)
        except Exception:
            self._chunks[msg.subject].append((now, data))
            return
        worker = self._subject_worker(msg.subject)
        if isinstance(outcome, RolloutResult):
            p = Published(now, msg.subject, "result", outcome.idempotency_key, outcome.job_id,
                          outcome.worker_id, digest, desc=describe_result(outcome))
        elif isinstance(outcome, RolloutFailure):
            p = Published(now, msg.subject, "failure", outcome.idempotency_key, outcome.job_id,
                          outcome.worker_id or worker, digest, code=outcome.code)
        elif isinstance(outcome, ChunkedOutcome):
            p = Published(now, msg.subject, "chunked", outcome.idempotency_key, outcome.job_id, worker, digest)
            whole = self._assemble(msg.subject, outcome)
            p.assembled = whole is not None
            if isinstance(whole, RolloutResult):
                p.desc, p.worker = describe_result(whole), whole.worker_id
            elif isinstance(whole, RolloutFailure):
                p.code, p.worker = whole.code, whole.worker_id or worker
        else:
            p = Published(now, msg.subject, "undecodable", None, None, worker, digest)
        self.published.append(p)

    async def _on_job_stored(self, msg: Any) -> None:
        from rollfleet.schemas import RolloutJob, decode

        with contextlib.suppress(Exception):
            job = decode(msg.data, RolloutJob)
            self.stored_jobs[job.job_id] = self.stored_jobs.get(job.job_id, 0) + 1
            self.job_stores.append((time.time(), job.job_id, msg.subject))
            self.job_submitted.setdefault(job.job_id, float(job.submitted_at or 0.0))
            self.job_prompts.setdefault(job.job_id, [job.client_id, prompt_digest(job.payload.prompt_token_ids)])

    def _subject_worker(self, subject: str) -> str | None:
        parse = getattr(self.names, "parse_result_subject", None)
        if parse is None:
            return None
        with contextlib.suppress(Exception):
            parsed = parse(subject)
            if parsed:
                return str(parsed[-1])
        return None

    def _assemble(self, head_subject: str, head: Any) -> Any:
        from rollfleet.schemas import decode_outcome

        nonce = getattr(head, "nonce", "") or ""
        parts = []
        for i in range(head.chunks):
            subject = f"{head_subject}.{nonce}.{i}" if nonce else f"{head_subject}.{i}"
            seen = self._chunks.get(subject)
            if not seen:
                return None
            parts.append(seen[-1][1])
        data = b"".join(parts)
        if len(data) != head.size or xxhash.xxh3_128_hexdigest(data) != head.digest:
            return None
        try:
            return decode_outcome(data)
        except Exception:
            return None

    async def _on_version(self, msg: Any) -> None:
        from rollfleet.schemas import VersionActivated, VersionPublished, decode_event

        try:
            event = decode_event(msg.data)
        except Exception:
            return
        now = time.time()
        if isinstance(event, VersionActivated):
            self.activations.append((now, event))
        elif isinstance(event, VersionPublished):
            self.announced.append((now, event))

    async def _on_fleet(self, msg: Any) -> None:
        from rollfleet.schemas import ReplicaStatus, decode

        prefix = f"$KV.{self.names.fleet_bucket}.{self.names.REPLICA_PREFIX}"
        if not msg.subject.startswith(prefix):
            return
        worker = msg.subject[len(prefix) :]
        status = None
        if msg.data:
            with contextlib.suppress(Exception):
                status = decode(msg.data, ReplicaStatus, what="replica status")
        self.fleet.append((time.time(), worker, status))

    async def _on_claim(self, msg: Any) -> None:
        key = msg.subject.split(".", 2)[2] if msg.subject.count(".") >= 2 else msg.subject
        op = ((msg.headers or {}).get("KV-Operation") or "PUT") if msg.headers else "PUT"
        self.claims.append([time.time(), key, bytes(msg.data or b"").decode(errors="replace"), str(op), None])
        if msg.reply:
            self._claim_replies[msg.reply] = len(self.claims) - 1

    def _on_reply(self, msg: Any) -> bool:
        """The broker's answer to a claim (seen on the worker's mirrored reply inbox)."""
        i = self._claim_replies.pop(msg.subject, None)
        if i is None:
            return False
        try:
            doc = json.loads(bytes(msg.data or b"{}"))
        except ValueError:
            doc = {}
        self.claims[i][4] = "stored" if isinstance(doc, dict) and "seq" in doc and "error" not in doc else "refused"
        return True

    # -- at the end -------------------------------------------------------------------------------
    async def read_stream(self, stream: str, subject: str, limit: int = 200_000) -> list[Any]:
        """Every message stored on ``stream`` under ``subject`` (an ack-less ephemeral consumer)."""
        from nats.js.api import AckPolicy, ConsumerConfig, DeliverPolicy

        js = self.nc.jetstream(timeout=10)
        cfg = ConsumerConfig(ack_policy=AckPolicy.NONE, deliver_policy=DeliverPolicy.ALL, inactive_threshold=30.0)
        sub = await js.pull_subscribe(subject, durable=None, stream=stream, config=cfg)
        out: list[Any] = []
        try:
            while len(out) < limit:
                try:
                    msgs = await sub.fetch(512, timeout=1.0)
                except Exception:
                    break
                if not msgs:
                    break
                out.extend(msgs)
        finally:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        return out

    async def stored_answers(self) -> dict[str, list[dict[str, Any]]]:
        """What the results stream holds at the end, per idempotency key (heads only, in order);
        ``ntokens``: the answer's tokens (a chunked one's, put together from its stored chunks)."""
        from rollfleet.schemas import ChunkedOutcome, RolloutFailure, RolloutResult, decode_outcome

        out: dict[str, list[dict[str, Any]]] = defaultdict(list)
        chunks: dict[str, bytes] = {}  # a chunk's subject -> its bytes (the last stored)
        heads: list[tuple[dict[str, Any], Any]] = []
        for m in await self.read_stream(self.names.results_stream, self.names.results_wildcard):
            try:
                o = decode_outcome(m.data)
            except Exception:
                chunks[m.subject] = bytes(m.data)
                continue
            rec: dict[str, Any] = {"subject": m.subject, "seq": m.metadata.sequence.stream,
                                   "digest": xxhash.xxh3_64_hexdigest(m.data)}
            if isinstance(o, RolloutResult):
                rec.update(kind="result", job_id=o.job_id, worker=o.worker_id, tokens=describe_result(o)["tokens"])
                rec["forged"] = any(c.token_ids and all(t == FORGED_TOKEN for t in c.token_ids) for c in o.outputs)
                rec["ntokens"] = sum(len(c.token_ids) for c in o.outputs)
            elif isinstance(o, RolloutFailure):
                rec.update(kind="failure", job_id=o.job_id, worker=o.worker_id, code=o.code, ntokens=0)
            elif isinstance(o, ChunkedOutcome):
                rec.update(kind="chunked", job_id=o.job_id, chunks=o.chunks, ntokens=None)
                heads.append((rec, o))
            out[o.idempotency_key].append(rec)
        for rec, head in heads:
            nonce = getattr(head, "nonce", "") or ""
            parts = [chunks.get(f"{rec['subject']}.{nonce}.{i}" if nonce else f"{rec['subject']}.{i}")
                     for i in range(head.chunks)]  # fmt: skip
            data = b"".join(p for p in parts if p is not None)
            if None in parts or len(data) != head.size or xxhash.xxh3_128_hexdigest(data) != head.digest:
                continue
            with contextlib.suppress(Exception):
                whole = decode_outcome(data)
                rec["ntokens"] = sum(len(c.token_ids) for c in whole.outputs) if isinstance(whole, RolloutResult) else 0
        return dict(out)

    async def stored_activations(self) -> list[Any]:
        from rollfleet.schemas import VersionActivated, decode_event

        out = []
        for m in await self.read_stream(self.names.events_stream, self.names.versions_activated):
            with contextlib.suppress(Exception):
                event = decode_event(m.data)
                if isinstance(event, VersionActivated):
                    out.append(event)
        return out

    def dump(self, path: Any) -> None:
        """Everything the tap saw, as JSON (kept with a failing run's work directory)."""
        from dataclasses import asdict

        doc = {
            "deliveries": [asdict(d) for d in self.deliveries],
            "published": [asdict(p) for p in self.published],
            "acks": self.acks,
            "activations": [(t, _plain(a)) for t, a in self.activations],
            "fleet": [(t, w, _plain(s)) for t, w, s in self.fleet],
            "claims": self.claims,
            "stored_jobs": self.stored_jobs,
            "job_stores": self.job_stores,
            "job_submitted": self.job_submitted,
            "job_prompts": self.job_prompts,
            "gaps": self.gaps,
            "declared": self.declared,
            "tapped": sorted(self._tapped),
            "nuid_owner": self.nuid_owner,
        }
        with open(path, "w") as f:
            json.dump(doc, f, default=str)


def _stream_settings(config: Any) -> dict[str, Any]:
    return {"num_replicas": config.num_replicas, "duplicate_window": config.duplicate_window}


def _consumer_settings(config: Any) -> dict[str, Any]:
    return {"ack_wait": config.ack_wait, "max_deliver": config.max_deliver, "num_replicas": config.num_replicas}


def _plain(obj: Any) -> Any:
    if obj is None:
        return None
    import msgspec

    return msgspec.to_builtins(obj)


def _nuid(sub: str) -> str | None:
    """The NUID token of an inbox subscription (``..._INBOX...<22 chars>.*``), if it has one."""
    tokens = sub.split(".")
    return next((tok for tok in reversed(tokens) if len(tok) == 22 and tok.isalnum()), None)
