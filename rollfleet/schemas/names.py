"""Every subject, stream, consumer and bucket name, built in one place from the namespace."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import NamedTuple

from rollfleet.schemas.errors import InvalidRequest
from rollfleet.schemas.messages import ConstraintKind

# Lower-case only so that the upper-cased stream and bucket names stay unique per namespace.
_NAMESPACE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
_TOKEN = re.compile(r"^[A-Za-z0-9_-]{1,128}$")

# Headers that let a worker answer even a job whose body it cannot decode: the idempotency
# key travels as the broker's deduplication id, the reply address as the client id. (Kept
# to two: nats-py parses headers in Python, per message.)
HDR_MSG_ID = "Nats-Msg-Id"
HDR_CLIENT_ID = "Rf-Client-Id"

# An idle replica at version w keeps a pull request waiting on each of the first `capacity`
# subjects of its window: exact-w, then min-v for the LISTENED_MIN_VERSIONS newest v <= w (all
# four with the default capacity). A job on one of those reaches it without a wake-up; clients
# ring a bell only for jobs on a subject no live replica listens on.
LISTENED_MIN_VERSIONS = 3


def listened_subjects(version: int) -> list[tuple[ConstraintKind, int]]:
    """The subjects a replica at ``version`` always listens on, most constrained first."""
    window: list[tuple[ConstraintKind, int]] = [("min", v) for v in range(version, version - LISTENED_MIN_VERSIONS, -1)]
    return [("exact", version), *[s for s in window if s[1] >= 0]]


def check_token(value: str, what: str) -> str:
    """A subject token: letters, digits, '-', '_' (no dots or wildcards)."""
    if not isinstance(value, str) or not _TOKEN.match(value):
        raise InvalidRequest(f"{what} must match [A-Za-z0-9_-]{{1,128}}, got {value!r}")
    return value


def key_token(idempotency_key: str) -> str:
    """A subject-safe, fixed-size token for an arbitrary idempotency key."""
    return hashlib.blake2b(idempotency_key.encode(), digest_size=16).hexdigest()


UNKNOWN_JOB = "unknown"  # the job token of an answer to a job that could not be decoded


# The last token of an ``AnsweredNotice``'s subject (``Names.answered_notice_subject``).
ANSWERED_NOTICE = "answered"
_NOTICE_TAIL = f".{ANSWERED_NOTICE}"


def job_token(job_id: str | None) -> str:
    """A job id as a subject token (a client's job ids are tokens already; anything else is hashed)."""
    if job_id is None:
        return UNKNOWN_JOB
    return job_id if _TOKEN.match(job_id) and job_id != UNKNOWN_JOB else key_token(job_id)


def claim_key(job_id: str) -> str:
    """The claims-bucket key of a job: a digest, so listing the bucket reveals no job id (a job id
    is what lets a replica answer a job; only the replicas it was delivered to know it)."""
    return hashlib.blake2b(job_id.encode(), digest_size=16).hexdigest()


class Claim(NamedTuple):
    """A claims-bucket value, ``<worker_id>:<pid>-<nonce>@<unix time last refreshed>``: the process
    running a claimed job. Refreshed at 0 means stopped (its holder is gone; the claim stays)."""

    holder: str
    refreshed: float

    @property
    def worker_id(self) -> str:
        return self.holder.partition(":")[0]

    @property
    def process(self) -> str:
        return self.holder.partition(":")[2]

    @property
    def stopped(self) -> bool:
        return not self.holder or self.refreshed == 0.0

    def as_stopped(self) -> Claim:
        """The same claim, marked stopped (its holder is gone; the claim stays, so an
        ``at_most_once`` job is answered ``Interrupted``, not run again)."""
        return self._replace(refreshed=0.0)

    def encode(self) -> bytes:
        return f"{self.holder}@{self.refreshed:.3f}".encode() if self.refreshed else f"{self.holder}@0".encode()

    @classmethod
    def decode(cls, value: bytes | None) -> Claim:
        """A value that does not parse reads as stopped (nobody holds it)."""
        holder, _, at = (value or b"").decode(errors="replace").rpartition("@")
        try:
            return cls(holder, float(at))
        except ValueError:
            return cls("", 0.0)


@lru_cache(maxsize=4096)
def _parse_constraint(prefix: str, subject: str) -> tuple[ConstraintKind, int] | None:
    if not subject.startswith(prefix):
        return None
    parts = subject[len(prefix) :].split(".")
    if len(parts) != 2 or parts[0] not in ("min", "exact") or not parts[1].isdigit():
        return None
    return parts[0], int(parts[1])  # type: ignore[return-value]


@dataclass(frozen=True)
class Names:
    namespace: str
    # Derived from the namespace in __post_init__ (not compared, hashed or shown).
    _up: str = field(init=False, repr=False, compare=False)
    _root: str = field(init=False, repr=False, compare=False)
    _results_prefix: str = field(init=False, repr=False, compare=False)
    _jobs_prefix: str = field(init=False, repr=False, compare=False)
    _chunk_dots: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not isinstance(self.namespace, str) or not _NAMESPACE.match(self.namespace):
            raise InvalidRequest(f"namespace must match {_NAMESPACE.pattern}, got {self.namespace!r}")
        # Worked out once (the namespace never changes): every job and answer builds or reads
        # subjects from them.
        object.__setattr__(self, "_up", self.namespace.upper())
        object.__setattr__(self, "_root", f"rf.{self.namespace}")
        object.__setattr__(self, "_results_prefix", f"rf.{self.namespace}.results.")
        object.__setattr__(self, "_jobs_prefix", f"rf.{self.namespace}.jobs.")
        object.__setattr__(self, "_chunk_dots", self._root.count(".") + 7)

    # -- jobs --------------------------------------------------------------------------------
    @property
    def jobs_stream(self) -> str:
        return f"RF_{self._up}_JOBS"

    @property
    def jobs_wildcard(self) -> str:
        return f"{self._root}.jobs.>"

    def job_subject(self, kind: ConstraintKind, version: int) -> str:
        return f"{self._root}.jobs.{kind}.{int(version)}"

    def job_consumer(self, kind: ConstraintKind, version: int) -> str:
        return f"{kind}-{int(version)}"

    def parse_job_subject(self, subject: str) -> tuple[ConstraintKind, int] | None:
        """``(kind, version)`` of a jobs subject; None for anything else."""
        return _parse_constraint(self._jobs_prefix, subject)

    def bell_subject(self, worker_id: str) -> str:
        """One replica's wake-up: a core-NATS message that names a jobs subject with work on it.
        A client rings one replica that can serve the subject, never the whole fleet."""
        return f"{self._root}.bell.{check_token(worker_id, 'worker_id')}"

    def cancel_subject(self) -> str:
        """Where a trainer asks the fleet to stop one running job: a core-NATS message to every
        replica, carrying the job's ``claim_key`` (a digest: listening reveals no job id). The
        replica running that job aborts it and answers it with what it made so far."""
        return f"{self._root}.cancel"

    def demand_refused_subject(self) -> str:
        """Where a client says it refused a request ``NoCompatibleReplica`` (a core-NATS message,
        payload ``bell_payload`` of its constraint): the fleet's control loop hears which
        versions are asked for that no replica serves. Nobody stores it."""
        return f"{self._root}.demand.refused"

    # -- sessions: a replica's own jobs subject, session records --------------------------------
    def replica_job_subject(self, worker_id: str) -> str:
        """Jobs for one replica only (a session's next turn where its context is cached); in the
        jobs stream, outside every ``min``/``exact`` subject."""
        return f"{self._root}.jobs.replica.{check_token(worker_id, 'worker_id')}"

    def parse_replica_job_subject(self, subject: str) -> str | None:
        """The worker id of a replica's own jobs subject; None for any other subject."""
        prefix = f"{self._root}.jobs.replica."
        if not subject.startswith(prefix) or not _TOKEN.match(subject[len(prefix) :]):
            return None
        return subject[len(prefix) :]

    @staticmethod
    def replica_consumer(worker_id: str) -> str:
        return f"replica-{check_token(worker_id, 'worker_id')}"

    REPLICA_BELL = b"replica"  # a bell saying: a job waits on your own subject
    PROBE_BELL = b"ping"  # a bell saying nothing: sent with a reply subject, no responders = gone

    @property
    def sessions_bucket(self) -> str:
        """Open sessions of this namespace (key ``s.<session_id>``): settings and progress."""
        return f"RF_{self._up}_SESSIONS"

    @staticmethod
    def session_key(session_id: str) -> str:
        return f"s.{check_token(session_id, 'session_id')}"

    @staticmethod
    def consumer_leader_advisory(stream: str) -> str:
        """The broker's announcement that a consumer of ``stream`` has a new leader: pull
        requests held by the old one are gone (a cluster fail-over)."""
        return f"$JS.EVENT.ADVISORY.CONSUMER.LEADER_ELECTED.{stream}.*"

    @staticmethod
    def stream_deleted_advisory(stream: str) -> str:
        """The broker's announcement that ``stream`` (or the KV bucket it holds) was deleted."""
        return f"$JS.EVENT.ADVISORY.STREAM.DELETED.{stream}"

    @staticmethod
    def max_deliveries_advisory(stream: str) -> str:
        """The broker's announcement that it gave up on a message of ``stream`` (delivered
        ``max_deliver`` times): it is never delivered again."""
        return f"$JS.EVENT.ADVISORY.CONSUMER.MAX_DELIVERIES.{stream}.*"

    # -- results -----------------------------------------------------------------------------
    # An answer's subject names the client, the key, the job and the replica that stored it:
    # ``results.<client>.<key token>.<job token>.<worker_id>``. The broker lets each worker
    # publish only on subjects ending in its own id (``broker.permissions``), so the subject
    # authenticates who answered; the job id (random, learnt only with a delivery) says which
    # job it answers. Chunks of an answer too large for one message hang below its head
    # (``.<nonce>.<i>``): a nonce per store attempt, so a re-run never mixes with a dead run's chunks.
    @property
    def results_stream(self) -> str:
        return f"RF_{self._up}_RESULTS"

    @property
    def results_wildcard(self) -> str:
        return f"{self._root}.results.>"

    def _results_key(self, client_id: str, idempotency_key: str) -> str:
        return f"{self._root}.results.{check_token(client_id, 'client_id')}.{key_token(idempotency_key)}"

    def result_subject(self, client_id: str, idempotency_key: str, job_id: str | None, worker_id: str) -> str:
        """Where ``worker_id`` stores its answer to job ``job_id`` (None: a job it could not decode)."""
        worker = check_token(worker_id, "worker_id")
        return f"{self._results_key(client_id, idempotency_key)}.{job_token(job_id)}.{worker}"

    def results_of_key(self, client_id: str, idempotency_key: str) -> str:
        """Every answer head stored for a key (a wildcard, read in stream order)."""
        return f"{self._results_key(client_id, idempotency_key)}.*.*"

    def results_of_job(self, client_id: str, idempotency_key: str, job_id: str) -> str:
        """Every answer head stored for one job of a key."""
        return f"{self._results_key(client_id, idempotency_key)}.{job_token(job_id)}.*"

    @staticmethod
    def result_chunk_subject(head_subject: str, nonce: str, index: int) -> str:
        """Where chunk ``index`` of the answer whose head is stored on ``head_subject`` lies."""
        return f"{head_subject}.{check_token(nonce, 'chunk nonce')}.{int(index)}"

    def parse_result_subject(self, subject: str) -> tuple[str, str, str, str] | None:
        """``(client_id, key token, job token, worker_id)`` of an answer head's subject; None for
        anything else (a chunk, or a subject outside the results)."""
        prefix = self._results_prefix
        if not subject.startswith(prefix):
            return None
        parts = subject[len(prefix) :].split(".")
        if len(parts) != 4:
            return None
        return parts[0], parts[1], parts[2], parts[3]

    @staticmethod
    def answered_notice_subject(head_subject: str) -> str:
        """Where the replica whose answer subject is ``head_subject`` says it found that job
        answered already (``AnsweredNotice``): below its own answer subject, so only it may store
        one there, and outside every wildcard that gathers a key's or a job's answers."""
        return f"{head_subject}.{ANSWERED_NOTICE}"

    def is_answered_notice(self, subject: str) -> bool:
        return (
            subject.endswith(_NOTICE_TAIL)
            and subject.count(".") == self._chunk_dots - 1  # (one token below an answer's head)
            and subject.startswith(self._results_prefix)
        )

    def is_result_chunk(self, subject: str) -> bool:
        return subject.startswith(self._results_prefix) and subject.count(".") == self._chunk_dots

    def results_filter(self, client_id: str) -> str:
        return f"{self._root}.results.{check_token(client_id, 'client_id')}.>"

    def results_consumer(self, client_id: str, instance: str | None = None) -> str:
        """The client's durable results consumer; one an instance for a shared client id."""
        name = f"client-{check_token(client_id, 'client_id')}"
        return name if instance is None else f"{name}-{check_token(instance, 'instance')}"

    # -- progress of resumable jobs ------------------------------------------------------------
    # ``progress.<client>.<claim key of the job>``: one subject per job, the job id itself hidden
    # as in the claims bucket (only the replicas it was delivered to and its client know it).
    @property
    def progress_stream(self) -> str:
        return f"RF_{self._up}_PROGRESS"

    @property
    def progress_wildcard(self) -> str:
        return f"{self._root}.progress.>"

    def progress_subject(self, client_id: str, job_id: str) -> str:
        """Where the runs of a ``resume`` job store its generation so far (``schemas.progress``)."""
        return f"{self._root}.progress.{check_token(client_id, 'client_id')}.{claim_key(job_id)}"

    # -- policy versions and fleet -----------------------------------------------------------
    @property
    def policy_bucket(self) -> str:
        return f"RF_{self._up}_POLICY"

    @property
    def fleet_bucket(self) -> str:
        return f"RF_{self._up}_FLEET"

    @staticmethod
    def version_key(version: int) -> str:
        return f"v.{int(version)}"

    LATEST_KEY = "latest"

    @property
    def claims_bucket(self) -> str:
        """Which jobs a worker started and still holds (key: ``claim_key(job_id)``, value: its id):
        ``at_most_once`` jobs, and sessions' turns (so a moved turn is never run twice)."""
        return f"RF_{self._up}_CLAIMS"

    def inbox_prefix(self, role: str, worker_id: str | None = None) -> str:
        """Reply subjects of one role in this namespace (``trainer`` or ``worker``), and of one
        worker below that: the broker then lets each worker read its own replies (its job
        deliveries among them) and no one else's."""
        prefix = f"_INBOX.{self.namespace}.{check_token(role, 'role')}"
        return prefix if worker_id is None else f"{prefix}.{check_token(worker_id, 'worker_id')}"

    def client_alive_subject(self, client_id: str) -> str:
        """A live client answers here; a second client with the same id asks first."""
        return f"{self._root}.client.{check_token(client_id, 'client_id')}.alive"

    @staticmethod
    def client_key(client_id: str) -> str:
        """The fleet-bucket key naming the live instance of a client_id."""
        return f"client.{check_token(client_id, 'client_id')}"

    # The fleet's control loop (``rollfleet autoscale``): its lease, and the plan it last made.
    AUTOSCALER_LEASE_KEY = "autoscaler.lease"
    AUTOSCALER_STATUS_KEY = "autoscaler.status"

    REPLICA_PREFIX = "replica."
    REPLICA_KEYS = "replica.>"

    @staticmethod
    def replica_key(worker_id: str) -> str:
        return f"{Names.REPLICA_PREFIX}{check_token(worker_id, 'worker_id')}"

    @property
    def events_stream(self) -> str:
        return f"RF_{self._up}_EVENTS"

    @property
    def events_wildcard(self) -> str:
        return f"{self._root}.versions.>"

    @property
    def versions_published(self) -> str:
        return f"{self._root}.versions.published"

    @property
    def versions_activated(self) -> str:
        return f"{self._root}.versions.activated"

    @property
    def consumers_declared(self) -> str:
        """The trainer declared job consumers (workers only bind): look up missing ones again."""
        return f"{self._root}.consumers.declared"
