"""A resumable job's progress on the broker: what its runs generated so far, as records.

A worker running a ``resume`` job stores its generation in records on the job's own progress
subject (``Names.progress_subject``), in order: ``TokensRecord``\\ s carry only the tokens made
since the previous one (so a job's checkpoints cost about one result's bytes in all), a run that
takes the job over writes a ``ResumeRecord`` saying how much of each sample it keeps, and the run
that stored the answer rolls the subject up into one ``DoneRecord``. Every write names the
subject's last sequence its writer has seen (``Nats-Expected-Last-Subject-Sequence``): a run that
lost the job to another (which wrote its ``ResumeRecord`` since) can store nothing more.

Each record travels with a MAC keyed by the job id (``MAC_HEADER``, ``record_mac``): only a
replica the job was delivered to (and its client) knows the id, so a record anyone else wrote,
or one damaged on the way, is not the job's and is ignored (``sealed``); the records hold no job
id either, so reading them reveals none. ``Replay`` is the one reading of the job's records,
shared by the worker that resumes a job and the trainer that streams it: it checks that each
record continues the job's output exactly where the previous one ended, and raises
``CorruptCheckpoint`` (the job is then generated again from its first token) for anything else.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping
from dataclasses import dataclass, field

import msgspec

from rollfleet.schemas.errors import CorruptCheckpoint
from rollfleet.schemas.messages import Completion, FinishReason, VersionSpan
from rollfleet.schemas.names import Claim


class SampleDelta(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Tokens ``[start, start + len(token_ids))`` of sample ``index``; ``spans`` cover exactly
    those offsets, naming version and replica; ``finish`` once the sample ended with them.
    ``restarts``: the offsets among them at which a request of its own began the sample's tokens
    (a run continuing it, or a segment of an engine that does not stream), its random stream
    seeded anew: what a replay needs to remake each segment as it was made."""

    index: int
    start: int
    token_ids: list[int]
    logprobs: list[float] | None = None
    spans: list[VersionSpan] = msgspec.field(default_factory=list)
    finish: FinishReason | None = None
    restarts: list[int] = msgspec.field(default_factory=list)


MAC_HEADER = "Rollfleet-Mac"


def record_mac(job_id: str, data: bytes) -> str:
    """The MAC of a progress record's bytes, keyed by its job's id."""
    key = hashlib.blake2b(job_id.encode(), digest_size=32).digest()
    return hashlib.blake2b(data, key=key, digest_size=16).hexdigest()


def sealed(job_id: str, data: bytes, headers: Mapping[str, str] | None) -> bool:
    """Whether a stored record was written by a holder of ``job_id`` (its MAC matches)."""
    mac = (headers or {}).get(MAC_HEADER, "")
    return bool(mac) and hmac.compare_digest(mac, record_mac(job_id, data))


def seal_claim(job_id: str, claim: Claim) -> bytes:
    """A resumable job's claim value, sealed like its records: the MAC rides at the end of the
    holder (``<holder>#<mac>@<time>``), so every ``Claim`` reader still sees worker and time.
    Workers may write any claims key, and can learn a job's key from its progress subject, but
    only a holder of the job id can write a claim of the job (``open_claim``)."""
    return Claim(f"{claim.holder}#{record_mac(job_id, claim.encode())}", claim.refreshed).encode()


def open_claim(job_id: str, value: bytes | None) -> Claim | None:
    """The claim a holder of ``job_id`` wrote; None for anything else (no value, no or a wrong MAC,
    or one marked stopped since, which changes its bytes): such a claim is nobody's."""
    claim = Claim.decode(value)
    holder, sep, mac = claim.holder.rpartition("#")
    if not sep:
        return None
    plain = Claim(holder, claim.refreshed)
    return plain if hmac.compare_digest(mac, record_mac(job_id, plain.encode())) else None


class TokensRecord(msgspec.Struct, tag="tokens", kw_only=True):
    run: str  # the run (claim holder) that generated them
    samples: list[SampleDelta]


class ResumeRecord(msgspec.Struct, tag="resume", kw_only=True, omit_defaults=True):
    """Run ``run`` on ``worker_id`` took the job over, keeping ``kept[i]`` tokens of sample i;
    ``reason`` when it could keep nothing of what was stored (a corrupt checkpoint)."""

    run: str
    worker_id: str
    kept: list[int]
    reason: str | None = None


class DoneRecord(msgspec.Struct, tag="done", kw_only=True):
    """The job's answer is stored; what came before was rolled up into this record."""

    run: str


ProgressRecord = TokensRecord | ResumeRecord | DoneRecord


class TokenChunk(SampleDelta, kw_only=True, frozen=True):
    """What a stream of a job's tokens yields: a ``SampleDelta`` as the trainer sees it.
    ``rewound``: the tokens from ``start`` on that were yielded before are void (a run could not
    keep them and generates them again); never the case across an ordinary resume, which keeps
    every checkpointed token."""

    rewound: bool = False


@dataclass
class SampleSoFar:
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    spans: list[VersionSpan] = field(default_factory=list)
    finish: FinishReason | None = None
    restarts: list[int] = field(default_factory=list)  # (``SampleDelta.restarts``)

    def completion(self, want_logprobs: bool) -> Completion:
        return Completion(
            token_ids=list(self.token_ids),
            finish_reason=self.finish or "abort",
            logprobs=list(self.logprobs) if want_logprobs else None,
            weight_versions=list(self.spans),
        )


def append_spans(spans: list[VersionSpan], more: list[VersionSpan]) -> None:
    """Append ``more`` to ``spans``, merging a span that continues the last one (same version and
    replica, adjacent)."""
    for span in more:
        last = spans[-1] if spans else None
        if last is not None and last.end == span.start and (last.version, last.replica) == (span.version, span.replica):
            spans[-1] = VersionSpan(version=last.version, start=last.start, end=span.end, replica=last.replica)
        else:
            spans.append(span)


class Replay:
    """The generation so far of one job (``n`` samples of at most ``max_tokens``), from its
    progress records in stream order (those ``sealed`` for it)."""

    def __init__(self, n: int, max_tokens: int, logprobs: bool) -> None:
        self.max_tokens = max_tokens
        self.want_logprobs = logprobs
        self.samples = [SampleSoFar() for _ in range(n)]
        self.runs: list[str] = []  # the runs that wrote, in order
        self.done = False

    @property
    def finished(self) -> bool:
        return all(s.finish is not None for s in self.samples)

    @property
    def kept(self) -> list[int]:
        return [len(s.token_ids) for s in self.samples]

    @property
    def tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.samples)

    def apply(self, record: ProgressRecord) -> list[TokenChunk]:
        """Take one record in; the chunks it adds (or rewinds). ``CorruptCheckpoint`` if it does not
        continue this job's output where it stands."""
        if self.done:
            raise CorruptCheckpoint("a progress record after the job's done record")
        if record.run and (not self.runs or self.runs[-1] != record.run):
            self.runs.append(record.run)
        if isinstance(record, DoneRecord):
            self.done = True
            return []
        if isinstance(record, ResumeRecord):
            return self._resume(record)
        return [self._add(delta) for delta in record.samples]

    def _resume(self, record: ResumeRecord) -> list[TokenChunk]:
        if len(record.kept) != len(self.samples):
            raise CorruptCheckpoint(f"a resume record for {len(record.kept)} samples; the job has {len(self.samples)}")
        chunks = []
        for i, (sample, keep) in enumerate(zip(self.samples, record.kept, strict=True)):
            if not 0 <= keep <= len(sample.token_ids):
                raise CorruptCheckpoint(
                    f"a resume record keeps {keep} tokens of sample {i}, which has {len(sample.token_ids)}"
                )
            if keep < len(sample.token_ids):
                del sample.token_ids[keep:], sample.logprobs[keep:]
                sample.spans = spans_between(sample.spans, 0, keep)
                sample.restarts = [r for r in sample.restarts if r < keep]
                sample.finish = None
                chunks.append(TokenChunk(index=i, start=keep, token_ids=[], rewound=True))
        return chunks

    def _add(self, d: SampleDelta) -> TokenChunk:
        if not 0 <= d.index < len(self.samples):
            raise CorruptCheckpoint(f"sample {d.index} of a job with {len(self.samples)} samples")
        sample = self.samples[d.index]
        if sample.finish is not None:
            raise CorruptCheckpoint(f"tokens after sample {d.index} finished ({sample.finish})")
        if d.start != len(sample.token_ids):
            raise CorruptCheckpoint(
                f"sample {d.index}: tokens from offset {d.start}, but {len(sample.token_ids)} are stored"
                " (a gap or an overlap)"
            )
        end = d.start + len(d.token_ids)
        if end > self.max_tokens:
            raise CorruptCheckpoint(f"sample {d.index}: {end} tokens, over the job's max_tokens of {self.max_tokens}")
        if any(t < 0 for t in d.token_ids):
            raise CorruptCheckpoint(f"sample {d.index}: a negative token id")
        if self.want_logprobs and (d.logprobs is None or len(d.logprobs) != len(d.token_ids)):
            raise CorruptCheckpoint(f"sample {d.index}: log-probs do not match its {len(d.token_ids)} tokens")
        at = d.start
        for span in d.spans:
            if span.start != at or span.end <= span.start or span.version < 0:
                raise CorruptCheckpoint(f"sample {d.index}: version spans do not cover offsets {d.start}..{end}")
            at = span.end
        if at != end:
            raise CorruptCheckpoint(f"sample {d.index}: version spans do not cover offsets {d.start}..{end}")
        if d.restarts != sorted(set(d.restarts)) or any(not d.start <= r < end for r in d.restarts):
            raise CorruptCheckpoint(f"sample {d.index}: restarts {d.restarts} not in order within {d.start}..{end}")
        sample.restarts.extend(d.restarts)
        sample.token_ids.extend(d.token_ids)
        if self.want_logprobs:
            sample.logprobs.extend(d.logprobs or ())
        append_spans(sample.spans, d.spans)
        sample.finish = d.finish
        return TokenChunk(
            index=d.index,
            start=d.start,
            token_ids=list(d.token_ids),
            logprobs=list(d.logprobs) if self.want_logprobs and d.logprobs is not None else None,
            spans=list(d.spans),
            finish=d.finish,
        )


def spans_between(spans: list[VersionSpan], start: int, end: int) -> list[VersionSpan]:
    """The parts of ``spans`` inside output offsets ``[start, end)``."""
    out = []
    for span in spans:
        lo, hi = max(span.start, start), min(span.end, end)
        if lo < hi:
            out.append(span if (lo, hi) == (span.start, span.end) else msgspec.structs.replace(span, start=lo, end=hi))
    return out
