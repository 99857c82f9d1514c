"""Every message that crosses the broker, as plain typed data.

MessagePack on the wire (see ``codec``); msgspec validates types on decode, so a
field of the wrong type is an error, never a silently wrong value.
"""

from __future__ import annotations

import hashlib
import math
import time
from collections.abc import Iterable
from typing import Any, Literal, NamedTuple

import msgspec

from rollfleet.schemas.replay import ReplayCoordinate
from rollfleet.schemas.sampling import SamplingParams  # (used here, and imported from here by many)

# The jobs' wire schema: bumped whenever a job may carry something an older worker cannot decode
# or would misread (1: the first; 2: retry_policy "resume"). A worker refuses a job of a newer
# schema with UnsupportedSchema instead of guessing, so upgrade workers before trainers.
SCHEMA_VERSION = 2

# "resume": replayable, and its worker checkpoints the generation so far on the broker; a run that
# takes the job over after its worker died continues from there instead of from the first token.
RetryPolicy = Literal["replayable", "at_most_once", "resume"]


class RetryBehaviour(NamedTuple):
    """What a retry policy means, in one place: every side reads this table, never the name."""

    claimed: bool  # its run writes a claim naming its process before it starts
    takeover: bool  # a replica may take it over from a holder that stopped
    checkpoints: bool  # its tokens are stored as they are made, and a later run goes on from them
    # What a redelivery finds when its holder stopped: run it again from the start, answer
    # ``Interrupted`` (it started and must never start twice), or go on from its checkpoints.
    holder_gone: Literal["run_again", "interrupted", "resume"]


RETRY_BEHAVIOUR: dict[str, RetryBehaviour] = {
    "replayable": RetryBehaviour(claimed=False, takeover=True, checkpoints=False, holder_gone="run_again"),
    "at_most_once": RetryBehaviour(claimed=True, takeover=False, checkpoints=False, holder_gone="interrupted"),
    "resume": RetryBehaviour(claimed=True, takeover=True, checkpoints=True, holder_gone="resume"),
}


def retry_behaviour(policy: str) -> RetryBehaviour:
    """A policy's behaviour; one this version does not know (a newer peer's) is treated as the
    strictest, at_most_once: never started twice."""
    return RETRY_BEHAVIOUR.get(policy, RETRY_BEHAVIOUR["at_most_once"])


VersionPolicy = Literal["pinned", "monotonic", "free"]  # how a session's turns choose versions
ConstraintKind = Literal["min", "exact"]
FinishReason = Literal["stop", "length", "abort"]
# "down": its engine is dead or hung (it takes no jobs and says why in degraded_reason)
ReplicaState = Literal["starting", "ready", "preparing", "activating", "degraded", "down", "draining", "stopped"]
VersionKind = Literal["base", "delta", "full"]


class RolloutPayload(msgspec.Struct, kw_only=True, omit_defaults=True):
    """What to generate: a prompt (token ids or text), sampling parameters, samples."""

    prompt_token_ids: list[int] | None = None
    prompt_text: str | None = None
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    n: int = 1
    # Serve it batch-invariant, so that the same request gives the same bits again (the hf engine
    # runs it alone; echo always is; an engine that cannot says so in the result's coordinate).
    deterministic: bool = False
    # Each sample's random stream starts advanced past this many tokens' draws, as if that many
    # had been sampled before the first one made here: a replay of a segment that began inside a
    # sampled request, at an activation, whose stream ran on from the request's start. An engine
    # that cannot advance its streams refuses it (``NotReplayable``); seeded requests only.
    stream_offset: int = 0
    # Engine-specific pass-through (e.g. extra SGLang sampling keys); never interpreted here.
    extra: dict[str, Any] = msgspec.field(default_factory=dict)


def version_allows(kind: ConstraintKind, bound: int, version: int) -> bool:
    """The one rule of version constraints: ``exact:N`` allows N alone, ``min:N`` N and above.
    Routing, the registry, the client's checks and the results' checks all read it."""
    return version == bound if kind == "exact" else version >= bound


def refuses_while_activating(kind: ConstraintKind) -> bool:
    """A replica activating a newer version takes no more exact jobs for the one it leaves
    (they could not finish before the weights change); minimum jobs may span the activation."""
    return kind == "exact"


class VersionConstraint(msgspec.Struct, frozen=True):
    kind: ConstraintKind
    version: int

    def allows(self, version: int) -> bool:
        """Whether a replica at ``version`` may serve this request."""
        return version_allows(self.kind, self.version, version)

    def __str__(self) -> str:
        return f"{self.kind}:{self.version}"


class RolloutJob(msgspec.Struct, kw_only=True):
    job_id: str
    idempotency_key: str
    client_id: str
    constraint: VersionConstraint
    payload: RolloutPayload
    deadline: float  # unix seconds
    submitted_at: float
    retry_policy: RetryPolicy = "replayable"
    session_id: str | None = None
    # The trainer's latest published version when it submitted; staleness is measured
    # against the trainer's version when the result is consumed, not this.
    trainer_version: int | None = None
    schema: int = SCHEMA_VERSION
    # request_fingerprint() of what was asked; the answer carries it back, so a key reused for
    # a different request is refused instead of answered with another request's result.
    fingerprint: str = ""

    @property
    def claimed(self) -> bool:
        """Whether the worker running it writes a claim naming itself first: jobs that must never
        run twice at once, ``at_most_once`` and ``resume`` ones and sessions' turns (a turn moved
        off its replica while that replica runs it must wait for its answer), and exact jobs (the
        claim names the replica running one, so a replica draining at its version that never took
        it does not hold it up once its holder died)."""
        return self.behaviour.claimed or self.session_id is not None or self.constraint.kind == "exact"

    @property
    def behaviour(self) -> RetryBehaviour:
        return retry_behaviour(self.retry_policy)


def struct_view(
    name: str, struct: type[msgspec.Struct], *, types: dict[str, Any] | None = None, only: dict[str, Any] | None = None
) -> type[msgspec.Struct]:
    """A view of ``struct`` derived from its fields, never copied by hand: the same fields in the
    same order (so the same bytes on the wire), with ``types`` replacing some fields' types; or,
    with ``only``, just those fields, each optional with the given default (and its type widened
    to allow a ``None`` default). A field added to ``struct`` is in every full view at once."""
    fields: list[Any] = []
    for f in msgspec.structs.fields(struct):
        if only is not None:
            if f.name in only:
                default = only[f.name]
                fields.append((f.name, f.type | None if default is None else f.type, default))
            continue
        kind = (types or {}).get(f.name, f.type)
        if f.default is not msgspec.NODEFAULT:
            fields.append((f.name, kind, f.default))
        elif f.default_factory is not msgspec.NODEFAULT:
            fields.append((f.name, kind, msgspec.field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, kind))
    return msgspec.defstruct(name, fields, kw_only=True, module=__name__)


# ``RolloutJob`` with its payload already encoded: the same bytes on the wire (same fields, same
# order), so a client encodes each payload once.
RolloutJobWire: Any = struct_view("RolloutJobWire", RolloutJob, types={"payload": msgspec.Raw})

# What addresses a job's answer, read from a job that does not decode as a whole (a field value
# this worker does not know, a newer schema): its answer must still reach its caller, who accepts
# one only under a job id it issued and the request's fingerprint. (A job without ``schema``
# predates the field: 1.)
JobAddress: Any = struct_view(
    "JobAddress",
    RolloutJob,
    only={"job_id": None, "idempotency_key": None, "client_id": None, "fingerprint": "", "schema": 1},
)


def request_fingerprint(written: str, payload: bytes, retry_policy: str, session_id: str | None) -> str:
    """A short digest of the request as its caller wrote it (not its key or deadline).

    ``written`` is the constraint as given (``staleness:1``, ``min:3``, ``exact:3``; a session's
    turn: its session's settings), never the version it resolved to: a trainer that restarts and
    resubmits the same request after a commit moved ``latest`` asks for the same thing.
    ``payload`` is the payload's encoded bytes (MessagePack, as sent)."""
    h = hashlib.blake2b(digest_size=12)
    h.update(f"{written}\x00{retry_policy}\x00{session_id or ''}\x00".encode())
    h.update(payload)
    return h.hexdigest()


class VersionSpan(msgspec.Struct, kw_only=True, frozen=True, omit_defaults=True):
    """Output tokens ``[start, end)`` of a completion were generated at policy ``version``
    (the shape of SGLang's ``meta_info.weight_versions``, with integer versions). ``replica``
    names the worker that generated them in a resumable job's result (a resumed generation has
    spans from more than one replica); None elsewhere (the result's ``worker_id`` made them)."""

    version: int
    start: int
    end: int
    replica: str | None = None


def version_spans(token_versions: Iterable[int]) -> list[VersionSpan]:
    """The spans of a sequence of per-token versions (consecutive equal versions merge)."""
    spans: list[VersionSpan] = []
    for i, v in enumerate(token_versions):
        if spans and spans[-1].version == v:
            spans[-1] = VersionSpan(version=v, start=spans[-1].start, end=i + 1)
        else:
            spans.append(VersionSpan(version=v, start=i, end=i + 1))
    return spans


class Completion(msgspec.Struct, kw_only=True, omit_defaults=True):
    token_ids: list[int]
    finish_reason: FinishReason
    logprobs: list[float] | None = None  # log-prob of each sampled token, when the engine gives it
    text: str | None = None
    # Which policy version produced which tokens; two or more spans when an activation landed
    # mid-generation. Empty when the engine cannot tell (then version_start/end bound it).
    weight_versions: list[VersionSpan] = msgspec.field(default_factory=list)


class RolloutResult(msgspec.Struct, tag="result", kw_only=True):
    job_id: str
    idempotency_key: str
    client_id: str
    outputs: list[Completion]
    version_start: int  # active version when generation started
    version_end: int  # active version when it ended (differs if an activation happened mid-request)
    worker_id: str
    engine: str
    queue_wait_s: float
    generation_s: float
    delivery_attempt: int
    finished_at: float
    session_id: str | None = None
    prompt_tokens: int = 0
    staleness: int | None = None  # filled in by the trainer client when consumed
    fingerprint: str = ""  # the job's, echoed
    constraint: VersionConstraint | None = None  # the job's, echoed: a result says what it had to satisfy
    # Sessions: prompt tokens served from the replica's cache of the session (not prefilled), and
    # whether that cache was from older weights and rebuilt on the new ones.
    cached_tokens: int = 0
    cache_rebuilt: bool = False
    # Resumable jobs: output tokens (all samples) kept from earlier runs' checkpoints instead of
    # generated again, and how many runs before this one it continued from.
    kept_tokens: int = 0
    resumes: int = 0
    # What it takes to generate these samples again, bit for bit (``schemas.replay``); None on a
    # result stored before coordinates existed.
    replay: ReplayCoordinate | None = None


def served_within(constraint: VersionConstraint, result: RolloutResult) -> bool:
    """Whether every token of ``result`` was generated at a version ``constraint`` allows: for an
    exact constraint, start, end and every per-token span at that version; for a minimum, the
    oldest of them at or above it."""
    lo, hi = min(result.version_start, result.version_end), max(result.version_start, result.version_end)
    for out in result.outputs:  # (on every result, twice: kept to plain loops)
        for span in out.weight_versions:
            v = span.version
            if v < lo:
                lo = v
            elif v > hi:
                hi = v
    return constraint.allows(lo) and constraint.allows(hi)  # (every version lies between them)


class RolloutFailure(msgspec.Struct, tag="failure", kw_only=True):
    idempotency_key: str
    client_id: str
    code: str
    message: str
    retryable: bool
    job_id: str | None = None
    worker_id: str | None = None
    delivery_attempt: int = 0
    finished_at: float = 0.0
    fingerprint: str = ""  # the job's, echoed


class ChunkedOutcome(msgspec.Struct, tag="chunked", kw_only=True):
    """Stands for an outcome too large for one message. Its encoded bytes were stored first, in
    ``chunks`` messages on ``Names.result_chunk_subject(<this head's subject>, nonce, i)``, and
    this message is stored last, so whoever sees it can read them all. The nonce is new for
    every attempt to store an answer: a re-run never reads or overwrites a dead run's chunks."""

    idempotency_key: str
    client_id: str
    job_id: str | None
    chunks: int
    size: int
    digest: str  # xxh3-128 of the whole encoded outcome
    nonce: str = ""


class AnsweredNotice(msgspec.Struct, tag="answered", kw_only=True):
    """Stored by a replica that found a delivered job answered already and ran nothing (a key
    asked again past the broker's duplicate window is stored again under its one job id), on
    ``Names.answered_notice_subject``: the asker's results consumer would otherwise hear nothing,
    as the job's one answer was stored before. It carries no answer, only where to read one: the
    asker reads the job's stored answer and judges it as any (fingerprint, job id, constraint)."""

    idempotency_key: str
    client_id: str
    job_id: str


Outcome = RolloutResult | RolloutFailure
StoredOutcome = RolloutResult | RolloutFailure | ChunkedOutcome


class HeardClock(NamedTuple):
    """What a reader has learnt of one replica process's clock: that process (its
    ``started_at``) and the smallest (heard - stamp) gap seen, its clock's offset plus the
    shortest transit (``math.inf``: nothing heard live yet)."""

    process: float | None = None
    offset: float = math.inf


def heartbeat_on_readers_clock(
    known: HeardClock, started_at: float, heartbeat_at: float, heard_at: float, *, live: bool
) -> tuple[float, HeardClock]:
    """A replica's heartbeat stamp moved onto the reader's clock, and what the reader knows after.

    ``heard_at``: the reader's time when it heard the entry; ``live``: heard as it was written
    (a watch update), not read from a snapshot. A stamp is its own clock's reading; the smallest
    gap seen between stamps and their hearing is that clock's offset (plus the shortest transit),
    so a replica whose clock is off is neither taken for dead nor kept alive past its silence, and
    a write held up on the way (a partition that healed) still counts from when it was made. A
    snapshot entry can only use the offset known for that process, or else count from no later
    than the reading (a stamp in the future is a clock ahead). Another process under the same id
    has its own clock: what was learnt of the one before is dropped."""
    offset = known.offset if known.process == started_at else math.inf
    if live:
        offset = min(offset, heard_at - heartbeat_at)
        known = HeardClock(started_at, offset)
    when = heartbeat_at + offset if offset != math.inf else min(heartbeat_at, heard_at)
    return when, known


class ReplicaStatus(msgspec.Struct, kw_only=True):
    """A worker's entry in the fleet registry, rewritten on every heartbeat."""

    worker_id: str
    state: ReplicaState
    active_version: int
    engine: str
    capacity: int
    in_flight: int
    heartbeat_at: float
    heartbeat_interval_s: float
    started_at: float
    preparing_version: int | None = None
    degraded_reason: str | None = None
    host: str = ""
    pid: int = 0
    metrics_url: str | None = None
    jobs_done: int = 0
    sessions: int = 0  # sessions whose context this replica's engine holds (prefix cache)
    # Resumable jobs this replica continued from another run's checkpoint, the output tokens it
    # kept from those checkpoints, and tokens it had to generate again (a checkpoint unusable).
    resumed: int = 0
    tokens_kept: int = 0
    tokens_regenerated: int = 0
    # The version this replica holds and never leaves (``--hold-version``, or a fixed version it
    # does not follow); None: it follows ``latest``. The fleet's control loop sizes them apart.
    held_version: int | None = None

    def stale_after_s(self) -> float:
        return max(3.0 * self.heartbeat_interval_s, 1.0)

    def is_live(self, now: float | None = None) -> bool:
        now = time.time() if now is None else now
        return self.state != "stopped" and now - self.heartbeat_at <= self.stale_after_s()

    def can_serve(self, constraint: VersionConstraint) -> bool:
        """At, or preparing, a version the constraint accepts, and taking work."""
        if self.state in ("draining", "stopped", "down"):
            return False
        if self.preparing_version is not None and constraint.allows(self.preparing_version):
            return True
        if self.state == "activating" and refuses_while_activating(constraint.kind):
            return False
        # A starting replica serves nothing yet; only what it is preparing counts.
        return self.state != "starting" and constraint.allows(self.active_version)

    def will_serve(self, constraint: VersionConstraint, latest: int | None) -> bool:
        """Can serve it (``can_serve``), or is bound to: a replica following ``latest`` activates
        every committed version in turn, so a ``min`` job at or below ``latest`` (the newest
        committed) is its to take once it gets there, even while it still prepares an older one
        (a slow read of version 17 while 18 is committed: no replica shows 18 yet)."""
        if self.can_serve(constraint):
            return True
        if constraint.kind != "min" or latest is None or constraint.version > latest:
            return False
        return self.held_version is None and self.state not in ("draining", "stopped", "down")

    def takes_now(self, constraint: VersionConstraint, now: float | None = None) -> bool:
        """Live, taking work, and pulling the constraint's jobs at its active version now (not
        only once a version it prepares is active): where a job meant for it alone may go."""
        return self.is_live(now) and self.can_serve(constraint) and constraint.allows(self.active_version)


class TurnFailure(msgspec.Struct, kw_only=True, frozen=True):
    """A turn answered with an error that no worker stored (the client raised it: no replica
    could take it, or its deadline passed): asked again, the turn raises the same error."""

    code: str
    message: str
    retryable: bool


class SessionRecord(msgspec.Struct, kw_only=True):
    """An open session, as stored in the sessions bucket under ``s.<session_id>``: its settings
    (a reopened session must ask for the same ones) and its progress."""

    session_id: str
    client_id: str
    version_policy: VersionPolicy
    min_version: int | None = None
    exact_version: int | None = None
    max_staleness: int | None = None
    retry_policy: RetryPolicy = "replayable"
    ttl_s: float = 600.0
    next_turn: int = 0  # turns 0 .. next_turn-1 were submitted (each answered once, by its key)
    last_version: int | None = None  # pinned: the pin; monotonic: the newest version a turn ran at
    replica: str | None = None  # the replica that served the last turn (where its context is)
    opened_at: float = 0.0
    touched_at: float = 0.0
    # New at every open of the id: turn keys carry it, so a session opened again under the id of
    # a closed one never meets the old session's answers (see ``turn_key``).
    incarnation: str = ""
    failures: dict[int, TurnFailure] = msgspec.field(default_factory=dict)  # the newest few
    # Turns asked under a key of the caller's own (the newest few): key -> the turn's index. Asked
    # again under that key, a turn is answered from its one run and spends no index.
    keys: dict[str, int] = msgspec.field(default_factory=dict)

    def settings(self) -> tuple[object, ...]:
        return (self.version_policy, self.min_version, self.exact_version, self.max_staleness, self.retry_policy)


class VersionRecord(msgspec.Struct, kw_only=True, omit_defaults=True):
    """One committed policy version, as stored in the policy KV under ``v.<N>``."""

    version: int
    kind: VersionKind
    base_version: int | None = None
    encoding: str | None = None
    checksum_format: str | None = None
    path: str = ""  # directory name inside the store, e.g. weight_v000007
    changed_bytes: int = 0
    total_bytes: int = 0
    density: float = 0.0
    wire_bytes: int = 0
    seconds: float = 0.0
    created_at: float = 0.0
    publisher: str = ""
    # Set once ``latest`` has reached this version (``broker.kv.advance_latest``): the record is
    # created before that compare-and-set, so a publisher killed between the two leaves a record
    # of a version that was never committed. Only a committed version is ever served.
    committed: bool = False


class VersionPublished(msgspec.Struct, tag="published", kw_only=True):
    record: VersionRecord


class VersionActivated(msgspec.Struct, tag="activated", kw_only=True):
    """A replica's acknowledgement that it now serves ``version``."""

    worker_id: str
    version: int
    previous_version: int
    prepare_s: float
    pause_s: float
    wire_bytes: int
    density: float
    activated_at: float
    changed_tensors: int = 0
    # weights_digest() of the live weights' checksums, when the replica was asked to verify them
    weights_digest: str | None = None
    # Before pausing, the replica waited this long for its exact-`previous_version` jobs to
    # finish; past its bound it aborted and handed back `handed_back` of them, unanswered.
    drain_s: float = 0.0
    handed_back: int = 0
    # The version a replica started on (with --verify-live, so its live weights are on record
    # from its first job), not a change of version.
    at_start: bool = False


VersionEvent = VersionPublished | VersionActivated
