"""The independent oracle: judges one adversary run from what it saw, not from what the
project says about itself.

Its sources: the trainer's journal (every request as written, every answer it was handed,
every wait that outlived its deadline), the wiretap (job deliveries per worker, answers as
published, acks, claims, registry writes, activation announcements), the adversary's own
timeline (process lives and deaths, broker outages, commits, hidden or corrupt versions), the
rogue's journal, a fresh client's re-ask of every key, and the trainer's weights, from which it
computes every version's digest itself. The project's counters and metrics are never read.

The invariants (``Oracle.checks`` counts each evaluation; each violation is one line):

- ``version``: every accepted result's labelled versions (start, end, every per-token span)
  lie within its constraint (exact / min / max_staleness against the commits the adversary
  made) or its session's policy (pinned: every turn exactly at the first turn's version;
  monotonic: never below the previous turn's last version); every version it is labelled with
  was committed, and not after the result was finished. Commits are the adversary's own and, for
  publisher processes it SIGKILLed or raced (``publisher_kill``, ``publisher_race``), what the
  policy KV said right after, read raw from the broker: committed if ``latest`` reached N with
  ``v.<N>`` naming that process (a kill before the CAS of ``latest`` never commits). Of two racing
  publishers, exactly one may win: ``v.<N>`` names one contender, and the other did not exit
  reporting success.
- ``digest``: for every accepted result, the replica's last activation of that version before
  the result announced the digest of the trainer's weights at that version (``--verify-live``);
  a missing digest is a violation only for engines that provide one.
- ``replayed``: every accepted result of an echo replica that carries a replay coordinate
  (``RolloutResult.replay``, or a gateway answer's ``rollfleet.replay``) says what the harness
  knows from its own facts: its prompt digest is the digest of the prompt of the request the
  answer was for, every version a span of it names is listed, each listed version's digest is
  the trainer's own bytes at that version (``TrainerWeights.digest``, computed here; a version
  the stamping replica never held has none), and the seed it recorded is the request's, where
  the request gave one.
- ``served``: every token of every accepted result that a keyed echo engine made (``--echo-keyed``),
  or an sglang worker's keyed SGLang stand-in (``--sglang N``, ``reliability.adversary.engines``),
  is the token the trainer's own weights at its span's labelled version make, recomputed from
  the prompt, the tokens before it and the seed (``reliability.adversary.truth``): a label that does not
  name the weights that really served is caught by what was served, not by what was announced.
  One check per accepted answer; tokens of hf engines are not recomputed. When a publisher race
  was won by the perturbed contender (the policy KV's ``v.<N>`` names it), the trainer's truth
  for N is that contender's bytes and later versions build on them (``TrainerWeights.adopting``):
  the oracle learns the winner from the KV entry, never from the store, whose bytes are what is
  under test (a loser's shard under the winner's index must show as wrong tokens).
- ``delivered`` / ``forged``: the job of every accepted result was delivered to the worker the
  result names (the wiretap saw it; where it was disconnected while a copy of the job could be
  stored, ``tap_saw_every_copy``, unverified); no forged answer is ever accepted.
- ``once``: a key's answers agree (same job id and tokens, or the same error) across resubmits,
  a restarted trainer and a fresh client's re-ask; the same request is never refused as a
  conflict; a key reused for another request never gets the first one's result.
- ``resolution``: every request and turn resolves (result or typed error) by its deadline plus
  ``RESOLVE_SLACK_S``; nothing hangs; nothing untyped.
- ``lost``: no key is answered ``Expired`` (or left hanging) although a worker had published its
  answer before the deadline.
- ``stranded``: no request waits ``STARVE_S`` in a row, unanswered and held by nobody, while
  the broker is up and a live replica can serve it.
- ``orphan``: an exact job whose version no live replica serves is answered within
  ``ORPHAN_S`` (the README: "withdrawn ... within seconds").
- ``twice``: an ``at_most_once`` job is started (claimed) by at most one worker process, and
  answered ``Interrupted`` only if no worker finished it while alive (draining; or frozen by a
  SIGSTOP of it or of the broker: a paused holder is alive, and goes on where it stopped).
- ``moved``: a job is never delivered to a second worker while the first still holds it alive
  (acked within the ack-wait, not handed back).
- ``resumed``: a ``resume`` job's accepted result is whole: each completion's spans tile its tokens
  from 0 without gap or overlap, it has ``max_tokens`` tokens unless it stopped, every replica
  its spans name was delivered the job (a replica never delivered it cannot have made tokens of
  it), the last span is the answering replica's (unless it kept every token: another run had
  stored them all), and the tokens it says it kept were made by other runs.
- ``streamed``: half the ``resume`` jobs are streamed too; the chunks, put together as a trainer
  would (rewinds applied), are the accepted answer's tokens, with no chunk out of place.
- ``rogue``: the rogue worker reads no other worker's delivery.
- ``second-client``: a second client with a live client's id is refused ``ClientIdInUse``.
- ``reask-turn``: asking a failed turn again (``generate(turn=k)``) returns its answer at once.
- ``pinned-error``: a pinned session's turn refused for want of a replica at its pin, when
  none serves it, says so (names the pinned version) and is not retryable.
- ``available``: the trainer asked something and some of it was served; nothing was served for
  no longer than ``AVAILABLE_S`` while the trainer was asking (a call waiting, or refused), and
  no live process served for no longer than that while the run went on (broker outages, and
  ``BROKER_GRACE_S`` after each, excepted). The harness keeps the fleet at its size, so a stop
  longer than the bound is the product's doing. A replica whose engine server is dead or frozen
  (``--sglang``) cannot serve, whatever its registry says; once its server is back (restarted,
  thawed, taking pauses again) it serves again within the bound (``_check_engines_back``).
- ``cancelled``: about one new call in twelve is cancelled while queued or running; what
  ``cancel()`` says it did ("withdrawn", "stopped", "answered") is what the answers show.
- ``answered``: an error only a worker makes (``EngineFailure``, ``Interrupted``, ...) reached the
  trainer only where a worker published that failure for the key; ``Interrupted`` only for an
  ``at_most_once`` job or a session's turn.

The trainer's ``RolloutLoop`` and the gateways' HTTP trajectories and keyless callers are judged
in modules of their own, from the same raw facts: ``loop-group``, ``served``, ``loop-staleness``,
``loop-tokens`` and ``loop-ran`` (``reliability.adversary.oracle_loop``), and ``once``,
``version``, ``served`` and ``gone`` (``reliability.adversary.oracle_gateway``).

A call the trainer sent over HTTP to a ``rollfleet gateway`` (``client`` in its journal records:
the gateways' client id, whose key it is) is judged as any other: its answer, converted from
SGLang's shape, is recomputed (``served``), checked against its constraint (``version``), compared
with every other answer for its key and with the re-ask at the end, made by a client with the
gateways' id (``once``), resolved by its job's deadline (``resolution``) and counted in
``available``; its job (deadline, constraint) is the one the wiretap saw stored under that client
id, and when the worker finished it is read from the answer the worker published.

Each invariant counts one check per fact it judges (a result, a job, a call, a run), never per
delivery or log line; what the wiretap cannot have seen is counted as unverified, the same way
by every invariant.
"""

from __future__ import annotations

import bisect
import itertools
import re
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from reliability.adversary.engines import engine_out
from reliability.adversary.journal import prompt_digest, seed_used

RESOLVE_SLACK_S = 5.0  # the client's deadline grace (2 s) and its sweep, with room to spare
STARVE_S = 10.0
ORPHAN_S = 8.0  # the client's orphan grace (2 s), a dead replica's staleness (1.5 s), an ack-wait
STALENESS_LAG_S = 2.0  # how far behind the commits a client's view of `latest` may be
SAMPLE_S = 0.25
SERVING_STATES = ("ready", "degraded", "preparing", "activating")
CLIENT_ERRORS = ("NoCompatibleReplica", "ServiceUnavailable", "IdempotencyConflict", "InvalidRequest")
# Errors that only a worker's published failure can carry to the trainer.
WORKER_ERRORS = ("EngineFailure", "Interrupted", "ResultUnstorable", "Superseded")
RESTORED = "delivery of a re"  # (the unverified reasons of a job stored again or a consumer declared again)
AVAILABLE_S = 15.0  # the longest stop of service a run may have (a dead fleet's 48 s of 60 fails)
BROKER_GRACE_S = 5.0  # after a broker outage: clients and workers reconnect, workers register again
ALIVE_GRACE_S = 0.5  # what a process published reaches the wiretap this soon after its end is noted
COMMIT_SLACK_S = 0.5  # a result finished this long before its version's commit began is flagged
# A fact the wiretap saw this long before a store loss's lost_from may still have been stored
# after it (the tap hears a message as the broker stores it, give or take the copy's freeze).
LOSS_MARGIN_S = 0.2
LOST_WITH_STORE = "lost with the broker's store"  # (the unverified reasons of facts a store loss took)
# (``lost``) a turn asked again that joined an earlier ask's job, answered only after that job's deadline
LOST_JOINED_LATE = "lost: a turn asked again joined its job stored earlier, answered after that job's own deadline"
# (the unverified reason of a moved copy whose taker held its claim only once the job was answered)
CLAIMED_AFTER_THE_ANSWER = (
    "the copy's taker claimed it only after the first run's answer was stored, and answered nothing"
)


@dataclass
class Violation:
    check: str
    key: str | None
    message: str
    defect: str | None = None  # which item of issue 19 it looks like

    def line(self) -> str:
        hint = f"  [issue 19 item {self.defect}?]" if self.defect else ""
        return f"[{self.check}] {self.key or '-'}: {self.message}{hint}"


@dataclass
class Call:
    """One submit or turn of the trainer, and what came of it."""

    rid: str
    inc: int
    op: str
    key: str
    t0: float
    req: dict[str, Any] | None = None
    sid: str | None = None
    turn: int | None = None
    timeout: float | None = None
    stored: dict[str, Any] | None = None
    answer: dict[str, Any] | None = None
    hang: dict[str, Any] | None = None
    cancel: dict[str, Any] | None = None  # the trainer cancelled it: what cancel() said it did
    client: str = "trainer"  # whose key it is: the trainer's, or the gateways' (a call sent over HTTP)
    attempts: list[dict[str, Any]] | None = None  # a call over HTTP: each try, through which gateway

    @property
    def deadline(self) -> float | None:
        if self.stored and self.stored.get("deadline"):
            return float(self.stored["deadline"])
        if self.attempts and self.req is not None:
            # A gateway stores the job with its own timeout when a try reaches it: by the last try
            # at the latest (the wiretap, when it saw the job delivered, gives the job's own).
            return max(float(a["t_sent"]) for a in self.attempts) + float(self.req["timeout"])
        if self.timeout is not None:
            return self.t0 + float(self.timeout)
        if self.req is not None:
            return self.t0 + float(self.req["timeout"])
        return None

    @property
    def answered_at(self) -> float | None:
        return float(self.answer["t"]) if self.answer else None

    @property
    def is_result(self) -> bool:
        return bool(self.answer and self.answer.get("kind") == "result")

    @property
    def error(self) -> str | None:
        return self.answer.get("cls") if self.answer and self.answer.get("kind") == "error" else None


def _versions(desc: dict[str, Any]) -> list[int]:
    vs = {int(desc["version_start"]), int(desc["version_end"])}
    for spans in desc.get("spans") or []:
        vs.update(int(s[0]) for s in spans)
    return sorted(vs)


def refused_at_a_pin(answer: dict[str, Any] | None) -> bool:
    """Whether a pinned session's refused turn was refused at its pin: a turn refused while the pin
    was being chosen (the session's record, as the trainer journaled it, has no version yet) was
    not. Whether a replica comes to a version its constraint allows is then the fleet's to say,
    and the turn asked again may be served (campaign drain-flaky-mount seed 1: 1.26 s later)."""
    session = (answer or {}).get("session")
    return not isinstance(session, dict) or session.get("last_version") is not None


def unserved_stretches(
    wanted: list[tuple[float, float]],
    served: list[float],
    excluded: list[tuple[float, float]] | None = None,
) -> list[tuple[float, float, float]]:
    """Stretches in which something was wanted and nothing was served: ``(start, end, seconds)``.

    ``wanted``: intervals in which somebody asked (a call waiting; a refusal is a point);
    ``served``: the moments something was served. Between two consecutive moments of service,
    the stretch runs from the first moment something was wanted to the last (or to the next
    service); time inside ``excluded`` (outages the run injected on purpose) is not counted."""
    times = sorted(served)
    edges = [float("-inf"), *times, float("inf")]
    out: list[tuple[float, float, float]] = []
    for lo, hi in itertools.pairwise(edges):
        inside = [(max(a, lo), min(b, hi)) for a, b in wanted if b >= lo and a <= hi]
        inside = [(a, b) for a, b in inside if a <= b]
        if not inside:
            continue
        start, end = min(a for a, _ in inside), max(b for _, b in inside)
        off = sum(max(0.0, min(end, b) - max(start, a)) for a, b in _merged(list(excluded or [])))
        out.append((start, end, max(0.0, end - start - off)))
    return out


def tap_saw_every_copy(gaps: list[list[float]], since: float, until: float) -> bool:
    """Whether the wiretap saw every copy of a job stored, and every delivery of one, between
    ``since`` (the job first stored or asked for) and ``until`` (the run its answer names): it was
    connected throughout. A copy stored while it was disconnected (``gaps``: [disconnected,
    reconnected]; a job moved off a replica, or stored again, during a broker restart) counts its
    deliveries from 1 unseen, so an answer's "attempt 1" may be that copy's, not the delivery
    the wiretap saw: ``delivered`` cannot say which (unverified, never a violation)."""
    return not any(a <= until and b >= since for a, b in gaps)


def answer_payload(
    desc: dict[str, Any], call: Call | None, calls: list[Call], *, stored: dict[str, Any] | None, delivered: set[str]
) -> tuple[dict[str, Any] | None, str | None]:
    """The request whose tokens the accepted answer ``desc`` continues, or None and why it is not
    known. ``call``: the call that accepted it (None: a re-ask by key, or the final one);
    ``calls``: every call made under its key; ``stored``: the request of the call whose stored job
    the answer names (job id and fingerprint); ``delivered``: the prompt digests
    (``journal.prompt_digest``) of its job as the wiretap saw it delivered.

    A turn asked again by its index (``reask-turn``) is answered with the turn's stored answer:
    the payload passed with it is not read, and a restarted trainer may pass another prompt than
    the one the turn's job was stored with (seed 747109: the re-ask's prompt judged an answer to
    the first one, 13 of 13 tokens "wrong"). So it is never the answer's request on its own word;
    the job's own prompt, as delivered, tells which of the key's requests it was."""
    if stored is not None:
        return stored, None
    if call is not None and call.op != "reask-turn" and call.req and call.req.get("payload") is not None:
        return call.req["payload"], None  # (its client took the answer only for its own fingerprint)
    named = (str(desc.get("job_id")), desc.get("fingerprint"))
    for c in calls:  # another call of the key that was handed the same job's answer, by its request
        own = c.answer or {}
        if c.op != "reask-turn" and c.is_result and (str(own.get("job_id")), own.get("fingerprint")) == named:
            return (c.req or {}).get("payload"), None
    payloads: list[dict[str, Any]] = []
    for c in calls:
        p = (c.req or {}).get("payload")
        if p is not None and p not in payloads:
            payloads.append(p)
    def one(ps: list[dict[str, Any]]) -> dict[str, Any] | None:  # (what the tokens depend on: prompt and seed)
        return ps[0] if ps and len({(repr(p.get("prompt")), p.get("seed")) for p in ps}) == 1 else None

    if delivered:
        found = one([p for p in payloads if prompt_digest(p.get("prompt")) in delivered])
        if found is not None:
            return found, None
    asked = [p for p in payloads if any((c.req or {}).get("payload") == p and c.op != "reask-turn" for c in calls)]
    if one(asked) is not None:
        return one(asked), None
    if not asked:
        return None, "the answer's prompt is not known"
    what = "turn's key" if any(c.sid for c in calls) else "key"
    return None, f"the {what} was asked with several prompts, none known to be its job's"


def _merged(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[tuple[float, float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], b))
        else:
            out.append((a, b))
    return out



class Oracle:
    def __init__(
        self,
        *,
        cfg: Any,
        timeline: Any,
        tap: Any,
        trainer: list[dict[str, Any]],
        rogue: list[dict[str, Any]],
        finals: dict[str, dict[str, Any]],
        stored: dict[str, list[dict[str, Any]]],
        activations: list[Any],
        weights: Any,
        names: Any,
        broker_log: str = "",
    ) -> None:
        self.cfg, self.tl, self.tap = cfg, timeline, tap
        self.broker_log = broker_log
        self.trainer, self.rogue, self.finals, self.stored = trainer, rogue, finals, stored
        self.activations = activations
        self.weights, self.names = weights, names
        self.checks: dict[str, int] = defaultdict(int)
        self.unverified: dict[str, int] = defaultdict(int)
        self.notes: dict[str, Any] = {}
        # (job id, fingerprint) -> its request's payload; key -> its calls (``_payload_of``)
        self._requests: tuple[dict[tuple[str, Any], Any], dict[str, list[Any]]] | None = None
        self.violations: list[Violation] = []
        self.ack_wait = float(cfg.ack_wait)
        self.window = float(cfg.duplicate_window)
        # The broker is out while it is down (SIGKILLed, restarting) or frozen (SIGSTOP): a frozen
        # broker keeps its store, but nothing passes through it meanwhile. On a cluster, while a
        # node is killed, frozen or cut off: its clients fail over and the Raft groups it led
        # elect again, so service may stop for that long (the grace after it, as for a broker's);
        # every other promise holds throughout.
        nodes_out = [[f["from"], f["to"]] for f in getattr(timeline, "node_faults", []) or []]
        self.broker_out = [*timeline.broker_down, *getattr(timeline, "broker_paused", []), *nodes_out]
        self.available_s = float(getattr(cfg, "available_s", AVAILABLE_S))
        self.publisher_faults = list(getattr(timeline, "publishers", []) or [])
        # The trainer's truth follows the winners of publisher races, as the policy KV names them.
        adopted = {
            int(f["version"]): int(f["salt"])
            for f in self.publisher_faults
            if f.get("kind") == "race" and self._race_winner(f) == "perturbed"
        }
        if hasattr(weights, "adopting"):
            self.weights = weights.adopting(adopted)

    def lost_with_store(self, t: float, what: str, after: float | None = None) -> dict[str, Any] | None:
        """The store loss (``Timeline.stores_lost``) that took a fact of kind ``what`` (``results``,
        ``claims``, ``jobs``) the wiretap saw stored at ``t``, if one did: the broker restarted on a
        copy of its store older than ``t`` (a rollback) or on an empty one (a wipe), or that fact's
        stream deleted, after ``t``; with ``after``, only if the fact was looked for (asked again,
        run again) after the loss. Promises that rest on such a fact end there, and only there."""
        for loss in self._losses_of(what):
            # (the tap hears a write as the broker acknowledges it: one stored just before the
            # loss may be heard just after)
            if float(loss["lost_from"]) - LOSS_MARGIN_S <= t <= float(loss["at"]) + LOSS_MARGIN_S and (
                after is None or after >= float(loss["at"])
            ):
                return loss
        return None

    def _losses_of(self, what: str) -> list[dict[str, Any]]:
        """The store losses (``Timeline.stores_lost``) that take facts of kind ``what``: every
        rollback and wipe, and a deletion of that stream."""
        return [
            loss
            for loss in getattr(self.tl, "stores_lost", None) or []
            if loss.get("kind") != "delete_stream" or loss.get("target") == what
        ]

    def _lost_during(self, t0: float, t1: float, what: str) -> bool:
        """Whether a store loss (``lost_with_store``) took facts of kind ``what`` stored at some
        moment of [t0, t1]: its lost window overlaps it."""
        return any(
            float(loss["lost_from"]) - LOSS_MARGIN_S <= t1 and t0 <= float(loss["at"]) for loss in self._losses_of(what)
        )

    def _answer_seen_at(self, job_id: Any, fallback: float) -> float:
        """When the wiretap first saw ``job_id``'s answer published (else ``fallback``). By job id,
        not by key: a job id names one client's job, while the answers filed under a key are only
        those of the client whose key it first was (a key the trainer also sent over a gateway has
        its other answers elsewhere), and falling back to when the job was stored would date the
        answer seconds early."""
        seen = [p.t for p in self.published_by_job.get(job_id, [])] if job_id else []
        return min(seen) if seen else fallback

    def _published_at(self, desc: dict[str, Any]) -> float | None:
        """When the wiretap first saw this answer's job answered (None: never seen)."""
        seen = self._answer_seen_at(desc.get("job_id"), -1.0)
        return seen if seen >= 0.0 else None

    @staticmethod
    def _race_winner(f: dict[str, Any]) -> str | None:
        """Which contender of a race the policy KV's ``v.<N>`` names (None: neither)."""
        return next(
            (who for who, name in (f.get("contenders") or {}).items() if name == f.get("entry_publisher")), None
        )

    @staticmethod
    def _fault_committed(f: dict[str, Any]) -> bool | None:
        """Whether a publisher fault's version was committed by it: ``latest`` at N right after,
        with ``v.<N>`` naming the process (None: the KV could not be read)."""
        if f.get("latest_after") is None and f.get("error"):
            return None
        names = [f.get("publisher")] if f.get("kind") == "kill" else list((f.get("contenders") or {}).values())
        return f.get("latest_after") == f["version"] and f.get("entry_publisher") in names

    # -- bookkeeping ----------------------------------------------------------------------------
    def check(self, name: str, ok: bool, key: str | None, message: str, defect: str | None = None) -> bool:
        self.checks[name] += 1
        if not ok:
            self.violations.append(Violation(name, key, message, defect))
        return ok

    # -- the model ---------------------------------------------------------------------------------
    def _build(self) -> None:
        calls: dict[str, Call] = {}
        self.sessions: dict[str, dict[str, Any]] = {}
        self.reasks: list[dict[str, Any]] = []
        self.ended_by_kill: set[int] = {int(t["incarnation"]) for t in self.tl.trainers if t.get("how") == "killed"}
        for r in self.trainer:
            ev = r.get("ev")
            if ev == "submit":
                calls[r["rid"]] = Call(r["rid"], int(r["inc"]), r["op"], r["key"], float(r["t"]), req=r["req"])
                if r.get("client"):
                    calls[r["rid"]].client = str(r["client"])
                    calls[r["rid"]].attempts = []
            elif ev == "http_attempt" and r.get("rid") in calls:
                calls[r["rid"]].attempts = [*(calls[r["rid"]].attempts or []), r]
            elif ev == "turn":
                # (A turn's request is its payload; the session's constraint and policy are fixed.)
                c = Call(
                    r["rid"],
                    int(r["inc"]),
                    r["op"],
                    r["key"],
                    float(r["t"]),
                    sid=r["sid"],
                    turn=int(r["turn"]),
                    req={"payload": r.get("payload")},
                )
                c.timeout = float(r["timeout"]) if r.get("timeout") is not None else None
                calls[r["rid"]] = c
            elif ev == "stored" and r.get("rid") in calls:
                calls[r["rid"]].stored = r
            elif ev == "answer" and r.get("rid") in calls:
                calls[r["rid"]].answer = r
            elif ev == "hang" and r.get("rid") in calls:
                calls[r["rid"]].hang = r
            elif ev == "cancel" and r.get("rid") in calls:
                calls[r["rid"]].cancel = r
            elif ev == "session_open":
                self.sessions.setdefault(r["sid"], dict(r))
            elif ev == "reask":
                self.reasks.append(r)
        self.calls = list(calls.values())
        # A pinned session's pin, as its client recorded it (set before its first turn is sent).
        for c in sorted(self.calls, key=lambda c: c.t0):
            opened = self.sessions.get(c.sid or "")
            pin = ((c.answer or {}).get("session") or {}).get("last_version")
            if opened is not None and opened.get("policy") == "pinned" and pin is not None:
                opened.setdefault("pin", int(pin))
        # The idempotency key each turn really had (the product may decorate "<sid>/<turn>").
        self.idem: dict[str, str] = {}
        for c in self.calls:
            if c.answer and c.answer.get("idem_key"):
                self.idem[c.key] = c.answer["idem_key"]
        self.by_key: dict[str, list[Call]] = defaultdict(list)
        for c in self.calls:
            if c.op != "reask-turn" and (c.sid is None or (c.answer or {}).get("spent", True)):
                self.by_key[c.key].append(c)
        # Whose key each is: a key is a client's (the trainer's, or the gateways' for the calls it
        # sent over HTTP); what the wiretap saw under the same key for another client is not its.
        self.client_of: dict[str, str] = {}
        for c in self.calls:
            self.client_of.setdefault(c.key, c.client)
        # The wiretap, indexed.
        self.deliveries_by_job: dict[str, list[Any]] = defaultdict(list)
        self.deliveries_by_key: dict[str, list[Any]] = defaultdict(list)
        for d in self.tap.deliveries:
            if d.job_id:
                self.deliveries_by_job[d.job_id].append(d)
            if d.key and self._owned(d.key, d.client_id):
                self.deliveries_by_key[d.key].append(d)
        self.published_by_key: dict[str, list[Any]] = defaultdict(list)
        self.published_by_job: dict[str, list[Any]] = defaultdict(list)
        for p in self.tap.published:
            if p.job_id:
                self.published_by_job[p.job_id].append(p)
        parse = getattr(self.names, "parse_result_subject", None)
        for p in self.tap.published:
            parsed = parse(p.subject) if parse is not None and p.subject else None
            if p.key and self._owned(p.key, parsed[0] if parsed else None):
                self.published_by_key[p.key].append(p)
        self._gateway_facts()
        # A session turn's key as the product makes it may carry more than "<sid>/<turn>" (an
        # incarnation of the session): what the wiretap saw under it is filed under both.
        aliases: dict[str, str] = {}
        for d in self.tap.deliveries:
            if d.session_id and d.key and d.key.startswith(f"{d.session_id}/"):
                aliases[d.key] = f"{d.session_id}/{d.key.rsplit('/', 1)[1]}"
        for p in self.tap.published:
            sid = (p.desc or {}).get("session_id")
            if sid and p.key and p.key.startswith(f"{sid}/"):
                aliases[p.key] = f"{sid}/{p.key.rsplit('/', 1)[1]}"
        for real, alias in aliases.items():
            if alias != real:
                self.deliveries_by_key[alias].extend(self.deliveries_by_key.get(real, []))
                self.published_by_key[alias].extend(self.published_by_key.get(real, []))
                self.idem.setdefault(alias, real)
        # Versions committed: the adversary's commits, and those of publisher processes (the KV says).
        committed = [(t_done, v, t_start) for v, t_start, t_done in self.tl.commits]
        self.uncommitted: dict[int, str] = {}  # a publisher fault's version the KV shows never committed
        self.commit_unknown: set[int] = set()
        self.commit_lost: set[int] = set()  # one the KV may have held, then lost with the broker's store
        for f in self.publisher_faults:
            v, ok = int(f["version"]), self._fault_committed(f)
            if ok:
                committed.append((float(f["t_end"]), v, float(f["t_start"])))
            elif ok is None:
                self.commit_unknown.add(v)
            elif self._lost_during(float(f["t_start"]), float(f["t_end"]), "policy"):
                # The KV read after the fault shows it uncommitted, but the broker went back to an
                # older copy of its store (or lost it) while the publisher ran: a commit made in
                # between, which replicas may have activated and served, was lost with it (campaign
                # 8, seed 21: a racer committed v16 50 ms before a rollback to a copy 1.25 s older).
                self.commit_lost.add(v)
            else:
                how = (
                    f"its publisher SIGKILLed at {f.get('point')}"
                    if f.get("kind") == "kill"
                    else "raced for by two publishers, neither committed"
                )
                self.uncommitted[v] = f"{how}; latest v{f.get('latest_after')} right after"
        self.commits = sorted((t_done, v) for t_done, v, _ in committed)
        self.commit_started: dict[int, float] = {}
        for _, v, t_start in committed:
            self.commit_started[v] = min(t_start, self.commit_started.get(v, float("inf")))
        # Acks by stream sequence: a holder's progress acks show it holds a job even where the
        # wiretap missed the delivery itself.
        from reliability.adversary.tap import parse_ack

        self.acks_by_seq: dict[int, list[tuple[float, str]]] = defaultdict(list)
        for subject, acks in self.tap.acks.items():
            parsed = parse_ack(subject)
            if parsed is not None and parsed[0] == self.names.jobs_stream:
                self.acks_by_seq[parsed[3]].extend(acks)
        self._sample_fleet()

    def _owned(self, key: str, client: str | None) -> bool:
        """Whether what the wiretap saw under ``key`` for ``client`` is the key the calls used."""
        want = self.client_of.get(key)
        return want is None or client is None or client == want

    def _gateway_facts(self) -> None:
        """A call sent through a gateway: its job as stored (the wiretap's delivery of the key under
        the gateways' client id: job id, deadline, constraint), and what its HTTP answer does not
        carry (when the worker finished it, which delivery ran it, the fingerprint) from the answer
        as the worker published it, the same tokens; neither seen, it stays unknown (its deadline
        is then the last try's, when it finished the moment it was answered)."""
        for c in self.calls:
            if c.attempts is None:
                continue
            self.notes["gateway_calls"] = self.notes.get("gateway_calls", 0) + 1
            got = c.answer or {}
            end = c.answered_at or float((c.hang or {}).get("t") or float("inf"))
            seen = [
                d
                for d in sorted(self.deliveries_by_key.get(c.key, []), key=lambda d: d.t)
                if d.client_id == c.client and (d.job_id == got.get("job_id") if got.get("job_id") else d.t <= end)
            ]
            if seen and c.stored is None:
                d = seen[0]
                # The call is due by its job's deadline. One that found its key's job stored before
                # its first try joined it, deadline included: the gateway follows that job, and a
                # retry's timeout does not extend it (campaign 9, seed 19: a restarted trainer asked
                # again 2.4 s before the job's deadline, with a timeout of its own, and got the
                # job's Expired; the oracle had dated it by its own timeout). A try that found no
                # job for the key (lost with the broker's store, or past the duplicate window)
                # stored it again with a deadline of its own: the call is due by the last such
                # copy's (campaign seed 778).
                first_sent = min(float(a["t_sent"]) for a in c.attempts) if c.attempts else c.t0
                joined_deadline = float(getattr(d, "deadline", 0.0) or 0.0)
                joined = bool(joined_deadline) and float(d.submitted_at or d.t) < first_sent
                due = [joined_deadline]
                due += [
                    float(getattr(o, "deadline", 0.0) or 0.0)
                    for o in seen[1:]
                    if any(float(a["t_sent"]) <= float(o.submitted_at or 0.0) <= float(a["t"]) for a in c.attempts)
                ]
                if not joined:
                    due += [first_sent + float((c.req or {}).get("timeout") or 0.0)]
                c.stored = {"ev": "stored", "rid": c.rid, "key": c.key, "job_id": d.job_id,
                            "deadline": max(due) or None, "constraint": list(d.constraint or ()),
                            "fingerprint": d.fingerprint, "stream_seq": d.stream_seq, "t": d.submitted_at or d.t,
                            "from": "the wiretap"}  # fmt: skip
                if not c.stored["constraint"]:
                    c.stored.pop("constraint")
            if not c.is_result or got.get("finished_at") is not None:
                continue
            self.notes["gateway_results"] = self.notes.get("gateway_results", 0) + 1
            same = [
                p
                for p in self.published_by_key.get(c.key, [])
                if p.job_id == got.get("job_id") and p.desc and p.desc.get("tokens") == got.get("tokens")
            ]
            if same:
                desc = same[0].desc or {}
                for k in ("finished_at", "attempt", "fingerprint", "kept", "session_id"):
                    got[k] = desc.get(k)
            else:
                self.unverified["gateway answer: its published copy not seen (finished when answered)"] += 1
                got["finished_at"] = got.get("t")

    def latest_at(self, t: float) -> int:
        i = bisect.bisect_right(self.commits, (t, float("inf")))
        return max((v for _, v in self.commits[:i]), default=0)

    def latest_may_be_at(self, t: float) -> int:
        """The newest version a client may have seen as `latest` at ``t``: one whose commit had
        begun by then (a racing or killed publisher's commit lands anywhere in its window, and the
        adversary notes it only once the process is over: campaign 6, seed 844418, a session turn
        stored at min:18 while the race for v18 was still being noted)."""
        return max([self.latest_at(t), *(v for v, start in self.commit_started.items() if start <= t)])

    def proc_at(self, worker: str, t: float) -> Any:
        """The worker's process running (and not stopped at a fault point) at ``t``."""
        for w in self.tl.workers:
            if w.worker_id == worker and w.start <= t and (w.end is None or t < w.end):
                if w.paused_at is not None and t >= w.paused_at:
                    return None
                return w
        return None

    def by_own_clock(self, worker: str, t: float, seen: float | None = None) -> float:
        """A time a worker wrote (``finished_at``, ``activated_at``) on the harness's clock: less
        the skew of the process of that worker whose life it falls in (``skew``). A life that
        contains it exactly wins over one that ended up to 2 s before (an end noted late): else a
        skewed process SIGKILLed and replaced at once by an unskewed one of the same id had the
        new one's times shifted by its skew (seed 3, 30 s: results flagged as finished before
        their version's commit). ``seen``: when the wiretap saw what the time stamps (an answer
        published); only a life alive then can have written it. Both lives can contain the time
        exactly (a skewed process ended, an unskewed one started under its id within the skew:
        campaign 15, seed 1409, an answer of the new life dated by the old one's skew)."""
        lives = [w for w in self.tl.workers if w.worker_id == worker]
        if seen is not None:
            alive = [w for w in lives if w.start <= seen and (w.end is None or seen <= w.end + ALIVE_GRACE_S)]
            lives = alive or lives
        for grace in (0.0, 2.0):
            for w in lives:
                skew = float(getattr(w, "skew_s", 0.0) or 0.0)
                if w.start <= t - skew and (w.end is None or t - skew <= w.end + grace):
                    return t - skew
        return t

    def broker_down(self, t: float) -> bool:
        return any(a <= t <= b for a, b in self.broker_out)

    def _sample_fleet(self) -> None:
        """Which replica serves what, every SAMPLE_S: a live process (adversary's timeline) and
        its newest registry entry written by that process (the wiretap)."""
        entries: dict[str, list[tuple[float, Any]]] = defaultdict(list)
        for t, worker, status in self.tap.fleet:
            entries[worker].append((t, status))
        starts = [w.start for w in self.tl.workers] or [0.0]
        t0 = min(starts)
        self.engine_lives: dict[str, list[Any]] = defaultdict(list)  # worker id -> its engine server's lives
        for es in getattr(self.tl, "engines", []) or []:
            self.engine_lives[es.worker_id].append(es)
        t1 = max(
            [t0 + 1.0]
            + [w.end for w in self.tl.workers if w.end is not None]
            + [t for t, _, _ in self.tap.fleet[-1:]]
            + [float(c.answer["t"]) for c in self.calls if c.answer]
            + [float(c.hang["t"]) for c in self.calls if c.hang]
        )
        self.t_first, self.samples = t0, []
        # Per sample, the (worker, active version) of replicas left out for a dead or frozen engine
        # server: not serving, but at a version they may serve again when it is back.
        self.engine_out_samples: list[list[tuple[str, int]]] = []
        cursor = {w: 0 for w in entries}
        t = t0
        while t <= t1 + SAMPLE_S:
            snap: list[tuple[str, str, int, int | None, bool]] = []
            out: list[tuple[str, int]] = []
            if not self.broker_down(t):
                for worker, seq in entries.items():
                    i = cursor[worker]
                    while i + 1 < len(seq) and seq[i + 1][0] <= t:
                        i += 1
                    cursor[worker] = i
                    et, status = seq[i]
                    if et > t or status is None:
                        continue
                    proc = self.proc_at(worker, t)
                    if proc is None or et < proc.start:
                        continue
                    if proc.engine == "sglang" and engine_out(self.engine_lives.get(worker, []), t):
                        out.append((worker, int(status.active_version)))
                        continue  # (its engine server dead or frozen: it cannot serve, whatever it says)
                    free = int(status.in_flight) < int(status.capacity)
                    snap.append((worker, status.state, int(status.active_version), status.preparing_version, free))
            self.samples.append(snap)
            self.engine_out_samples.append(out)
            t += SAMPLE_S

    def snapshot(self, t: float) -> list[tuple[str, str, int, int | None, bool]]:
        i = int((t - self.t_first) / SAMPLE_S)
        return self.samples[i] if 0 <= i < len(self.samples) else []

    def _engine_out_at(self, t: float) -> list[tuple[str, int]]:
        i = int((t - self.t_first) / SAMPLE_S)
        return self.engine_out_samples[i] if 0 <= i < len(self.engine_out_samples) else []

    @staticmethod
    def takes(
        entry: tuple[str, str, int, int | None, bool],
        kind: str,
        version: int,
        idle: bool = False,
        promised: bool = False,
        now: bool = False,
    ) -> bool:
        """Whether a replica (a fleet sample) serves the constraint; ``idle``: with a free slot too;
        ``promised``: a replica still starting, preparing that version, counts (the README's "at, or
        preparing, a compatible version": such a job is kept for it); ``now``: only a replica that
        could run it at this moment (preparing an exact job's version is not serving it yet, and a
        replica may skip a version it prepared when a newer one is committed meanwhile)."""
        _, state, active, preparing, free = entry
        if promised and state == "starting" and kind == "exact" and preparing == version:
            return True
        if state not in SERVING_STATES or (idle and not free):
            return False
        if kind == "exact":
            return (active == version and state != "activating") or (preparing == version and not now)
        return active >= version

    # -- constraints ------------------------------------------------------------------------------
    def constraint_of(self, c: Call) -> tuple[str, int] | None:
        """The constraint a plain request must meet, from what was written and when (a
        max_staleness request: against the adversary's own commits, allowing a short lag)."""
        if c.req is None:
            return None
        kind, value = c.req["kind"], int(c.req["value"])
        if kind == "staleness":
            return "min", max(0, self.latest_at(c.t0 - STALENESS_LAG_S) - value)
        return ("exact" if kind == "exact" else "min"), value

    def resolved(self, c: Call) -> tuple[str, int] | None:
        """The constraint the product stored the job with (the one it serves it by)."""
        if c.stored and c.stored.get("constraint"):
            kind, v = c.stored["constraint"]
            return str(kind), int(v)
        return None

    # -- the checks ----------------------------------------------------------------------------------
    def judge(self) -> list[Violation]:
        self._build()
        self._check_resolution()
        self._check_versions_and_sessions()
        self._check_committed()
        self._check_publisher_races()
        self._check_accepted()
        self._check_served()
        self._check_replayed()
        self._check_forged_errors()
        self._check_once()
        self._check_lost_and_stranded()
        self._check_orphans()
        self._check_twice_and_moved()
        self._check_resumed()
        self._check_rogue()
        self._check_second_clients()
        self._check_reask_turns()
        self._check_activation_digests()
        self._check_permissions()
        self._check_topology()
        self._check_answered()
        self._check_available()
        self._check_engines_back()
        self._check_converged()
        self._check_disks()
        self._check_cancelled()
        self._check_loops()
        self._check_gateway_sessions()
        self._check_autoscaler()
        self.notes.update(
            activations=len(self.activations),
            calls=len(self.calls),
            keys=len(self.by_key),
            results_accepted=sum(1 for c in self.calls if c.is_result),
            errors_by_class=self._errors_by_class(),
        )
        # One line per distinct finding: the same defect hit by many keys is summarized.
        return self._dedupe()

    def _check_autoscaler(self) -> None:
        """(``--autoscale``) the fleet's size, one controller acting, waits for a held version
        (``reliability.adversary.oracle_autoscale``)."""
        facts = getattr(self.tl, "autoscale", None)
        if facts:
            from reliability.adversary.oracle_autoscale import judge_autoscaler

            judge_autoscaler(self, facts)

    def _errors_by_class(self) -> dict[str, int]:
        out: dict[str, int] = defaultdict(int)
        for c in self.calls:
            if c.error:
                out[c.error] += 1
            elif c.hang:
                out["(hang)"] += 1
        return dict(sorted(out.items()))

    def _dedupe(self) -> list[Violation]:
        seen: dict[tuple[str, str], int] = defaultdict(int)
        out: list[Violation] = []
        for v in self.violations:
            sig = (v.check, re.sub(r"[0-9a-f]{8,}|\d+(\.\d+)?", "#", v.message)[:80])
            seen[sig] += 1
            if seen[sig] <= 3:
                out.append(v)
        for (check, sig), n in seen.items():
            if n > 3:
                out.append(Violation(check, None, f"... and {n - 3} more like: {sig}"))
        return out

    def _check_resolution(self) -> None:
        for c in self.calls:
            if c.op == "reask-turn":
                continue  # judged by reask-turn
            if c.answer is None and c.hang is None:
                if c.inc in self.ended_by_kill:
                    self.unverified["cut short by the trainer's SIGKILL"] += 1
                    continue
                self.check("resolution", False, c.key, f"{c.op} call {c.rid} was never resolved (no answer, no hang)")
                continue
            if c.hang is not None and c.attempts and c.deadline is not None and c.hang["t"] < c.deadline:
                # Over HTTP the caller gave up before the gateway's deadline for the copy its last
                # tries stored: nothing the gateway promised was due yet.
                self.unverified["resolution: the HTTP caller gave up before the gateway's deadline"] += 1
                continue
            if c.hang is not None:
                self.check(
                    "resolution",
                    False,
                    c.key,
                    f"{c.op} {c.rid} still unanswered {c.hang['t'] - (c.deadline or c.t0):.1f} s after its "
                    f"deadline (waited {c.hang['t'] - c.t0:.1f} s)",
                    "4" if c.sid else None,
                )
                continue
            assert c.answer is not None
            if c.answer.get("untyped"):
                self.check("resolution", False, c.key, f"an untyped {c.answer.get('cls')}: {c.answer.get('message')}")
                continue
            deadline = c.deadline
            if deadline is None or c.answer.get("at") == "submit":
                self.checks["resolution"] += 1
                continue
            # Due at its deadline, or at once where it was asked after it: a restarted trainer
            # resuming a job whose deadline passed while no trainer ran (campaign seed 7: resumed
            # 5.7 s after its deadline, answered Expired 0.24 s later).
            late = float(c.answer["t"]) - max(deadline, c.t0)
            self.check(
                "resolution",
                late <= RESOLVE_SLACK_S,
                c.key,
                f"{c.op} {c.rid} resolved {late:.1f} s after it was due ({c.answer.get('cls') or 'result'})",
            )

    def _accepted(self) -> list[tuple[Call | None, str, dict[str, Any]]]:
        """Every result the trainer accepted: (call or None for a re-ask, key, description)."""
        out: list[tuple[Call | None, str, dict[str, Any]]] = []
        for c in self.calls:
            if c.is_result:
                out.append((c, c.key, c.answer or {}))
        for r in self.reasks:
            if r.get("kind") == "result":
                out.append((None, r["key"], r))
        for key, f in self.finals.items():
            if f.get("kind") == "result":
                out.append((None, key, f))
        return out

    def _check_versions_and_sessions(self) -> None:
        # Plain requests.
        for c in self.calls:
            if not c.is_result or c.sid is not None or c.answer is None or c.answer.get("forged_tokens"):
                continue
            first = self._first_identical(c)
            want = self.constraint_of(first)
            if want is None:
                continue
            if c.req and c.req["kind"] == "staleness" and self._view_may_lag(first.t0):
                self.unverified["max_staleness: the trainer's view may lag (restart, outage)"] += 1
                continue
            kind, v = want
            vs = _versions(c.answer)
            ok = all(x == v for x in vs) if kind == "exact" else min(vs) >= v
            self.check(
                "version",
                ok,
                c.key,
                f"labelled v{vs} for {c.req['kind'] if c.req else '?'}:"
                f"{c.req['value'] if c.req else '?'} (must be {kind} {v}); served by {c.answer['worker_id']}",
            )
            got = self.resolved(c)
            lag = self._staleness_lag(c.t0) if c.req and c.req["kind"] == "staleness" and got is not None else None
            if lag is not None:
                # (Judged at this call's own submit: a resubmission resolves anew, and its client
                # may have started a moment before; seed 415513: a trainer started 0.8 s after a
                # broker wipe resolved max_staleness=0 against no `latest` at all.)
                self.unverified[f"max_staleness: {lag}"] += 1
            elif c.req and c.req["kind"] == "staleness" and got is not None:
                self.check(
                    "version",
                    got[1] >= v,
                    c.key,
                    f"max_staleness={c.req['value']} resolved to min {got[1]}, but v{v + int(c.req['value'])} "
                    f"was committed {STALENESS_LAG_S:g} s before the submit",
                )
        # Sessions, turn by turn.
        turns: dict[str, list[Call]] = defaultdict(list)
        for c in self.calls:
            if c.sid and c.op == "turn" and c.is_result and c.answer and not c.answer.get("forged_tokens"):
                turns[c.sid].append(c)
        for sid, answered in turns.items():
            opened = self.sessions.get(sid, {})
            policy = opened.get("policy")
            base = opened.get("constraint") or {}
            answered.sort(key=lambda c: (c.turn or 0, c.t0))
            pin: int | None = opened.get("pin")
            floor = -1
            for c in answered:
                assert c.answer is not None
                vs = _versions(c.answer)
                if "min_version" in base:
                    self.check(
                        "version",
                        min(vs) >= int(base["min_version"]),
                        c.key,
                        f"turn labelled v{vs}, session min_version {base['min_version']}",
                    )
                if policy == "pinned":
                    if pin is None:
                        pin = vs[0]
                    self.check("version", vs == [pin], c.key, f"pinned session at v{pin}, turn labelled v{vs}")
                elif policy == "monotonic":
                    self.check(
                        "version",
                        min(vs) >= floor,
                        c.key,
                        f"monotonic session: turn labelled v{vs} after a turn that ended at v{floor}",
                    )
                    floor = max(floor, int(c.answer["version_end"]), max(vs))
                else:
                    self.checks["version"] += 1
            if pin is not None:
                self.sessions.setdefault(sid, {}).setdefault("pin", pin)

    def _check_committed(self) -> None:
        """version: an accepted result names only versions that were committed, and committed
        before it was finished (a commit begun by then: its CAS of ``latest`` came between)."""
        done: set[tuple[str, str, str]] = set()
        for _call, key, desc in self._accepted():
            sig = (key, str(desc.get("job_id")), repr(desc.get("spans")))
            if sig in done or desc.get("forged_tokens"):
                continue
            done.add(sig)
            vs = _versions(desc)
            if any(v in self.commit_unknown for v in vs):
                self.unverified["version: the policy KV could not be read after a publisher fault"] += 1
                continue
            if any(v in self.commit_lost and v not in self.commit_started for v in vs):
                self.unverified[f"version: a commit by a publisher under fault {LOST_WITH_STORE}"] += 1
                continue
            never = [v for v in vs if v not in self.commit_started]
            if never:
                why = "; ".join(f"v{v}: {self.uncommitted[v]}" for v in never if v in self.uncommitted)
                self.check(
                    "version",
                    False,
                    key,
                    f"labelled v{vs}, but v{never} never committed"
                    f"{f' ({why})' if why else ''}; served by {desc.get('worker_id')} "
                    f"(job {desc.get('job_id')})",
                )
                continue
            finished = self.by_own_clock(
                str(desc.get("worker_id")), float(desc.get("finished_at") or 0.0), self._published_at(desc)
            )
            early = [v for v in vs if finished and self.commit_started[v] > finished + COMMIT_SLACK_S]
            self.check(
                "version",
                not early,
                key,
                f"labelled v{vs}, but v{early[0] if early else '?'} was committed only "
                f"{(self.commit_started[early[0]] - finished) if early else 0:.2f} s after the result was "
                f"finished; served by {desc.get('worker_id')} (job {desc.get('job_id')})",
            )

    def _check_publisher_races(self) -> None:
        """version: of two publishers racing for one version, exactly one may win."""
        for f in self.publisher_faults:
            if f.get("kind") != "race" or self._fault_committed(f) is None:
                continue
            won, codes = self._race_winner(f), f.get("codes") or {}
            claimed = sorted(who for who, code in codes.items() if code == 0)
            if claimed and won is None and self._lost_during(float(f["t_start"]), float(f["t_end"]), "policy"):
                # The winner's commit may have been lost with the broker's store (a rollback to a
                # copy taken before it, a wipe, the policy bucket deleted): the promise ends there.
                self.unverified[f"publisher race: the commit {LOST_WITH_STORE}"] += 1
                continue
            ok = len(claimed) <= 1 and (not claimed or claimed[0] == won)
            self.check(
                "version",
                ok,
                f"v{f['version']}",
                f"publisher race for v{f['version']}: the policy KV's v.{f['version']} names "
                f"{f.get('entry_publisher')!r} ({won or 'neither contender'}), but {claimed} exited reporting "
                f"success",
            )

    def _staleness_lag(self, t: float) -> str | None:
        """Why the trainer's view of `latest` may, at ``t``, be older than the adversary's commits
        say (None: it may not): the broker's policy KV went back to an older copy of its store, or
        lost it, and nothing was committed since (`latest` moves forward again with the next
        commit); or the trainer started, or the broker was out, within the view's lag."""
        for loss in self._losses_of("policy"):
            if float(loss["at"]) <= t and not any(float(loss["back"]) <= done <= t for done, _ in self.commits):
                return f"`latest` {LOST_WITH_STORE}, nothing committed since"
        if self._view_may_lag(t):
            return "the trainer's view may lag (restart, outage)"
        return None

    def _view_may_lag(self, t: float) -> bool:
        return self._disturbed(t - 5.0, t) or any(t - 5.0 <= tr["start"] <= t for tr in self.tl.trainers)

    def _first_identical(self, c: Call) -> Call:
        """The first call of the same key with the same request (its constraint is the job's)."""
        for other in sorted(self.by_key.get(c.key, []), key=lambda x: x.t0):
            if other.req == c.req and other.stored is not None:
                return other
        return c

    def _echo_digests(self) -> bool:
        try:
            from rollfleet.workers.engines.base import Engine
            from rollfleet.workers.engines.echo import EchoEngine
        except Exception:
            return False
        return EchoEngine.live_checksums is not Engine.live_checksums

    def _check_accepted(self) -> None:
        """digest, delivered and forged, for every accepted result."""
        expect_digest = {"hf": True, "echo": self._echo_digests()}
        self.notes["digest_expected_from"] = sorted(e for e, yes in expect_digest.items() if yes)
        acts: dict[str, list[Any]] = defaultdict(list)
        for a in self.activations:
            acts[a.worker_id].append(a)
        for lst in acts.values():
            lst.sort(key=lambda a: a.activated_at)
        forged_ids = {r["job_id"] for r in self.rogue if r.get("ev") == "forge"}
        done: set[tuple[str, str, str]] = set()
        for _call, key, desc in self._accepted():
            sig = (key, str(desc.get("job_id")), str(desc.get("worker_id")))
            if sig in done:
                continue
            done.add(sig)
            job_id, worker = desc.get("job_id"), desc.get("worker_id")
            forged = bool(desc.get("forged_tokens")) or (job_id in forged_ids and str(job_id).startswith("forged"))
            if not self.check(
                "forged", not forged, key, f"a forged answer (job {job_id}, claiming worker {worker}) was accepted", "3"
            ):
                continue
            # delivered: the delivery the result ran on (its attempt) went to the worker it names
            seen = self.deliveries_by_job.get(str(job_id), [])
            to = {d.worker for d in seen}
            ran_on = [d for d in seen if d.attempt == desc.get("attempt")]
            t_run = self.by_own_clock(str(worker), float(desc.get("finished_at") or 0.0), self._published_at(desc))
            # (From the submit to the last thing seen of it: a consumer re-declared between the
            # delivery the result ran on and a later one the wiretap saw counts.)
            # (And from the first time any incarnation of the trainer stored this job: a restarted
            # trainer's call follows a job stored before it, whose first deliveries count.)
            stored_at = [float(c.stored["t"]) for c in self.calls if c.stored and c.stored.get("job_id") == job_id]
            since = min(
                [d.t for d in seen]
                + [t_run]
                + ([float(_call.t0)] if getattr(_call, "t0", None) else [])
                + [t for t in stored_at if t]
            )
            unseen = self._unseen_delivery(str(job_id), since, max([d.t for d in seen] + [t_run]))
            if worker in to:
                self.checks["delivered"] += 1
            elif any(self.lost_with_store(d.t, "jobs", after=t_run) for d in ran_on) or (
                ran_on and self._count_lost_between(t_run, min(d.t for d in ran_on))
            ):
                # That delivery's record (its count) was lost with the store: the broker counts
                # deliveries of the job again from where its copy left them.
                self.unverified[f"delivered: the delivery's count {LOST_WITH_STORE}"] += 1
            elif not tap_saw_every_copy(self.tap.gaps, since, max([d.t for d in seen] + [t_run])):
                self.unverified["delivered: a copy may have been stored while the wiretap was disconnected"] += 1
            elif (
                ran_on
                and all(d.worker is not None for d in ran_on)
                and not (unseen or "").startswith(RESTORED)
                and self._every_copy_seen(str(job_id), ran_on, seen)
            ):
                # The wiretap saw the very delivery the result ran on go to another worker (and
                # that job was stored once, its consumer never re-declared).
                self.check(
                    "delivered",
                    False,
                    key,
                    f"accepted result of job {job_id} names {worker} (attempt {desc.get('attempt')}), but that "
                    f"delivery went to {sorted({str(d.worker) for d in ran_on})}",
                    "3",
                )
            else:
                self.unverified[unseen or "delivery not seen by the wiretap"] += 1
            # digest
            finished = t_run
            proc = self.proc_at(str(worker), finished) or self._proc_ended_near(str(worker), finished)
            if proc is None:
                self.unverified["digest: no process of that worker at that time"] += 1
                continue
            for v in _versions(desc):
                mine = [
                    a
                    for a in acts.get(str(worker), [])
                    if a.version == v and proc.start <= self.by_own_clock(str(worker), a.activated_at) <= finished
                ]
                if not mine:
                    self.unverified["digest: served since start-up (no activation announced)"] += 1
                    continue
                last = mine[-1]
                if last.weights_digest is None:
                    if expect_digest.get(proc.engine, False):
                        self.check("digest", False, key, f"{worker} ({proc.engine}) announced v{v} with no digest", "1")
                    else:
                        self.unverified[f"digest: the {proc.engine} engine announces none"] += 1
                    continue
                want = self.weights.digest(v)
                self.check(
                    "digest",
                    last.weights_digest == want,
                    key,
                    f"served by {worker} ({proc.engine}) labelled v{v}: its activation of v{v} announced live "
                    f"weights {last.weights_digest[:12]}, the trainer's v{v} is {want[:12]} (mixed weights)",
                    "1",
                )

    def _payload_of(self, check: str, call: Any, key: str, desc: dict[str, Any]) -> dict[str, Any] | None:
        """The request an accepted answer answers (``answer_payload``), its prompt known; else None,
        counted unverified under ``check``. A result's request is the one stored as its job (a
        reused key's other request is not it: a key has one job id, so the request is told by its
        fingerprint too); a turn's re-ask is found by its product key."""
        if self._requests is None:
            payload_of_job = {
                (str(c.stored["job_id"]), c.stored.get("fingerprint")): c.req["payload"]
                for c in self.calls
                if c.stored and c.req
            }
            calls_of_key: dict[str, list[Call]] = defaultdict(list)
            for c in self.calls:
                for k in {c.key, self.idem.get(c.key, c.key)}:
                    calls_of_key[k].append(c)
            self._requests = (payload_of_job, calls_of_key)
        payload_of_job, calls_of_key = self._requests
        job_id = str(desc.get("job_id"))
        payload, unknown = answer_payload(
            desc,
            call,
            calls_of_key.get(key, []),
            stored=payload_of_job.get((job_id, desc.get("fingerprint"))),
            delivered={d.prompt for d in self.deliveries_by_job.get(job_id, []) if d.prompt},
        )
        if payload is None or payload.get("prompt") is None:
            self.unverified[f"{check}: {unknown or 'the answer has no prompt'}"] += 1
            return None
        return payload

    def _check_served(self) -> None:
        """served: each accepted answer's tokens are what its labelled versions' weights make."""
        try:
            from reliability.adversary.truth import Truth
        except ImportError:  # a rollfleet without keyed echo (``--code``): its workers ran unkeyed
            self.unverified["served: this rollfleet has no keyed echo engine"] += 1
            return
        truth = Truth(self.weights)
        engine_of = {w.worker_id: w.engine for w in self.tl.workers}
        versions = sorted({v for _, v in self.commits})
        done: set[tuple[str, str, str]] = set()
        for call, key, desc in self._accepted():
            # One check per answer, however often it was handed over (a copy that differs is judged too).
            sig = (str(desc.get("job_id")), str(desc.get("worker_id")), repr(desc.get("token_ids")))
            if sig in done or desc.get("forged_tokens"):  # (a forged answer is judged by ``forged``)
                continue
            done.add(sig)
            if "token_ids" not in desc:
                self.unverified["served: the journal has no token ids (a run before keyed echo)"] += 1
                continue
            payload = self._payload_of("served", call, key, desc)
            if payload is None:
                continue
            verdict = truth.judge(
                desc,
                payload["prompt"],
                seed=seed_used(payload, desc),
                versions=versions,
                keyed_replica=lambda w: engine_of.get(w) in ("echo", "sglang"),  # (sglang: its keyed stand-in)
            )
            if not verdict.checked and not verdict.mismatches:
                self.unverified["served: no token of it made by a keyed engine"] += 1
                continue
            bad = verdict.mismatches
            more = f" (and {len(bad) - 1} more spans)" if len(bad) > 1 else ""
            self.check(
                "served",
                not bad,
                key,
                f"served by {desc.get('worker_id')} (job {desc.get('job_id')}): "
                f"{bad[0].describe() if bad else ''}{more}",
                "1",
            )

    def _check_replayed(self) -> None:
        """replayed, for every accepted echo result with a coordinate (``replay`` in its journal)."""
        from rollfleet.schemas.replay import coordinate_from_wire
        from rollfleet.schemas.replay import prompt_digest as replay_prompt_digest

        engine_of = {w.worker_id: w.engine for w in self.tl.workers}
        done: set[tuple[str, str]] = set()
        for call, key, desc in self._accepted():
            sig = (str(desc.get("job_id")), str(desc.get("worker_id")))
            wire = desc.get("replay")
            if sig in done or desc.get("forged_tokens") or engine_of.get(str(desc.get("worker_id"))) != "echo":
                continue
            done.add(sig)
            if wire is None:
                self.unverified["replayed: the answer carries no coordinate"] += 1
                continue
            job_id = str(desc.get("job_id"))
            payload = self._payload_of("replayed", call, key, desc)
            if payload is None:
                continue
            try:
                coord, _ = coordinate_from_wire(wire)
            except ValueError as exc:
                self.check("replayed", False, key, f"job {job_id}: {exc}", "1")
                continue
            wrong: list[str] = []
            if coord.prompt != replay_prompt_digest([int(t) for t in payload["prompt"]]):
                wrong.append(f"prompt digest {coord.prompt.hex()} is not the request's prompt's")
            listed = {v.version for v in coord.versions}
            spanned = {int(s[0]) for spans in desc.get("spans") or [] for s in spans}
            if spanned - listed:
                wrong.append(f"spans at versions {sorted(spanned - listed)} its coordinate does not list")
            for v in coord.versions:
                want = self.weights.content_digest(v.version)
                if v.digest and v.digest != want:  # (b"": a version the stamping replica never held)
                    wrong.append(f"v{v.version}'s digest {v.digest.hex()}, the trainer's is {want.hex()}")
            if payload.get("seed") is not None and coord.sampling.seed != payload["seed"]:
                wrong.append(f"seed {coord.sampling.seed}, the request's is {payload['seed']}")
            self.check("replayed", not wrong, key, f"served by {desc.get('worker_id')} (job {job_id}): "
                       + "; ".join(wrong), "1")  # fmt: skip

    def _check_forged_errors(self) -> None:
        """A key whose answer a forgery decided: the trainer was handed an error (the forged
        answer refused as outside its constraint, or as another request's) for a key no worker
        had answered, after the rogue stored a forged answer for it."""
        forged_at: dict[str, float] = {}
        for r in self.rogue:
            if r.get("ev") == "forge" and r.get("outcome") == "stored":
                forged_at.setdefault(r["key"], float(r["t"]))
        for c in self.calls:
            if c.error not in ("ContractViolation", "IdempotencyConflict") or c.key not in forged_at:
                continue
            if forged_at[c.key] > (c.answered_at or c.t0):
                continue
            honest = [
                p
                for p in self.published_by_key.get(c.key, [])
                if p.t <= (c.answered_at or c.t0) and not (p.desc or {}).get("forged_tokens")
            ]
            self.check(
                "forged",
                bool(honest),
                c.key,
                f"the rogue's forged answer decided this key: the trainer was answered {c.error} "
                f"({(c.answer or {}).get('message', '')[:100]!r}) before any worker answered",
                "3",
            )

    def _proc_ended_near(self, worker: str, t: float) -> Any:
        """A process that ended just before ``t`` (its result was stored as it died)."""
        for w in self.tl.workers:
            if w.worker_id == worker and w.start <= t and w.end is not None and t - 2.0 <= w.end:
                return w
        return None

    def _stored_failure(self, key: str, code: str | None, before: float) -> bool:
        return self._stored_failure_at(key, code, before) is not None

    def _stored_failure_at(self, key: str, code: str | None, before: float) -> float | None:
        """When the first failure answer with ``code`` was stored for ``key`` (by ``before``)."""
        return min(
            (
                p.t
                for p in self.published_by_key.get(key, [])
                if p.kind in ("failure", "chunked") and p.code == code and p.t <= before + 0.5
            ),
            default=None,
        )

    def _check_reused_key(self, key: str, c: Call, first: Call, ref: Call) -> None:
        """Another request under a key (``c``) that got a result: never the first request's
        result (the same job and tokens), and never a run of its own while the first request's
        job stood. A job id is the key's, so a run under a freed key carries the same job id
        with tokens of its own: it is legitimate where the first request's job was lost with
        the store before ``c`` was asked (campaign seed 2, broker-stores: a rollback took the
        first job, the other request ran, a wipe took its answer, and the first request asked
        again ran once more)."""
        a, b = ref.answer or {}, c.answer or {}
        if (a.get("job_id"), a.get("tokens")) == (b.get("job_id"), b.get("tokens")):
            handed = "a key reused for another request was answered with the first request's result"
            self.check("once", False, key, handed)
            return
        first_t = float(first.stored["t"]) if first.stored else first.t0
        if b.get("job_id") == a.get("job_id") and self.lost_with_store(first_t, "jobs", after=c.t0):
            self.unverified[f"once: a key reused after its first request's job was {LOST_WITH_STORE}"] += 1
            return
        self.check(
            "once",
            b.get("job_id") != a.get("job_id"),
            key,
            "a key reused for another request ran under the first request's job while it stood",
        )

    def _check_once(self) -> None:
        for key, calls in self.by_key.items():
            calls = sorted(calls, key=lambda c: c.t0)

            # The request that owns the key: the first one stored (a request refused at submit,
            # e.g. no compatible replica, never used it).
            # (A request refused at submit, e.g. no compatible replica, was journalled with no
            # stream sequence and no result: it never owned the key.)
            def owned(c: Call) -> bool:
                return c.stored is not None and (c.stored.get("stream_seq") is not None or c.is_result)

            first = (
                next((c for c in calls if owned(c) and c.op != "conflict"), None)
                or next((c for c in calls if owned(c)), None)
                or next((c for c in calls if c.stored is not None and c.op != "conflict"), None)
                or next((c for c in calls if c.stored is not None), calls[0])
            )
            ref = next((c for c in calls if c.is_result and c.req == first.req), None)
            ref_t = float(ref.stored["t"]) if ref and ref.stored else (ref.t0 if ref else first.t0)
            for c in calls:
                if c is ref or c.answer is None:
                    continue
                same = c.req == first.req
                if c.op == "conflict" or not same:
                    ref_seen = self._answer_seen_at((ref.answer or {}).get("job_id"), ref_t) if ref else 0.0
                    if c.is_result and ref is not None and self.lost_with_store(ref_seen, "results", after=c.t0):
                        # The first request's job and answer were lost with the store: the key is
                        # free again, and another request under it runs (under the key's job id).
                        self.unverified[f"once: a key reused after its answer was {LOST_WITH_STORE}"] += 1
                        continue
                    if c.is_result and ref is not None:
                        self._check_reused_key(key, c, first, ref)
                    else:
                        self.checks["once"] += 1
                    continue
                if c.error == "IdempotencyConflict":
                    if c.t0 > first.t0 + self.window - 1.0:
                        self.unverified["asked again after the duplicate window"] += 1
                        continue
                    changed = self.latest_at(c.t0) != self.latest_at(first.t0)
                    self.check(
                        "once",
                        False,
                        key,
                        f"the same request, asked again ({c.op}, trainer #{c.inc}), was refused as a conflict"
                        + (" after a commit moved latest" if changed else ""),
                        "9",
                    )
                    continue
                if c.t0 > ref_t + self.window - 1.0:
                    self.unverified["asked again after the duplicate window"] += 1
                    continue
                if ref is not None and (c.is_result or c.error):
                    # The first answer lost with the store (a rollback, a wipe) is not kept: the
                    # key's promise holds while the results stream keeps it. A result asked again
                    # may come from a second run; an at_most_once job's redelivery finds no answer
                    # and a holder gone, and is answered Interrupted (campaign 9, seed 90912).
                    ref_seen = self._answer_seen_at((ref.answer or {}).get("job_id"), ref_t)
                    if self.lost_with_store(ref_seen, "results", after=c.t0):
                        self.unverified[f"once: the first answer {LOST_WITH_STORE}"] += 1
                        continue
                if ref is not None and c.is_result:
                    a, b = ref.answer or {}, c.answer
                    same_answer = (a.get("job_id"), a.get("tokens")) == (b.get("job_id"), b.get("tokens"))
                    self.check(
                        "once",
                        same_answer,
                        key,
                        f"two answers: job {a.get('job_id')} from {a.get('worker_id')} and job "
                        f"{b.get('job_id')} from {b.get('worker_id')} ({c.op}, trainer #{c.inc})",
                    )
                elif ref is not None and c.error and c.t0 >= (ref.answered_at or ref.t0):
                    self.check(
                        "once",
                        c.error in (*CLIENT_ERRORS, "Expired"),
                        key,
                        f"answered {(ref.answer or {}).get('job_id')} first; the same request asked again "
                        f"({c.op}, trainer #{c.inc}): {c.error} ({(c.answer or {}).get('message', '')[:90]!r})",
                        "9" if c.error == "ContractViolation" else None,
                    )
                else:
                    self.checks["once"] += 1
            # The same answer on a re-ask: in the restarted trainer, and by a fresh client at the end.
            asked = [c.t0 for c in calls]
            late_resubmit = max(asked) - min(asked) > self.window - 1.0  # the key may hold a second job
            again = [r for r in self.reasks if r["key"] == key]
            final = self.finals.get(self.idem.get(key, key))
            if final is not None:
                again.append({**final, "final": True})
            for r in again:
                label = "a fresh client's result(key)" if r.get("final") else "the restarted trainer's result(key)"
                if ref is not None and ref.answer is not None:
                    if late_resubmit:
                        self.unverified["re-ask after a second job for the key (window passed)"] += 1
                        continue
                    ref_seen = self._answer_seen_at(ref.answer.get("job_id"), ref_t)
                    if self.lost_with_store(ref_seen, "results", after=float(r.get("t") or 0.0)):
                        self.unverified[f"re-ask: the answer {LOST_WITH_STORE}"] += 1
                        continue
                    ok = r.get("kind") == "result" and (r.get("job_id"), r.get("tokens")) == (
                        ref.answer.get("job_id"),
                        ref.answer.get("tokens"),
                    )
                    got = r.get("cls") or r.get("kind")
                    self.check(
                        "once",
                        ok,
                        key,
                        f"{label} returned {got} {r.get('job_id') or ''}, the trainer was "
                        f"answered job {ref.answer.get('job_id')}",
                    )
                elif (
                    first.error
                    and (
                        stored_at := self._stored_failure_at(
                            key, (first.answer or {}).get("code"), first.answered_at or 0.0
                        )
                    )
                    is not None
                ):
                    if self.lost_with_store(stored_at, "results", after=float(r.get("t") or 0.0)):
                        # (campaign seed 2718: an Interrupted answer stored before a wipe)
                        self.unverified[f"re-ask: the answer {LOST_WITH_STORE}"] += 1
                        continue
                    got = r.get("cls") or r.get("kind")
                    self.check(
                        "once",
                        r.get("cls") == first.error,
                        key,
                        f"{label} returned {got}, the trainer was answered {first.error}",
                    )

    def _check_lost_and_stranded(self) -> None:
        deleted = self.tl.consumers_deleted
        restarts = [t["start"] for t in self.tl.trainers[1:]]
        killed_at = {int(t["incarnation"]): float(t["end"]) for t in self.tl.trainers if t.get("how") == "killed"}
        for c in self.calls:
            if c.op == "reask-turn" or (c.stored is None and c.sid is None):
                continue
            expired = c.error == "Expired" and not self._stored_failure(c.key, "expired", c.answered_at or 0)
            cut = c.answer is None and c.hang is None and c.inc in killed_at
            if not (expired or cut or c.hang is not None or c.error == "ContractViolation"):
                continue
            deadline = c.deadline or c.t0
            if cut:  # the trainer died waiting: how long it had waited for nothing still counts
                self._stranded(c, min(deadline, killed_at[c.inc]), deleted, restarts)
                continue
            if any(o.is_result and o.t0 < c.t0 for o in self.by_key.get(c.key, [])):
                continue  # answered before: a re-ask that disagrees is the `once` check's
            # lost: a worker published the answer in time
            gave_up = min(deadline, (c.answered_at or deadline) + 0.5)
            if c.hang is not None:  # (a caller that stopped waiting hears nothing published after)
                gave_up = min(gave_up, float(c.hang["t"]))
            pub = [
                p
                for p in self.published_by_key.get(c.key, [])
                if p.t <= gave_up
                and p.t >= c.t0 - self.window
                and not ((p.desc or {}).get("forged_tokens"))
                and p.kind != "undecodable"
            ]
            forged_first = any(
                r.get("ev") == "forge" and r.get("key") == c.key and r.get("outcome") == "stored" for r in self.rogue
            )
            kept = [p for p in pub if not self.lost_with_store(p.t, "results", after=c.answered_at or deadline)]
            if pub and not kept:
                self.unverified[f"lost: the published answer {LOST_WITH_STORE}"] += 1
                continue
            # An answer on the wire that the results stream does not hold at the end, and that no
            # store loss took, was never stored: no stream leader took it (campaign seed 17,
            # --cluster: four publishes during a leader's death, none acknowledged, the worker
            # left the job to be redelivered as it should).
            # (By the message's digest: a failure stored later for the same job is another answer.
            # A turn's key in the stream names its incarnation.)
            full = self.idem.get(c.key, c.key)
            in_stream = {str(e.get("digest")) for k in {c.key, full} for e in self.stored.get(k, [])}
            taken = [p for p in kept if p.digest in in_stream or self._lost_during(p.t, p.t, "results")]
            if kept and not taken:
                self.unverified["lost: the published answer never stored (no acknowledgement)"] += 1
                continue
            pub = taken
            joined = self._joined_job_deadline(c)
            if pub and joined is not None and joined < deadline:
                # A turn asked again that joined its key's job stored earlier is due by that job's
                # deadline (the client follows the job, deadline included; its own timeout does not
                # extend it): an answer published after it is not one the contract promised the
                # re-ask (campaign seed 989501: held past it by a broker pause).
                pub = [p for p in pub if p.t <= joined]
                if not pub:
                    self.unverified[LOST_JOINED_LATE] += 1
                    continue
                deadline = joined
            if pub and c.op in ("resubmit", "resume") and c.error == "ContractViolation":
                p = pub[0]
                self.check(
                    "lost",
                    False,
                    c.key,
                    f"the same request asked again ({c.op}, trainer #{c.inc}) was refused ContractViolation "
                    f"although {p.worker} had answered it (job {p.job_id}): the stored answer was judged "
                    f"against the constraint resolved anew ({(c.answer or {}).get('message', '')[:90]!r})",
                    "9",
                )
                continue
            if pub:
                p = pub[0]
                what = f"{p.kind}{' (chunks add up)' if p.assembled else ''}"
                self.check(
                    "lost",
                    False,
                    c.key,
                    f"answered {c.error or 'nothing (hang)'} although {p.worker} published its answer "
                    f"({what}, job {p.job_id}) {deadline - p.t:.1f} s before the deadline",
                    "3" if forged_first else "2",
                )
                continue
            self.checks["lost"] += 1
            self._stranded(c, min(c.answered_at or deadline, deadline), deleted, restarts)

    def _joined_job_deadline(self, c: Call) -> float | None:
        """The deadline of the job a session turn found stored under its key when it was asked (a
        turn asked again after a trainer restart joins the job an earlier ask stored: within the
        duplicate window the client stores nothing new and follows that job, deadline included),
        from the job as the wiretap saw it (its deliveries; the latest deadline of its copies).
        None for a turn that stored its own job (a copy stamped at or after its ask), for a call
        with a stored record of its own (a submit's says its job's deadline), or with none seen."""
        if c.sid is None or c.stored is not None or c.attempts is not None:
            return None
        copies = [d for d in self.deliveries_by_key.get(c.key, []) if d.client_id == c.client and d.deadline]
        if not copies or any(float(d.submitted_at or c.t0) >= c.t0 for d in copies):
            return None
        return max(float(d.deadline) for d in copies)

    def _stranded(self, c: Call, end: float, deleted: list[tuple[float, str]], restarts: list[float]) -> None:
        """stranded: servable (broker up, a live replica with a free slot), held by nobody, unanswered."""
        if c.sid is not None:
            want = self._turn_constraint(c)
        else:
            want = self.resolved(c)
        if want is None:
            return
        kind, v = want
        seen = self.deliveries_by_key.get(c.key, [])
        jobs = {d.job_id for d in seen}
        seqs = {d.stream_seq for d in seen} | {(c.stored or {}).get("stream_seq")}
        held = self._held_intervals(jobs, {s for s in seqs if s})
        if sum(1 for j in jobs for _ in self.deliveries_by_job.get(str(j), [])) >= self.cfg.max_deliver:
            self.unverified["stranded: delivered max_deliver times"] += 1
            return
        stored_at = self._first_stored(c)
        if self.lost_with_store(stored_at, "jobs", after=end):
            # The job itself was lost (stored after the copy a rollback went back to, wiped, or its
            # stream deleted): nothing was left to take; it is answered Expired (`resolution`).
            self.unverified[f"stranded: the job {LOST_WITH_STORE}"] += 1
            return
        # Runs of time in which it waited, held by nobody, the broker up and a live replica able to
        # serve it; such a run counts when the fleet meanwhile was idle (a free slot) for half of
        # it, or served newer work (jobs submitted after it, delivered to replicas able to serve it).
        key = self.idem.get(c.key, c.key)
        newer = sorted(
            d.t
            for d in self.tap.deliveries
            if d.key != key
            and d.submitted_at > c.t0 + 0.5
            and c.t0 <= d.t <= end
            and d.worker
            and any(e[0] == d.worker and self.takes(e, kind, v, now=True) for e in self.snapshot(d.t))
        )
        best = best_at = 0.0
        run_start: float | None = None
        idle = frozen = 0.0
        t = c.t0
        while t <= end + SAMPLE_S:
            snap = self.snapshot(t) if t <= end else []
            able = [e for e in snap if self.takes(e, kind, v, now=True)]
            held_now = any(a <= t <= b for a, b in held)
            # A replica the adversary froze (SIGSTOP) keeps its registry entry but pulls nothing:
            # while the only able ones are frozen, the wait does not count against the fleet (nor
            # does it end the run: it goes on when one is back; seed 747108, job-1-64).
            awake = [e for e in able if not self._frozen(e[0], t, t)]
            ok = bool(awake) and not held_now
            if ok:
                if run_start is None:
                    run_start, idle, frozen = t, 0.0, 0.0
                idle += SAMPLE_S if any(e[4] for e in awake) else 0.0
            elif able and not held_now and run_start is not None:
                frozen += SAMPLE_S
            elif run_start is not None:
                length = t - run_start - frozen
                served = sum(1 for x in newer if run_start <= x <= t)
                if length >= STARVE_S and (idle >= STARVE_S / 2 or served >= 3) and length > best:
                    best, best_at = length, t
                run_start = None
            t += SAMPLE_S
        hint = None
        mine = (f"{kind}-{v}", "replica-")
        if any(c.t0 - 600 <= td <= best_at for td, name in deleted if name.startswith(mine)):
            hint = "11"
        elif c.sid is not None and any(c.t0 - 5 <= ts <= best_at for ts in restarts):
            hint = "4"
        cut = c.answer is None and c.hang is None
        outcome = c.error or ("nothing before the trainer was killed" if cut else "nothing")
        self.check(
            "stranded",
            best < STARVE_S,
            c.key,
            f"waited {best:.1f} s in a row (until {best_at - c.t0:.1f} s after submit), held by no worker, "
            f"while live replicas able to serve {kind}:{v} sat idle or served newer jobs; answered {outcome}",
            hint,
        )

    def _first_stored(self, c: Call) -> float:
        """When the job the call waited on was stored: a resubmit answered with the pending handle
        stores nothing, its job is the one stored (and delivered) at that sequence before (seed 3
        of a campaign: a resubmit after a wipe was taken for a job stored after the wipe)."""
        stored = c.stored or {}
        at = float(stored.get("t") or c.t0)
        job, seq = stored.get("job_id"), stored.get("stream_seq")
        if not job or not seq:
            return at
        delivered = [d.t for d in self.deliveries_by_job.get(str(job), []) if d.stream_seq == seq]
        asked = [
            float(o.stored["t"])
            for o in self.by_key.get(c.key, [])
            if o.stored and o.stored.get("job_id") == job and o.stored.get("stream_seq") == seq and o.stored.get("t")
        ]
        return min([at, *delivered, *asked])

    def _turn_constraint(self, c: Call) -> tuple[str, int] | None:
        """The strictest constraint the turn may have had (for liveness checks: the fewest
        replicas counted as able to serve it): its session's policy and floor, a max_staleness
        resolved against every commit made before it was sent."""
        opened = self.sessions.get(c.sid or "", {})
        if opened.get("policy") == "pinned":
            return ("exact", int(opened["pin"])) if "pin" in opened else None
        base = opened.get("constraint") or {}
        if "min_version" in base:
            floor = int(base["min_version"])
        else:
            floor = max(0, self.latest_may_be_at(c.t0) - int(base.get("max_staleness", 0)))
        if opened.get("policy") == "monotonic":
            before = [o for o in self.calls if o.sid == c.sid and o.t0 < c.t0 and o.answer]
            states = [((o.answer or {}).get("session") or {}).get("last_version") for o in before]
            states.append(((c.answer or {}).get("session") or {}).get("last_version"))
            floor = max([floor, *(int(v) for v in states if v is not None)])
        return "min", floor

    def _held_moments(self, c: Call, end: float) -> list[float]:
        """Moments, every ``SAMPLE_S``, at which a live holder held ``c``'s job before ``end``."""
        seen = self.deliveries_by_key.get(c.key, [])
        seqs = {d.stream_seq for d in seen} | {(c.stored or {}).get("stream_seq")}
        out: list[float] = []
        for a, b in self._held_intervals({d.job_id for d in seen}, {s for s in seqs if s}):
            t, stop = max(a, c.t0), min(b, end)
            while t <= stop:
                out.append(t)
                t += SAMPLE_S
        return out

    def _held_intervals(self, job_ids: set[Any], seqs: set[int]) -> list[tuple[float, float]]:
        out = []
        for seq in seqs:  # progress acks of a holder (its delivery may have gone unseen)
            for t, k in self.acks_by_seq.get(int(seq), []):
                out.append((t - self.ack_wait, t + (self.ack_wait if k == "+WPI" else 0.0)))
        for j in job_ids:
            for d in self.deliveries_by_job.get(str(j), []):
                end = float("inf")
                for t, k in self.tap.acks.get(d.ack, []):
                    if k in ("+ACK", "-NAK", "+TERM") and t >= d.t:
                        end = t
                        break
                proc = self.proc_at(d.worker, d.t) if d.worker else None
                if proc is not None:
                    gone = proc.paused_at if proc.paused_at is not None else proc.end
                    if gone is not None:
                        end = min(end, gone + self.ack_wait + 1.0)
                out.append((d.t, end))
        return out

    def _check_orphans(self) -> None:
        for c in self.calls:
            want = self.resolved(c) if c.sid is None else None
            if c.sid is not None:
                opened = self.sessions.get(c.sid, {})
                if opened.get("policy") == "pinned" and "pin" in opened and c.op == "turn":
                    want = ("exact", int(opened["pin"]))
            if want is None or want[0] != "exact" or c.op == "reask-turn":
                continue
            if c.answer is None and c.hang is None:
                continue  # cut short by the trainer's SIGKILL: no client was left to answer it
            v = want[1]
            deadline = c.deadline or c.t0
            end = c.answered_at or (float(c.hang["t"]) if c.hang else deadline)
            # A job its holder runs is not orphaned, whatever the holder's state: a draining
            # replica finishes what it holds (campaign seed 11: held for 23.9 s through a drain).
            mine = (c.stored or {}).get("job_id")
            seen = [d for d in self.deliveries_by_key.get(c.key, []) if mine is None or d.job_id == mine]
            seqs = {d.stream_seq for d in seen} | {(c.stored or {}).get("stream_seq")}
            held = self._held_intervals({d.job_id for d in seen}, {s for s in seqs if s})
            left: float | None = None
            t = c.t0
            while t <= min(end, deadline):
                if (
                    any(self.takes(e, "exact", v, promised=True) for e in self.snapshot(t))
                    or self.broker_down(t)
                    or any(a <= t <= b for a, b in held)
                ):
                    left = None
                elif left is None:
                    left = t
                t += SAMPLE_S
            self.checks["orphan"] += 1
            if left is not None and end - left > ORPHAN_S and left + ORPHAN_S < deadline - 1.0:
                self.violations.append(
                    Violation(
                        "orphan",
                        c.key,
                        f"exact v{v}: no live replica at v{v} from {left - c.t0:.1f} s after submit, but answered "
                        f"{c.error or ('a result' if c.is_result else 'nothing')} only {end - left:.1f} s later "
                        f"(deadline {deadline - left:.1f} s later)",
                        "8",
                    )
                )

    def _check_resumed(self) -> None:
        done: set[tuple[str, str]] = set()
        stopped_keys = self.stopped_keys
        for call, key, desc in self._accepted():
            req = call.req if call is not None else None  # (re-asks return what a call was handed)
            if not req or req.get("retry") != "resume" or (key, str(desc.get("job_id"))) in done:
                continue
            done.add((key, str(desc.get("job_id"))))
            worker, job_id = str(desc.get("worker_id")), str(desc.get("job_id"))
            max_tokens = int(req["payload"]["max_tokens"])
            seen = self.deliveries_by_job.get(job_id, [])
            delivered = {d.worker for d in seen}
            t0 = call.t0 if call is not None else min((d.t for d in seen), default=0.0)
            t_run = self.by_own_clock(worker, float(desc.get("finished_at") or t0), self._published_at(desc))
            unseen = self._unseen_delivery(job_id, t0, t_run, desc.get("attempt"))
            problems: list[str] = []  # one judged fact per result: the first thing wrong with it
            others = 0
            for i, spans in enumerate(desc.get("spans") or []):
                names = (desc.get("replicas") or [[]] * (i + 1))[i]
                length = (desc.get("lengths") or [0] * (i + 1))[i]
                finish = (desc.get("finishes") or [None] * (i + 1))[i]
                at = 0
                for _v, start, end in spans:
                    if not (start == at and end > start):
                        problems.append(f"job {job_id} sample {i}: spans {spans} do not tile its tokens")
                    at = end
                if at != length:
                    problems.append(f"job {job_id} sample {i}: spans end at {at}, {length} tokens")
                stopped = finish == "abort" and key in stopped_keys  # (ended early by its cancel)
                if not (length == max_tokens or finish == "stop" or stopped):
                    problems.append(f"job {job_id} sample {i}: {length} of {max_tokens} tokens, finish {finish}")
                # Another run had stored every token of this sample (its last checkpoint), then died
                # or was taken over before answering: the answering replica kept all of them (its
                # count covers every sample: with n > 1 it may have made another sample's tail).
                if names and names[-1] != worker and int(desc.get("kept") or 0) < length:
                    problems.append(
                        f"job {job_id} sample {i}: last span by {names[-1]}, answered by {worker}, "
                        f"which kept only {desc.get('kept')} tokens"
                    )
                for name, (_v, start, end) in zip(names, spans, strict=False):
                    if name != worker:
                        others += end - start
                    if name and name not in delivered:
                        # The same rule as `delivered`: a delivery the wiretap may have missed is
                        # unverified, never a violation.
                        if unseen is not None:
                            self.unverified[unseen] += 1
                        else:
                            problems.append(f"job {job_id}: tokens by {name}, which was never delivered the job")
            # kept tokens were made by earlier runs (the answering worker may have run it before too)
            kept = int(desc.get("kept") or 0)
            if kept < others:
                problems.append(f"job {job_id}: kept {kept} tokens, {others} made elsewhere")
            self.check("resumed", not problems, key, problems[0] if problems else "")
            # streamed (half of them): the chunks, put together, are the answer, each token once
            if "streamed" in desc or "stream_error" in desc:
                self.check(
                    "streamed",
                    desc.get("streamed") == desc.get("tokens") and not desc.get("stream_gaps"),
                    key,
                    f"job {job_id}: its stream ({desc.get('stream_error') or desc.get('stream_gaps')} "
                    "gaps) does not add up to its answer",
                )

    def _count_lost_between(self, t_run: float, t_seen: float) -> bool:
        """Whether the broker lost the jobs' delivery counts (went back to a copy of its store from
        before the run that finished at ``t_run``, or lost it whole) before the delivery seen at
        ``t_seen``: that one is counted again from where the copy left off, so it may carry the
        same number as the delivery the result ran on."""
        loss = self.lost_with_store(t_run, "jobs")
        return loss is not None and float(loss["at"]) <= t_seen

    def _every_copy_seen(self, job_id: str, ran_on: list[Any], seen: list[Any]) -> bool:
        """Whether ``ran_on`` (the deliveries with the result's attempt number) covers every stored
        copy of the job: each copy (a message of its own: stored again by a restarted trainer, or
        moved) counts its deliveries from 1, and the result does not say which copy it ran on."""
        copies = {d.stream_seq for d in seen} | {
            c.stored.get("stream_seq") for c in self.calls if c.stored and c.stored.get("job_id") == job_id
        }
        copies.discard(None)
        return {d.stream_seq for d in ran_on} >= copies

    def _unseen_delivery(self, job_id: str, t0: float, t1: float, attempt: Any = None) -> str | None:
        """Why the wiretap may have missed a delivery of ``job_id`` between t0 and t1 (None: it saw
        them all). ``delivered`` and ``resumed`` both count such a case as unverified."""
        seen = self.deliveries_by_job.get(job_id, [])
        if getattr(self.tap, "stored_jobs", {}).get(job_id, 1) > len({d.stream_seq for d in seen}):
            return f"{RESTORED}-stored copy not seen by the wiretap"
        consumers = {d.consumer for d in seen}
        if any(t0 <= t <= t1 and n in consumers for t, n in self.tl.consumers_deleted):
            return f"{RESTORED}-declared consumer not seen by the wiretap"
        if not tap_saw_every_copy(self.tap.gaps, t0, t1):
            return "delivery not seen by the wiretap (disconnected)"
        if self._lost_during(t0, t1, "jobs"):
            # (a broker restarted on an older store counts the job's deliveries from 1 again: the
            # attempts seen after it leave no hole where one before it was missed; seed 10)
            return f"delivery not seen by the wiretap ({LOST_WITH_STORE}: its deliveries counted again)"
        if not seen or any(d.worker is None for d in seen):
            return "delivery not seen by the wiretap"
        # Each stored copy of the job (a message of its own) counts its deliveries from 1: one
        # copy's attempts seen say nothing of another's.
        by_copy: dict[Any, set[int]] = defaultdict(set)
        for d in seen:
            if d.attempt is not None:
                by_copy[d.stream_seq].add(int(d.attempt))
        for attempts in by_copy.values():
            if set(range(1, max(attempts) + 1)) - attempts:
                return "delivery not seen by the wiretap"
        if attempt is not None and len(by_copy) == 1 and int(attempt) > max(next(iter(by_copy.values()))):
            return "delivery not seen by the wiretap"
        return None

    def _check_twice_and_moved(self) -> None:
        claim_key = None
        try:
            from rollfleet.schemas import names as _names

            claim_key = getattr(_names, "claim_key", None)
        except Exception:
            pass
        claims_by_key: dict[str, list[tuple[float, str, str, str | None]]] = defaultdict(list)
        for t, k, value, op, status in self.tap.claims:
            claims_by_key[k].append((t, value, op, status))
        for job_id, ds in self.deliveries_by_job.items():
            ds = sorted(ds, key=lambda d: d.t)
            retry = ds[0].retry
            key = ds[0].key
            # twice: stored claims by two worker processes, no hand-back (delete) between them
            if retry == "at_most_once":
                keys = {job_id} | ({claim_key(job_id)} if claim_key else set())
                # (holder, shown as, first stored, last stored): a holder is the process the claim
                # names (``<worker>:<pid>-<nonce>``), not whichever process of that worker id ran
                # when the write was seen.
                owners: list[list[Any]] = []
                spells: list[list[list[Any]]] = [owners]  # one per stretch between hand-backs
                for k in keys:
                    for t, value, op, status in sorted(claims_by_key.get(k, []), key=lambda c: c[0]):
                        if op.upper() in ("DEL", "PURGE"):
                            owners = []
                            spells.append(owners)
                            continue
                        if status != "stored":
                            if status is None:
                                self.unverified["claim: the broker's answer unseen"] += 1
                            continue
                        holder, _, refreshed = (value or "").rpartition("@")
                        if refreshed in ("0", "0.000"):  # marked stopped (its holder gone): nobody starts it
                            continue
                        # (a resumable job's claim is sealed, ``<holder>#<mac>``, and the MAC changes
                        # with every refresh: the holder is the part before it; campaign seed 778)
                        holder = holder.split("#", 1)[0]
                        worker = re.match(r"[A-Za-z0-9_-]+", holder or value or "")
                        wid = worker.group(0) if worker else value
                        proc = self.proc_at(wid, t) or self._proc_ended_near(wid, t)
                        shown = f"{wid} (process started {proc.start - self.t_first:.1f} s in)" if proc else wid
                        if not owners or owners[-1][0] != (holder or shown):
                            owners.append([holder or shown, shown, t, t])
                        owners[-1][3] = t
                # The stretch with the most holders is judged (a hand-back after a second holder
                # does not undo it). A hand-back (the claim deleted) the wiretap may have missed: it
                # was away between one holder's last write and the next holder's first.
                owners = max(spells, key=len)
                # A holder whose claim a store loss took before the next holder claimed (written
                # after the copy a rollback went back to, wiped, or its bucket deleted): the next
                # found none. The at_most_once promise ends there, for that holder only.
                kept = [
                    o
                    for o, nxt in zip(owners, [*owners[1:], None], strict=False)  # (owners may be empty)
                    if nxt is None or not self.lost_with_store(o[3], "claims", after=nxt[2])
                ]
                if len(kept) < len(owners):
                    self.unverified[f"twice: a holder's claim {LOST_WITH_STORE}"] += 1
                    owners = kept
                unseen = any(
                    a <= o2[2] and b >= o1[3] for o1, o2 in itertools.pairwise(owners) for a, b in self.tap.gaps
                )
                if len(owners) > 1 and unseen:
                    self.unverified["twice: the wiretap was away between two holders' claims"] += 1
                else:
                    self.check(
                        "twice",
                        len(owners) <= 1,
                        key,
                        f"at_most_once job {job_id} started by {len(owners)} worker processes "
                        f"({'; '.join(o[1] for o in owners)})",
                        "10",
                    )
                ran = {
                    (p.worker, round(float((p.desc or {}).get("finished_at", 0)), 2))
                    for p in self.published_by_key.get(key or "", [])
                    if p.job_id == job_id and p.desc and not p.desc.get("forged_tokens")
                }
                # A run whose answer, or whose claim, a store loss took before the next run ended
                # freed the key for that one: each such run is set aside, however many losses
                # came in turn (campaign broker-stores seed 3: the results stream deleted, then a
                # wipe; three runs, each after the last one's answer was lost).
                answers = {
                    (p.worker, round(float((p.desc or {}).get("finished_at", 0)), 2)): p.t
                    for p in self.published_by_key.get(key or "", [])
                    if p.job_id == job_id and p.desc
                }
                claimed = sorted(t for k in keys for t, _, op, st in claims_by_key.get(k, []) if st == "stored")
                runs = sorted(ran, key=lambda r: r[1])
                freed = [
                    run
                    for run, nxt in itertools.pairwise(runs)
                    if self.lost_with_store(answers.get(run, run[1]), "results", after=nxt[1])
                    or any(self.lost_with_store(t, "claims", after=nxt[1]) for t in claimed if t <= run[1] + 0.5)
                ]
                if freed:
                    self.unverified[f"twice: an earlier run's claim or answer {LOST_WITH_STORE}"] += len(freed)
                    ran = ran - set(freed)
                self.check(
                    "twice",
                    len(ran) <= 1,
                    key,
                    f"at_most_once job {job_id} generated {len(ran)} times ({sorted(w or '?' for w, _ in ran)})",
                    "10",
                )
            # moved: a second worker got it while the first held it, alive and acking
            for d1, d2 in itertools.pairwise(ds):
                if d1.worker is None or d2.worker is None or d1.worker == d2.worker:
                    continue
                holder = self.proc_at(d1.worker, d1.t)
                if holder is None or self._disturbed(d1.t, d2.t, d1.consumer):
                    continue
                self.checks["moved"] += 1  # (counted once judged, not before the skip above)
                acks = self.tap.acks.get(d1.ack, [])
                if d2.stream_seq != d1.stream_seq and abs((d2.submitted_at or 0.0) - (d1.submitted_at or 0.0)) > 1e-6:
                    # Not a move (a move stores the same bytes): the key submitted again, a new job
                    # under the same id, after the duplicate window (a restarted trainer asking its
                    # fixed key again while the first job still ran, campaign 9 seed 64). Whether
                    # the key was answered once is ``once``'s to judge.
                    self.unverified["moved: the key submitted again, not moved"] += 1
                    continue
                if d2.stream_seq != d1.stream_seq:
                    # The job was stored again (a client moved it) while the first replica had it:
                    # a double run if that replica finished it.
                    finished = [
                        p
                        for p in self.published_by_key.get(key or "", [])
                        if p.job_id == job_id
                        and p.worker == d1.worker
                        and p.t >= d1.t
                        and p.desc
                        and not p.desc.get("forged_tokens")
                        and self.proc_at(d1.worker, p.t) is holder
                    ]
                    handed_back = any(k in ("-NAK", "+TERM") and d1.t <= t <= d2.t + 0.5 for t, k in acks)
                    # The copy's taker ran it too, unless it handed it back at once (it found the
                    # job claimed by the first holder, alive) or acked it as answered, and never answered it.
                    second = self.tap.acks.get(d2.ack, [])
                    first_word = min(second, default=None)
                    # (an +ACK with no answer: it found the first holder's answer stored and ran nothing)
                    declined = first_word is not None and first_word[1] in ("-NAK", "+TERM", "+ACK")
                    answered_by_second = any(
                        p.job_id == job_id and p.worker == d2.worker for p in self.published_by_key.get(key or "", [])
                    )
                    if finished and self.lost_with_store(finished[0].t, "results", after=d2.t):
                        # The first run's answer was lost with the store before the job was stored
                        # again (a key resubmitted or reused then): not a move, a run of a key the
                        # broker no longer knew was answered.
                        self.unverified[f"moved: the first run's answer {LOST_WITH_STORE}"] += 1
                        continue
                    # A taker that said nothing on its copy (a running job's holder acks progress),
                    # claimed nothing (a job is claimed before it runs) and answered nothing never
                    # ran it: it died, or was held at a fault point, or stuck before it could
                    # (campaign seeds 11 and 64: copies delivered to replicas held at fault points).
                    claimed_by_second = any(
                        st == "stored"
                        and op.upper() == "PUT"
                        and (value or "").startswith(f"{d2.worker}:")
                        and t >= d2.t
                        for k in ({job_id} | ({claim_key(job_id)} if claim_key else set()))
                        for t, value, op, st in claims_by_key.get(k, [])
                    )
                    if finished and self._lost_during(d2.t, finished[0].t, "claims"):
                        # The broker went back to an older store (or lost it) while the copy ran:
                        # the copy's claim and answer may be gone with it, and the job delivered
                        # again; the first holder running it then is the broker's redelivery, not
                        # a move (campaign 9, seed 389: a rollback took the second taker's claim
                        # and answer, and the first holder ran the job once more).
                        self.unverified[f"moved: the copy's claim or answer {LOST_WITH_STORE}"] += 1
                        continue
                    if finished and not second and not answered_by_second and not claimed_by_second:
                        self.unverified["moved: the copy's taker said, claimed and answered nothing"] += 1
                        continue
                    # A taker refused its claim (the first holder's stood), that only acked progress
                    # while it watched that claim and whose process then ended, claimed and answered
                    # nothing: what it did with the copy is unseen, and a job is claimed before it
                    # runs (seed 101: the copy's taker SIGKILLed 0.9 s after it was refused, while
                    # the first holder, frozen, held the claim).
                    taker = self.proc_at(d2.worker, d2.t)
                    refused = any(
                        st == "refused" and (value or "").startswith(f"{d2.worker}:") and t >= d2.t
                        for k in ({job_id} | ({claim_key(job_id)} if claim_key else set()))
                        for t, value, op, st in claims_by_key.get(k, [])
                    )
                    if (
                        finished
                        and refused
                        and not claimed_by_second
                        and not answered_by_second
                        and all(k == "+WPI" for _, k in second)
                        and taker is not None
                        and taker.end is not None
                    ):
                        self.unverified["moved: the copy's taker, refused its claim, ended holding it"] += 1
                        continue
                    # A taker whose claim was stored only after the first run's answer was, and that
                    # acked its copy answering nothing, found that answer once it held the claim: a
                    # run ends in an answer published (or a claim lost, which nobody took here). The
                    # look it made is the worker's own rule, not a fact on the wire: unverified, not a
                    # pass (campaign 1, seed 24769: a turn moved off a replica whose link to the broker
                    # stalled upward; the copy's taker watched the stale claim, the holder's writes
                    # landed when the link healed, it answered and released, and the taker's claim
                    # came 1.77 s after that answer, then +ACK).
                    if (
                        finished
                        and claimed_by_second
                        and not answered_by_second
                        and any(k == "+ACK" for _, k in second)
                        and self._claimed_only_after(job_id, d2, finished[0], claims_by_key, claim_key)
                    ):
                        self.unverified[f"moved: {CLAIMED_AFTER_THE_ANSWER}"] += 1
                        continue
                    # A taker that acked progress first (it holds the copy while it asks whether the
                    # first holder lives), then handed it back, having claimed and answered nothing,
                    # ran nothing either: a job of this kind is claimed before it runs (campaign 8,
                    # seed 4096: +WPI, then -NAK 0.67 s later, "job held by a live replica").
                    declined = declined or (
                        not claimed_by_second
                        and not answered_by_second
                        and any(k in ("-NAK", "+TERM", "+ACK") for _, k in second)
                    )
                    if finished and not handed_back and (answered_by_second or not declined):
                        # (How its process ended, and when: a process SIGTERMed long after it answered
                        # was not draining when it ran the job.)
                        state = "alive" + (
                            f" (its process ended {holder.end - finished[0].t:.1f} s after it answered, {holder.how})"
                            if holder.end is not None and holder.how
                            else ""
                        )
                        self.violations.append(
                            Violation(
                                "moved",
                                key,
                                f"job {job_id} was stored again and run on {d2.worker} while {d1.worker}, "
                                f"{state}, ran it too (finished {finished[0].t - d1.t:.2f} s after it took it, "
                                f"{finished[0].t - d2.t:+.2f} s from the second delivery): generated twice",
                                "5",
                            )
                        )
                    continue
                # The same message delivered again: the broker's redelivery (an ack-wait that ran out),
                # not the product's doing; counted when its holder was still acking progress.
                released = any(k in ("+ACK", "-NAK", "+TERM") and d1.t <= t <= d2.t + 0.5 for t, k in acks)
                life = [t for t, k in acks if t < d2.t - 0.05] + [d1.t]
                if not released and self.proc_at(d1.worker, d2.t) is holder and d2.t - max(life) < self.ack_wait - 0.3:
                    self.unverified["redelivered by the broker while its holder acked progress"] += 1
        # Interrupted although the holder finished it, alive (draining, not killed).
        for c in self.calls:
            if c.error != "Interrupted":
                continue
            # The answers of this job, made while it was waiting (a later job under the same key,
            # after the duplicate window, is another job: matching by key alone was a false positive).
            job, ta = (c.stored or {}).get("job_id"), c.answered_at or c.t0
            finished = [
                p
                for p in self.published_by_key.get(c.key, [])
                if p.desc
                and not p.desc.get("forged_tokens")
                and (job is None or p.job_id == job)
                and c.t0 <= p.t <= ta + self.window
                and (self._drained(str(p.worker), p.t) or self._frozen(str(p.worker), c.t0, p.t))
            ]
            how = "while draining (SIGTERM)"
            if finished and not self._drained(str(finished[0].worker), finished[0].t):
                how = "after a pause (SIGSTOP of it or of the broker)"
            self.check(
                "twice",
                not finished,
                c.key,
                f"answered Interrupted although {finished[0].worker if finished else '?'} finished it {how}, alive",
                "5",
            )

    def _frozen(self, worker: str, t0: float, t1: float) -> bool:
        """Whether ``worker``'s process alive at ``t1``, or the broker, was frozen (SIGSTOP) between
        t0 and t1: a frozen holder is alive, and goes on where it stopped."""
        proc = self.proc_at(worker, t1)
        stops = list(getattr(proc, "stops", None) or []) + list(getattr(self.tl, "broker_paused", []))
        return proc is not None and any(a <= t1 and b >= t0 for a, b in stops)

    def _claimed_only_after(
        self, job_id: str, d2: Any, answer: Any, claims_by_key: dict[str, list[Any]], claim_key: Any
    ) -> bool:
        """Whether every claim the taker of ``d2`` (a moved copy) stored came after ``answer`` (the
        first run's, seen on the wire) was stored: the results stream holds that answer (by its
        digest), and the taker's first stored claim after its delivery was heard more than
        ``LOSS_MARGIN_S`` after the answer was."""
        keys = {job_id} | ({claim_key(job_id)} if claim_key else set())
        mine = [
            t
            for k in keys
            for t, value, op, st in claims_by_key.get(k, [])
            if st == "stored" and op.upper() == "PUT" and (value or "").startswith(f"{d2.worker}:") and t >= d2.t
        ]
        key = answer.key or ""
        in_stream = {str(e.get("digest")) for k in {key, self.idem.get(key, key)} for e in self.stored.get(k, [])}
        return bool(mine) and answer.digest in in_stream and min(mine) > answer.t + LOSS_MARGIN_S

    def _drained(self, worker: str, t: float) -> bool:
        """Whether ``worker``'s process at ``t`` was one that was later stopped gracefully."""
        proc = self.proc_at(worker, t) or self._proc_ended_near(worker, t)
        return proc is not None and proc.how.startswith("terminated")

    def _disturbed(self, t0: float, t1: float, consumer: str | None = None) -> bool:
        """A broker outage, or (``consumer``) that consumer's deletion, between t0 and t1: the
        broker itself may then redeliver what a live worker holds."""
        if any(a <= t1 and b >= t0 for a, b in self.broker_out):
            return True
        return consumer is not None and any(t0 <= t <= t1 and n == consumer for t, n in self.tl.consumers_deleted)

    def _check_rogue(self) -> None:
        snooped = [r for r in self.rogue if r.get("ev") == "snooped"]
        self.checks["rogue"] += 1  # one fact: the rogue read nobody's delivery (not one per delivery)
        if snooped:
            ex = snooped[0]
            self.violations.append(
                Violation(
                    "rogue",
                    ex.get("key"),
                    f"the rogue worker read {len(snooped)} job deliveries meant for other workers "
                    f"(job id, fingerprint and ack subject included; e.g. on {ex.get('inbox')})",
                    "3",
                )
            )
        stored = [r for r in self.rogue if r.get("ev") == "forge" and r.get("outcome") == "stored"]
        self.notes["rogue_forgeries_stored"] = len(stored)
        self.notes["rogue_refusals"] = sum(1 for r in self.rogue if r.get("ev") == "refused")

    def _check_second_clients(self) -> None:
        for r in self.tl.second_clients:
            t = float(r.get("t") or 0.0)
            out = any(a - 1.0 <= t <= b + BROKER_GRACE_S for a, b in self.broker_out)
            if r.get("cls") == "ServiceUnavailable" and out:
                # The broker (a cluster's node) was out: "try again" is the truthful answer, and no
                # second client was let in (campaign seed 313, ``--cluster``, a node cut off).
                self.unverified["second-client: the broker was out"] += 1
                continue
            self.check(
                "second-client",
                r.get("cls") == "ClientIdInUse" or not r.get("trainer_alive", True) or not self._both_held(r),
                TRAINER,
                f"a second client with the trainer's id got {r.get('cls') or r.get('kind')} "
                f"({r.get('message', '')[:120]})",
            )

    def _both_held(self, second: dict[str, Any]) -> bool:
        """Whether a second client that connected held the trainer's id while a trainer
        incarnation held it too: an incarnation that said it connected (its journal's
        ``connected``, written once its lease is taken) before the second client closed, and
        ended after the second client connected. A trainer starting at the same moment that was
        refused (``ClientIdInUse``) never says it connected: one of the two holding the id is the
        promise (campaign seed 7). A record without the times (an older run) is judged as held."""
        if "t_connected" not in second:
            return True
        start, end = float(second["t_connected"]), float(second.get("t_closed") or second["t_connected"])
        ends = {int(tr["incarnation"]): float(tr.get("end") or float("inf")) for tr in self.tl.trainers}
        return any(
            rec.get("ev") == "connected" and float(rec["t"]) <= end and ends.get(int(rec.get("inc", 0)), 0.0) >= start
            for rec in self.trainer
        )

    def _check_reask_turns(self) -> None:
        firsts: dict[tuple[str, int], Call] = {}
        for c in sorted(self.calls, key=lambda c: c.t0):
            # A turn refused SessionConflict stored no job (its index was taken by another request,
            # out of order, or still running): that refusal is not the turn's answer, the answer
            # of the job stored under the turn's key is (seed 747109: a restarted trainer asked an
            # index again with another prompt, then by index; the re-ask returned the first job's
            # Expired, judged against the refusal).
            if c.op == "turn" and c.sid is not None and c.turn is not None and (c.answer or {}).get("spent") \
                    and c.error != "SessionConflict":
                firsts.setdefault((c.sid, c.turn), c)
        for c in self.calls:
            if c.op != "reask-turn" or c.sid is None or c.turn is None:
                continue
            if c.answer is None and c.hang is None:
                self.unverified["cut short by the trainer's SIGKILL"] += 1
                continue
            first = firsts.get((c.sid, c.turn))
            if first is not None and first.answer is not None:
                answered = first.answered_at or first.t0
                if first.error:
                    stored_at = self._stored_failure_at(first.key, first.answer.get("code"), answered)
                else:
                    stored_at = self._answer_seen_at(first.answer.get("job_id"), answered)
                if stored_at is not None and self.lost_with_store(stored_at, "results", after=c.t0):
                    # The turn's answer was stored after the copy a rollback went back to (or
                    # wiped): it is not there to return. Its job, back in the stream, runs again
                    # (or, at_most_once, is answered Interrupted), or waits for a replica at its
                    # version (campaign 14, seed 167: the session's record lost the turn too).
                    self.unverified[f"reask-turn: the answer {LOST_WITH_STORE}"] += 1
                    continue
            if c.hang is not None or (c.answer or {}).get("untyped"):
                got = "still waiting" if c.hang else f"raised {c.answer.get('cls')}"
                had = (first.error or "a result") if first else "?"
                waited = (c.hang or c.answer or {}).get("t", c.t0) - c.t0
                self.check(
                    "reask-turn",
                    False,
                    c.key,
                    f"asking turn {c.turn} again (it had been answered {had}) {got} after {waited:.1f} s",
                    "6",
                )
                continue
            if first is None or first.answer is None:
                self._check_reask_of_unanswered(c)
                continue
            opened = min((o.t0 for o in self.calls if o.sid == c.sid), default=first.t0)
            if c.error == "UnknownSession" and self.lost_with_store(opened, "sessions", after=c.t0):
                # The session's record was written after the copy a rollback went back to, or
                # wiped: the broker no longer knows the session, and says so at once (typed).
                self.unverified[f"reask-turn: the session's record {LOST_WITH_STORE}"] += 1
                continue
            if first.error:
                self.check(
                    "reask-turn",
                    c.error == first.error,
                    c.key,
                    f"turn {c.turn} failed {first.error}, asked again: {c.error or 'a result'}",
                    "6",
                )
            else:
                self.check(
                    "reask-turn",
                    (c.answer or {}).get("job_id") == first.answer.get("job_id"),
                    c.key,
                    f"turn {c.turn} asked again returned {c.error or (c.answer or {}).get('job_id')}",
                )
        # pinned sessions the fleet has left
        for c in self.calls:
            if c.sid is None or c.error != "NoCompatibleReplica" or c.op != "turn":
                continue
            opened = self.sessions.get(c.sid, {})
            if opened.get("policy") != "pinned" or "pin" not in opened:
                continue
            if not refused_at_a_pin(c.answer):
                self.checks["pinned-error"] += 1
                continue
            pin, ta = int(opened["pin"]), float(c.answer["t"])  # type: ignore[index]
            recent = [self.snapshot(ta - k * SAMPLE_S) for k in range(int(5.0 / SAMPLE_S))]
            nobody = all(not any(self.takes(e, "exact", pin) for e in snap) for snap in recent)
            moved_on = all(any(e[1] in SERVING_STATES for e in snap) for snap in recent)  # a fleet, elsewhere
            if not nobody or not moved_on or self.latest_at(ta) <= pin:
                self.checks["pinned-error"] += 1
                continue
            down_at_pin = any(e[2] == pin and e[1] == "down" for snap in recent for e in snap)
            if down_at_pin or any(
                v == pin for k in range(int(5.0 / SAMPLE_S)) for _, v in self._engine_out_at(ta - k * SAMPLE_S)
            ):
                # A replica at the pin whose engine server is down may serve it again once it is
                # back: "retry" is no lie, and "hopeless" would be a guess.
                self.unverified["pinned-error: a replica at the pin has its engine server down"] += 1
                continue
            msg = str(c.answer.get("message", ""))
            names_pin = re.search(rf"(?<![0-9]){pin}(?![0-9])", msg) is not None and "pin" in msg.lower()
            self.check(
                "pinned-error",
                names_pin and c.answer.get("retryable") is False,
                c.key,
                f"pinned to v{pin}, which no replica serves: refused retryable={c.answer.get('retryable')} with "
                f"{msg[:140]!r}",
                "7",
            )

    def _check_reask_of_unanswered(self, c: Call) -> None:
        """A turn asked again whose first asking journaled no answer (cut short by the trainer's
        SIGKILL, or refused while another request held its index): the re-ask must return an
        answer the wiretap saw stored under the turn's key."""
        assert c.answer is not None
        key = self.idem.get(c.key, c.key)
        stored = [p for k in {c.key, key} for p in self.published_by_key.get(k, [])]
        if c.is_result:
            job_ids = {p.job_id for p in stored if p.kind in ("result", "chunked")}
            if c.answer.get("job_id") not in job_ids and not tap_saw_every_copy(
                self.tap.gaps, c.t0 - self.window, float(c.answer.get("t", c.t0))
            ):
                self.unverified["reask-turn: the wiretap was away when its answer may have been stored"] += 1
                return
            self.check(
                "reask-turn",
                c.answer.get("job_id") in job_ids,
                c.key,
                f"turn {c.turn} asked again returned job {c.answer.get('job_id')}, which no answer stored under "
                f"its key names ({sorted(str(j) for j in job_ids)})",
            )
        elif any(p.kind in ("failure", "chunked") and p.code == c.answer.get("code") for p in stored):
            self.checks["reask-turn"] += 1
        else:
            # (An Expired may be the re-ask's own wait running out while the job still waited.)
            self.unverified["reask-turn: the turn's first asking has no answer, and none stored matches"] += 1

    def _check_answered(self) -> None:
        """answered: a worker's error reached the trainer only as a worker published it."""
        for c in self.calls:
            if c.error not in WORKER_ERRORS or c.answer is None:
                continue
            code, ta = c.answer.get("code"), float(c.answer["t"])
            # Any job under the key since it was first asked: a resubmit is answered with the stored
            # answer of the key's first job, whatever job id its own submit recorded.
            since = min([o.t0 for o in self.by_key.get(c.key, [])] + [c.t0]) - 1.0
            key = self.idem.get(c.key, c.key)
            mine = self.published_by_key.get(c.key, []) + self.published_by_key.get(key, [])
            if c.sid is not None:  # a turn's failure is published under the product's own key, "<sid>/.../<turn>"
                mine += [
                    p
                    for p in self.tap.published
                    if p.key and p.key.startswith(f"{c.sid}/") and p.key.rsplit("/", 1)[1] == str(c.turn)
                ]
            pubs = [p for p in mine if p.code == code and since <= p.t <= ta + 0.5]
            retry = (c.req or {}).get("retry")
            if c.error == "Interrupted" and c.sid is None and retry not in (None, "at_most_once"):
                self.check(
                    "answered",
                    False,
                    c.key,
                    f"a {retry} job answered Interrupted (only at_most_once jobs and turns are)",
                )
            elif pubs:
                self.checks["answered"] += 1
            elif any(a <= ta and b >= c.t0 for a, b in self.tap.gaps):
                self.unverified["answered: the wiretap was disconnected while the job ran"] += 1
            else:
                self.check(
                    "answered",
                    False,
                    c.key,
                    f"answered {c.error} ({c.answer.get('message', '')[:80]!r}), "
                    f"but no worker published a {code} failure for it",
                )

    @property
    def stopped_keys(self) -> set[str]:
        """Keys of calls whose cancel() said it stopped them where they ran."""
        return {c.key for c in self.calls if c.cancel and c.cancel.get("outcome") == "stopped"}

    def _check_cancelled(self) -> None:
        """cancelled: what ``cancel()`` said it did is what happened. "withdrawn": no worker answered
        the key before it was asked again, and the trainer was handed ``Cancelled``; "stopped": the
        answer is ``Cancelled`` or a result with a sample ended early ("abort"); "answered": a
        whole result or another error; never raised."""
        for c in self.calls:
            if c.cancel is None:
                continue
            said, got = c.cancel.get("outcome"), c.answer or {}
            finishes = got.get("finish") or []
            if said == "raised":
                self.check(
                    "cancelled",
                    False,
                    c.key,
                    f"cancel() raised {c.cancel.get('cls')}: {c.cancel.get('message', '')[:90]!r}",
                )
            elif said == "unknown":
                self.unverified["cancelled: no answer within the cancel's wait"] += 1
            elif said == "withdrawn":
                later = [o.t0 for o in self.by_key.get(c.key, []) if o.t0 > c.t0]
                until = min(later, default=float("inf"))
                pubs = [
                    p
                    for p in self.published_by_key.get(c.key, [])
                    if c.t0 <= p.t < until and not (p.desc or {}).get("forged_tokens")
                ]
                asked = float(c.cancel.get("t_asked") or c.cancel.get("t") or c.t0)
                if pubs and self.lost_with_store(asked, "jobs", after=pubs[0].t):
                    # The withdrawal (a deletion from the jobs stream) was lost with the broker's
                    # store: it restarted on a copy from before it, where the job still lay, and a
                    # replica ran it (campaign seed 1905: withdrawn 0.66 s after the copy was taken).
                    self.unverified[f"cancelled: the withdrawal {LOST_WITH_STORE}"] += 1
                    continue
                self.check(
                    "cancelled",
                    c.error == "Cancelled" and not pubs,
                    c.key,
                    f"cancel() said withdrawn, but the trainer was handed {c.error or got.get('kind')}"
                    + (f" and {pubs[0].worker} answered the job" if pubs else ""),
                )
            elif said == "stopped":
                ok = c.error == "Cancelled" or (c.is_result and "abort" in finishes)
                self.check(
                    "cancelled",
                    ok,
                    c.key,
                    f"cancel() said stopped, but the answer was {c.error or 'a result'} (finish {finishes})",
                )
            elif said == "answered":
                ok = (c.is_result and "abort" not in finishes) or (c.error not in (None, "Cancelled"))
                self.check(
                    "cancelled",
                    ok,
                    c.key,
                    f"cancel() said answered, but the answer was {c.error or 'a result'} (finish {finishes})",
                )
            else:
                self.check("cancelled", False, c.key, f"cancel() returned {said!r}")

    def _check_available(self) -> None:
        """available: some of what the trainer asked was served, and service never stopped long."""
        calls = [c for c in self.calls if c.op != "reask-turn"]
        served = [c for c in calls if c.is_result]
        if not self.check("available", bool(calls), None, "the trainer made no calls: nothing was judged"):
            return
        self.check(
            "available",
            bool(served),
            None,
            f"none of the trainer's {len(calls)} calls was served (answers: {self._errors_by_class()})",
        )
        excluded = [(a, b + BROKER_GRACE_S) for a, b in self.broker_out]
        killed_at = {int(t["incarnation"]): float(t["end"]) for t in self.tl.trainers if t.get("how") == "killed"}
        wanted = []
        moments: list[float] = []
        for c in calls:
            end = c.answered_at or (float(c.hang["t"]) if c.hang else killed_at.get(c.inc, c.deadline or c.t0))
            # A call answered with a result was served from the moment the run that made it
            # started (a long generation is service, not a wait): it asked until then.
            desc = c.answer if c.is_result and c.answer else {}
            if desc.get("finished_at") and desc.get("generation_s") is not None:
                began = self.by_own_clock(
                    str(desc.get("worker_id")), float(desc["finished_at"]) - float(desc["generation_s"])
                )
                if began <= end:  # (begun before the call: a resubmit of a job already running)
                    end = max(c.t0, began)
                    moments.append(end)
            elif c.stored is not None and (loss := self.lost_with_store(self._first_stored(c), "jobs", after=end)):
                # Its job was lost with the broker's store: from then on it waits on nothing, and
                # is answered Expired by its deadline by design (campaign seed 2718).
                end = min(end, float(loss["at"]))
            if not c.is_result:
                # A live holder running it is service too, even if the run never finished (campaign
                # seed 313: a 7,860-token job run for 11 s by a replica SIGTERMed, then killed).
                moments += self._held_moments(c, end)
            wanted.append((c.t0, max(c.t0, end)))
        moments += [float(c.answer["t"]) for c in served if c.answer]
        moments += [
            p.t
            for p in self.tap.published
            if (p.desc or {}).get("kind") == "result" and not (p.desc or {}).get("forged_tokens")
        ]
        worst = max(unserved_stretches(wanted, moments, excluded), key=lambda s: s[2], default=(0.0, 0.0, 0.0))
        self.notes["longest_unserved_s"] = round(worst[2], 2)
        self.check(
            "available",
            worst[2] <= self.available_s,
            None,
            f"nothing was served for {worst[2]:.1f} s while the trainer asked ({worst[0] - self.t_first:.1f} s "
            f"to {worst[1] - self.t_first:.1f} s into the run; broker outages not counted)",
        )
        # The fleet itself: a live process in a serving state, at every moment of the run.
        up = [
            self.t_first + i * SAMPLE_S
            for i, snap in enumerate(self.samples)
            if any(e[1] in SERVING_STATES for e in snap)
        ]
        run = [(min(c.t0 for c in calls), max(b for _, b in wanted))]
        down = max(unserved_stretches(run, up, excluded), key=lambda s: s[2], default=(0.0, 0.0, 0.0))
        self.notes["longest_fleet_down_s"] = round(down[2], 2)
        self.check(
            "available",
            down[2] <= self.available_s,
            None,
            f"no live replica served for {down[2]:.1f} s ({down[0] - self.t_first:.1f} s to "
            f"{down[1] - self.t_first:.1f} s into the run; broker outages not counted)",
        )

    def _check_engines_back(self) -> None:
        """available, per engine event: a replica whose engine server is back (restarted, thawed,
        taking pauses again) serves again within the bound (``reliability.adversary.engines.serves_again``):
        a restarted server taken back as the wrong version, or a request gate left closed after a
        refused pause, would leave it registered and serving nothing, or down for good."""
        from reliability.adversary.engines import back_moments, serves_again

        bound = self.available_s
        for worker, lives in sorted(self.engine_lives.items()):
            moments = back_moments(lives)
            serving_at = [
                self.t_first + i * SAMPLE_S
                for i, snap in enumerate(self.samples)
                if any(e[0] == worker and e[1] in SERVING_STATES for e in snap)
            ]
            delivered = sorted(d.t for d in self.tap.deliveries if d.worker == worker)
            results = sorted(p.t for p in self.tap.published if p.worker == worker and p.kind in ("result", "chunked"))
            for k, (back, what) in enumerate(moments):
                proc = self.proc_at(worker, back)
                nxt = moments[k + 1][0] if k + 1 < len(moments) else float("inf")
                if not self._engine_quiet(worker, lives, proc, back, nxt, back + bound):
                    self.unverified["available: an engine server back too late in the run, or disturbed again"] += 1
                    continue
                # Jobs delivered after it was back are judged only where a bound after the first
                # one is quiet too; else the registry alone says whether it serves again.
                first = next((t for t in delivered if t >= back), None)
                quiet = first is not None and self._engine_quiet(worker, lives, proc, back, nxt, first + bound)
                judged = delivered if quiet else []
                ok, why = serves_again(back, bound, serving_at, judged, results)
                self.check(
                    "available",
                    ok,
                    None,
                    f"{worker}'s engine server {what} {back - self.t_first:.1f} s into the run, but {worker} did "
                    f"not serve again: {why}",
                )

    def _engine_quiet(self, worker: str, lives: list[Any], proc: Any, back: float, nxt: float, until: float) -> bool:
        """Nothing else happened to the replica (``proc``, its process at ``back``), its engine server
        or the broker from ``back`` until ``until`` (``nxt``: its server's next moment back)."""
        return not (
            proc is None
            or self.proc_at(worker, until) is not proc
            or nxt <= until
            or any(es.end is not None and back < es.end <= until for es in lives)
            or any(a <= until and b >= back for a, b in self.broker_out)
            or any(a <= until and b >= back for a, b in proc.stops)
        )

    def _check_disks(self) -> None:
        """converged, per disk fault: a replica whose own disk was full or read-only for a while
        reaches, once it is back, the version latest then within the bound (``reliability.adversary.disks``)."""
        from reliability.adversary.disks import judge_disks

        judge_disks(self)

    def _check_converged(self) -> None:
        """converged (``--store s3``): once the object store is whole again (no proxy fault, no
        version hidden or corrupt) for ``CONVERGE_S``, every replica process alive, unfrozen and
        heard throughout has reached the version latest when it healed. A truncated download kept
        in a cache, a failure never retried, a prepare stuck on a dead connection: each leaves a
        live replica behind for good, which the calls alone may not show (the others serve)."""
        if getattr(self.cfg, "store", "dir") != "s3":
            return
        from reliability.adversary.objstore import CONVERGE_S, converged_by, heal_moments

        windows = [(float(f["from"]), float(f["to"])) for f in getattr(self.tl, "store_faults", []) or []]
        windows += [(float(a), float(b)) for _, a, b in [*self.tl.hidden, *self.tl.corrupt]]
        horizon = max((t for t, _, _ in self.tap.fleet), default=0.0)
        heals, skipped = heal_moments(windows, horizon, CONVERGE_S)
        if skipped:
            self.unverified["converged: another store fault, or the run's end, within the bound"] += skipped
        entries: dict[str, list[tuple[float, int]]] = defaultdict(list)
        for t, worker, status in self.tap.fleet:
            if status is not None:
                entries[worker].append((t, int(status.active_version)))
        for healed in heals:
            latest, deadline = self.latest_at(healed), healed + CONVERGE_S
            for w in self.tl.workers:
                if w.start > healed or (w.end is not None and w.end < deadline) or w.paused_at is not None:
                    continue  # (a process that began after it, or did not live through the bound)
                if any(a <= deadline and b >= healed for a, b in [*w.stops, *self.broker_out]):
                    self.unverified["converged: the replica or the broker frozen or out within the bound"] += 1
                    continue
                ok, shown = converged_by([e for e in entries[w.worker_id] if e[0] >= w.start], latest, deadline)
                if ok is None:
                    self.unverified["converged: the replica's registry unheard near the bound"] += 1
                    continue
                self.check(
                    "converged",
                    ok,
                    w.worker_id,
                    f"still at v{shown} {CONVERGE_S:g} s after the object store was whole again "
                    f"({healed - self.t_first:.1f} s into the run), v{latest} committed by then",
                )

    def _check_permissions(self) -> None:
        """The broker refuses nothing a legitimate process does (the rogue's refusals are the point)."""
        refused: dict[tuple[str, str], int] = defaultdict(int)
        for line in self.broker_log.splitlines():
            m = re.search(r'"ROLLFLEET/user:([^"]+)" - (\w+ Violation) - Subject "([^"]+)"', line)
            if m is None:
                continue
            if m.group(1) != "rogue":
                refused[(m.group(1), f"{m.group(2)} on {m.group(3)}")] += 1
        self.checks["permissions"] += 1  # one fact: no legitimate operation refused (not one per log line)
        for (user, what), n in sorted(refused.items()):
            self.violations.append(
                Violation(
                    "permissions", user, f"the generated permissions refused {user}'s own operation {n} time(s): {what}"
                )
            )

    def _check_topology(self) -> None:
        """Every stream of the namespace and every jobs consumer the broker created, whoever declared
        it and whenever (a lost one declared again), has the fleet's settings, as the broker itself
        describes it (the tap's ``declared``). A gateway once declared a lost consumer with its own
        30 s ack-wait: a dead holder's job then waited past its deadline (``stranded``)."""
        fleet = FleetTopology(
            ack_wait=float(self.cfg.ack_wait),
            max_deliver=int(self.cfg.max_deliver),
            duplicate_window=float(self.cfg.duplicate_window),
            replicas=int(getattr(self.cfg, "replicas", 1)),  # (a run kept before it was saved: one node)
        )
        windowed = {self.names.jobs_stream, self.names.results_stream}
        for t, kind, name, settings in getattr(self.tap, "declared", []):
            if settings is None:
                self.unverified["a creation the broker could not describe (gone, or the broker away)"] += 1
                continue
            wrong = topology_mismatches(kind, settings, fleet, windowed=name in windowed)
            self.check(
                "topology",
                not wrong,
                name,
                f"the broker created {kind} {name} at {t:.3f} with {'; '.join(wrong)}",
                defect="a process declared with settings other than the fleet's",
            )

    def _check_activation_digests(self) -> None:
        bad: dict[tuple[str, int], tuple[str, str]] = {}
        for a in self.activations:
            if a.weights_digest is None:
                continue
            want = self.weights.digest(a.version)
            self.checks["digest"] += 1
            if a.weights_digest != want:
                bad[(a.worker_id, a.version)] = (a.weights_digest, want)
        for (worker, v), (got, want) in sorted(bad.items()):
            self.violations.append(
                Violation(
                    "digest",
                    None,
                    f"{worker} activated v{v} with live weights {got[:12]}, the trainer's v{v} is {want[:12]}",
                    "1",
                )
            )

    # -- the rollout loop and the gateways' sessions (their own modules judge them) -----------------
    def _keyed(self, worker: Any) -> bool:
        """Whether tokens made by ``worker`` can be recomputed (a keyed engine: echo, or the sglang
        stand-in); a span that names no worker: whether every worker of the run is keyed."""
        engines = {w.worker_id: w.engine for w in self.tl.workers}
        if worker is None:
            return all(e in ("echo", "sglang") for e in engines.values())
        return engines.get(str(worker)) in ("echo", "sglang")

    def _blind(self, t0: float, t1: float) -> bool:
        """Whether the wiretap may have missed an answer published in [t0, t1] (it was away, or a
        store loss took what was stored)."""
        return any(a <= t1 and t0 <= b for a, b in self.tap.gaps) or self._lost_during(t0, t1, "results")

    def _check_loops(self) -> None:
        """``loop-group``, ``served``, ``loop-staleness``, ``loop-tokens``, ``loop-ran``: the
        trainer's ``RolloutLoop`` (``reliability.adversary.oracle_loop``)."""
        from reliability.adversary.oracle_loop import Answer, asked_prompts, judge_loops

        records = [r for r in self.trainer if str(r.get("ev", "")).startswith("loop_")]
        if not records:
            return
        try:
            from reliability.adversary.truth import Truth
        except ImportError:
            self.unverified["loop: this rollfleet has no keyed echo engine"] += 1
            return
        truth = Truth(self.weights)
        # When each job was stored, as its client stamped it (every stored job the wiretap heard, and
        # every delivery it saw): it tells which life of a client's loops a job was.
        submitted = {str(j): float(t) for j, t in (getattr(self.tap, "job_submitted", None) or {}).items() if t}
        for d in self.tap.deliveries:
            if d.job_id and d.submitted_at:
                submitted[d.job_id] = min(float(d.submitted_at), submitted.get(d.job_id, float("inf")))
        stored_recs = sorted((rec for recs in self.stored.values() for rec in recs), key=lambda r: r.get("seq") or 0)
        answers = []
        stored: dict[str, set[str]] = defaultdict(set)
        if stored_recs and all("ntokens" in rec for rec in stored_recs):
            # What the results stream held at the end: every answer stored, the wiretap there or not
            # (one per job, the first stored: the one its caller was given). Blind only where a store
            # loss took some.
            for rec in stored_recs:
                parsed = self.names.parse_result_subject(rec["subject"])
                if parsed is None or not rec.get("job_id") or rec["job_id"] in stored:
                    continue
                job = str(rec["job_id"])
                stored[job].add(str(rec.get("digest")))
                t = self._answer_seen_at(job, submitted.get(job, 0.0))
                answers.append(Answer(parsed[0], job, t, rec.get("ntokens"), str(rec.get("digest"))))

            def blind(t0: float, t1: float) -> bool:
                # (a store loss took answers; or the broker was out as the loop closed: a cancel
                # it could not deliver, an answer it could not wait for)
                closing = any(a <= t1 and t1 - 10.0 <= b for a, b in self.broker_out)
                return self._lost_during(t0, t1, "results") or closing
        else:  # (a kept run from before the stream's answers were counted: the wiretap's view)
            for p in self.tap.published:
                parsed = self.names.parse_result_subject(p.subject) if p.subject else None
                if parsed is None or not p.job_id:
                    continue
                ntokens = 0 if p.kind == "failure" else (int(p.desc.get("ntokens") or 0) if p.desc else None)
                answers.append(Answer(parsed[0], str(p.job_id), float(p.t), ntokens, str(p.digest)))
            for rec in stored_recs:
                if rec.get("job_id"):
                    stored[str(rec["job_id"])].add(str(rec.get("digest")))
            blind = self._blind
        # Each client's jobs' prompts (where samples were continued), as the wiretap heard the jobs
        # stored or saw them delivered; a kept run from before it heard prompts stored knows fewer.
        prompts, asked = asked_prompts(self.tap.deliveries, getattr(self.tap, "job_prompts", None) or {})
        notes = judge_loops(
            self,
            records,
            answers,
            stored=stored,
            submitted=submitted,
            key_of=truth.key,
            keyed=self._keyed,
            blind=blind,
            killed=self.ended_by_kill,
            prompts=prompts,
            away=lambda t0, t1: any(a <= t1 and t0 <= b for a, b in self.tap.gaps),
            asked=asked,
        )
        self.notes.update(notes)

    def _check_gateway_sessions(self) -> None:
        """``once``, ``version``, ``served`` and ``gone`` for the HTTP callers of the gateways
        (``reliability.adversary.oracle_gateway``)."""
        from reliability.adversary.machine import GATEWAY_CLIENT
        from reliability.adversary.oracle_gateway import calls_of, judge_answers, judge_gone, judge_keys_and_turns

        calls = calls_of(self.trainer)
        if not calls:
            return
        session_of_job: dict[str, str] = {}
        jobs_of_session: dict[str, set[str]] = defaultdict(set)
        for d in self.tap.deliveries:
            if d.job_id and d.session_id and d.client_id == GATEWAY_CLIENT:
                session_of_job[d.job_id] = d.session_id
                jobs_of_session[d.session_id].add(d.job_id)
        for p in self.tap.published:
            sid = (p.desc or {}).get("session_id")
            parsed = self.names.parse_result_subject(p.subject) if p.subject else None
            if sid and p.job_id and parsed and parsed[0] == GATEWAY_CLIENT:
                session_of_job.setdefault(str(p.job_id), sid)
                jobs_of_session[sid].add(str(p.job_id))
        judge_keys_and_turns(
            self,
            calls,
            session_of_job,
            jobs_of_session,
            self.finals,
            lost=lambda answered, asked: self.lost_with_store(answered, "results", after=asked) is not None,
        )
        try:
            from reliability.adversary.truth import Truth

            truth: Any = Truth(self.weights)
        except ImportError:
            truth = None
        versions = sorted({v for _, v in self.commits})

        def served(answer: dict[str, Any], prompt: list[int], seed: int | None) -> list[str] | None:
            if truth is None or not answer.get("token_ids"):
                return None
            seed = seed_used({"seed": seed}, answer)
            verdict = truth.judge(answer, prompt, seed=seed, keyed_replica=self._keyed, versions=versions)
            if not verdict.checked and not verdict.mismatches:
                return None
            return [m.describe() for m in verdict.mismatches]

        judge_answers(self, calls, served=served)
        notes = judge_gone(
            self,
            calls,
            deliveries=self.tap.deliveries,
            published=self.tap.published,
            acks=self.tap.acks,
            gateway_lives=getattr(self.tl, "gateways", []) or [],
            worker_lives=self.tl.workers,
            outages=self.broker_out,
            gaps=self.tap.gaps,
            client_id=GATEWAY_CLIENT,
            run_end=self.t_first + SAMPLE_S * len(self.samples),
        )
        self.notes.update(gateway_http_calls=len(calls), **notes)


TRAINER = "trainer"


@dataclass(frozen=True)
class FleetTopology:
    """The settings every process of the run was given (the harness's flags, not any process's word)."""

    ack_wait: float
    max_deliver: int
    duplicate_window: float
    replicas: int


def topology_mismatches(kind: str, settings: dict[str, Any], fleet: FleetTopology, *, windowed: bool) -> list[str]:
    """How a created stream or jobs consumer (``settings`` as the broker describes it) differs from
    the fleet's topology; empty when it does not. A consumer's replicas of 0 follow its stream's."""
    wrong: list[str] = []

    def differs(field: str, got: Any, want: Any) -> None:
        if got is None or abs(float(got) - float(want)) > 1e-6:
            wrong.append(f"{field} {got} (the fleet's: {want})")

    if kind == "consumer":
        differs("ack_wait", settings.get("ack_wait"), fleet.ack_wait)
        differs("max_deliver", settings.get("max_deliver"), fleet.max_deliver)
        if settings.get("num_replicas") not in (None, 0):
            differs("num_replicas", settings.get("num_replicas"), fleet.replicas)
    else:
        differs("num_replicas", settings.get("num_replicas") or 1, fleet.replicas)
        if windowed:
            differs("duplicate_window", settings.get("duplicate_window"), fleet.duplicate_window)
    return wrong


# -- judging a kept run again (``python -m reliability.adversary.oracle WORKDIR``) -----------------------


def save_inputs(
    path: Any,
    *,
    cfg: Any,
    timeline: Any,
    finals: dict[str, Any],
    stored: dict[str, Any],
    activations: list[Any],
    broker_log: str = "",
) -> None:
    """What the oracle read besides the journals and the tap's dump, so a kept run can be judged again."""
    import json

    import msgspec

    doc = {
        "cfg": {
            "seed": cfg.seed,
            "ack_wait": cfg.ack_wait,
            "duplicate_window": cfg.duplicate_window,
            "max_deliver": cfg.max_deliver,
            "replicas": cfg.replicas,
            "duration": cfg.duration,
            "available_s": getattr(cfg, "available_s", AVAILABLE_S),
            "store": getattr(cfg, "store", "dir"),
        },
        "timeline": {
            "workers": [
                {
                    "worker_id": w.worker_id,
                    "engine": w.engine,
                    "start": w.start,
                    "end": w.end,
                    "paused_at": w.paused_at,
                    "how": w.how,
                    "armed": w.armed,
                    "stops": w.stops,
                    "skew_s": getattr(w, "skew_s", 0.0),
                }
                for w in timeline.workers
            ],
            "broker_down": timeline.broker_down,
            "broker_paused": timeline.broker_paused,
            "commits": timeline.commits,
            "hidden": timeline.hidden,
            "corrupt": timeline.corrupt,
            "consumers_deleted": timeline.consumers_deleted,
            "stores_lost": getattr(timeline, "stores_lost", []),
            "store_faults": getattr(timeline, "store_faults", []),
            "disk_faults": getattr(timeline, "disk_faults", []),
            "node_faults": getattr(timeline, "node_faults", []),
            "trainers": timeline.trainers,
            "second_clients": timeline.second_clients,
            "publishers": getattr(timeline, "publishers", []),
            "gateways": [
                {"name": g.name, "start": g.start, "end": g.end, "how": g.how, "stops": g.stops, "address": g.address}
                for g in getattr(timeline, "gateways", [])
            ],
            "engines": [es.record() for es in getattr(timeline, "engines", [])],
            "autoscale": getattr(timeline, "autoscale", None) or {},
        },
        "finals": finals,
        "stored": stored,
        "broker_log": broker_log,
        "activations": [msgspec.to_builtins(a) for a in activations],
    }
    with open(path, "w") as f:
        json.dump(doc, f, default=str)


def judge_kept(workdir: Any) -> list[Violation]:
    """Judge a kept run's work directory again, from its files alone."""
    import json

    oracle = load_kept(workdir)
    violations = oracle.judge()
    for v in violations:
        print(f"VIOLATION {v.line()}")
    print(
        json.dumps(
            {"checks": dict(oracle.checks), "unverified": dict(oracle.unverified), "violations": len(violations)}
        )
    )
    return violations


def load_kept(workdir: Any) -> Oracle:
    """An oracle over a kept run's work directory (``save_inputs``, the journals, the tap's dump)."""
    import json
    from pathlib import Path
    from types import SimpleNamespace

    import msgspec

    from reliability.adversary.journal import Journal
    from reliability.adversary.tap import Delivery, Published
    from reliability.adversary.trainer_weights import TrainerWeights
    from rollfleet.schemas import Names, ReplicaStatus, VersionActivated

    wd = Path(workdir)
    doc = json.loads((wd / "oracle.json").read_text())
    tap_doc = json.loads((wd / "tap.json").read_text())
    cfg = SimpleNamespace(**doc["cfg"])
    tl = SimpleNamespace(**doc["timeline"])
    tl.workers = [SimpleNamespace(**{"stops": [], "skew_s": 0.0, **w}) for w in tl.workers]
    tl.broker_paused = getattr(tl, "broker_paused", [])
    tl.stores_lost = getattr(tl, "stores_lost", [])
    tl.commits = [tuple(c) for c in tl.commits]
    tl.consumers_deleted = [tuple(c) for c in tl.consumers_deleted]
    tl.publishers = getattr(tl, "publishers", [])
    tl.gateways = [SimpleNamespace(**g) for g in getattr(tl, "gateways", [])]
    tl.engines = [SimpleNamespace(**{"stops": [], "refusing": [], **e}) for e in getattr(tl, "engines", [])]
    tap = SimpleNamespace(
        deliveries=[Delivery(**d) for d in tap_doc["deliveries"]],
        published=[Published(**p) for p in tap_doc["published"]],
        acks={k: [tuple(a) for a in v] for k, v in tap_doc["acks"].items()},
        claims=tap_doc["claims"],
        stored_jobs=tap_doc.get("stored_jobs", {}),
        job_submitted=tap_doc.get("job_submitted", {}),
        job_prompts=tap_doc.get("job_prompts", {}),
        fleet=[(t, w, msgspec.convert(s, ReplicaStatus) if s else None) for t, w, s in tap_doc["fleet"]],
        gaps=tap_doc["gaps"],
        declared=tap_doc.get("declared", []),
    )
    return Oracle(
        cfg=cfg,
        timeline=tl,
        tap=tap,
        trainer=Journal.read(wd / "trainer.jsonl"),
        rogue=Journal.read(wd / "rogue.jsonl"),
        finals=doc["finals"],
        stored=doc["stored"],
        activations=[msgspec.convert(a, VersionActivated) for a in doc["activations"]],
        weights=TrainerWeights(wd / "base", cfg.seed),
        names=Names("adv"),
        broker_log=doc.get("broker_log", ""),
    )


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: python -m reliability.adversary.oracle <kept run directory>  (judges it again)")
    sys.exit(1 if judge_kept(sys.argv[1]) else 0)
