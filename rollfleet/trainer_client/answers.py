"""Which stored answers answer a request: read back from the results stream, and checked.

An answer is handed to a caller only when

- its subject names the replica and the job it says it answers: the broker lets a worker
  publish only on results subjects that end in its own id (``broker.permissions``), so the
  subject proves who answered (``authentic``);
- it carries the request's fingerprint: one with another fingerprint answers another request
  under the same key (``IdempotencyConflict``), one with none answers nothing (``judge``);
- it answers a job id this client id issued for the key (``jobids``: a MAC under a secret no
  worker can read): job ids travel only in deliveries, so only a replica the job was delivered
  to can name one.

Answers too large for one message are read back from their chunks (``whole``), found below the
head's subject by the head's nonce, and checked against the head's size and digest.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Literal

import xxhash

from rollfleet.broker.errors import typed_errors
from rollfleet.broker.stream_reads import stored_on
from rollfleet.broker.types import JetStreamContext
from rollfleet.schemas import ChunkedOutcome, Names, Outcome, StoredOutcome, decode_outcome, job_token, key_token
from rollfleet.schemas.errors import BrokerError, InvalidRequest

Verdict = Literal["accept", "conflict", "foreign"]
JobFilter = Callable[[str | None], bool]  # whether a job id answers the request in hand

_MAX_HEADS = 64  # answers looked at per key (a flood of forged heads cannot stall a read)


def authentic(names: Names, subject: str, outcome: Outcome) -> bool:
    """Whether ``subject`` (where the answer was stored) names the client, key, job and replica
    the answer says it comes from."""
    parsed = names.parse_result_subject(subject)
    if parsed is None:
        return False
    client_id, key, job, worker = parsed
    return (
        client_id == outcome.client_id
        and key == key_token(outcome.idempotency_key)
        and job == job_token(outcome.job_id)
        and worker == (outcome.worker_id or "")
    )


def judge(outcome: Outcome, fingerprint: str | None, accepts: JobFilter) -> Verdict:
    """``accept``: it answers this request; ``conflict``: it answers another request under the
    same key; ``foreign``: it answers nothing of ours (no fingerprint, or a job we never issued).
    ``fingerprint`` None: any request (a key asked for by a caller who does not say what for)."""
    if not accepts(outcome.job_id) or not outcome.fingerprint:
        return "foreign"
    if fingerprint is not None and outcome.fingerprint != fingerprint:
        return "conflict"
    return "accept"


async def whole(js: JetStreamContext, names: Names, head_subject: str, stored: StoredOutcome) -> Outcome:
    """An answer stored in chunks, read back and checked; any other answer as it is."""
    if not isinstance(stored, ChunkedOutcome):
        return stored
    parts = []
    for i in range(stored.chunks):
        subject = names.result_chunk_subject(head_subject, stored.nonce, i)
        with typed_errors():
            parts.append((await js.get_last_msg(names.results_stream, subject, direct=True)).data or b"")
    data = b"".join(parts)
    if len(data) != stored.size or xxhash.xxh3_128_hexdigest(data) != stored.digest:
        raise InvalidRequest(f"the chunks of {stored.idempotency_key!r} do not add up to the stored answer")
    outcome = decode_outcome(data)
    if isinstance(outcome, ChunkedOutcome):
        raise InvalidRequest("a chunked answer cannot contain another")
    return outcome


def look_up_before_storing(now: float, recheck_until: float, connected: bool, answered_here: bool = False) -> bool:
    """Whether a resubmitted key is looked up among the stored answers before its job is stored:
    within a duplicate window (``recheck_until``, monotonic) of the client's start or of a
    reconnect, whenever the broker is away when it is asked, and for a key this process has
    already had an answer for (``answered_here``). A broker that restarts rebuilds its duplicate
    detection from the jobs it still stores, and an answered job is not among them; past the
    window the broker has forgotten the key too. Storing the key's job again then stores it
    as the same job (its job id being the key's), which the replica that pulls it finds answered:
    it runs nothing and tells the asker (``AnsweredNotice``), who reads the stored answer then.
    Looking first saves that trip where a stored answer is likely."""
    return now < recheck_until or not connected or answered_here


async def stored(
    js: JetStreamContext, names: Names, client_id: str, key: str, *, strict: bool = False
) -> AsyncIterator[tuple[str, Outcome]]:
    """The authentic answers stored for a key, oldest first (unreadable or forged ones are
    skipped). Ends quietly when the broker is away (the consumer still delivers them later);
    ``strict``: a broker that does not answer is raised, never taken for "nothing stored"."""
    heads = stored_on(js, names.results_stream, names.results_of_key(client_id, key), limit=_MAX_HEADS)
    try:
        with typed_errors():  # (the look-up itself: whole's are caught below)
            async for raw in heads:
                try:
                    outcome = await whole(js, names, raw.subject or "", decode_outcome(raw.data or b""))
                except (InvalidRequest, BrokerError):
                    continue
                if authentic(names, raw.subject or "", outcome):
                    yield raw.subject or "", outcome
    except BrokerError:
        if strict:
            raise


async def first_answer(
    js: JetStreamContext,
    names: Names,
    client_id: str,
    key: str,
    fingerprint: str | None,
    accepts: JobFilter,
    *,
    strict: bool = False,
) -> tuple[Verdict, Outcome] | None:
    """The oldest stored answer for this request (``fingerprint`` None: for any request), or
    ``("conflict", answer)`` when the key only answers another request; None if nothing is stored
    (``strict``: as ``stored``)."""
    conflict: Outcome | None = None
    async for _, outcome in stored(js, names, client_id, key, strict=strict):
        verdict = judge(outcome, fingerprint, accepts)
        if verdict == "accept":
            return verdict, outcome
        if verdict == "conflict" and conflict is None:
            conflict = outcome
    return ("conflict", conflict) if conflict is not None else None
