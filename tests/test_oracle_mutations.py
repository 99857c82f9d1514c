"""The oracle tested against known-bad histories (issue 30).

One short real adversary run is recorded once (its inputs kept by ``save_inputs``: the journals,
the wiretap's dump, the timeline, the finals); the oracle judges it again from those files
(``judge_kept``), unmutated (no violation) and as mutated copies that each tell a known lie:
everything refused, no calls, answers relabelled ``EngineFailure``, replayable answers relabelled
``Interrupted``, a label one version off, a second different answer for a key, a fleet dead most
of the run, tokens swapped between answers, an ``Interrupted`` answer although the frozen holder
finished the job, a gateway's answer (a call the trainer sent over HTTP) labelled one version off,
and a second answer for a gateway's key on the re-ask. Each must be flagged by the invariant that
owns that promise; two histories that are fine, which the oracle once flagged (false positives),
must pass. The pure rules
behind ``available`` and ``Report.passed``, and the counting of events, are tested in milliseconds.

The recorded run uses a short availability bound (``AVAILABLE_S`` 5 s, the run lasts ~10 s of
load), so that a fleet dead for most of a short run is past it; the unmutated run must pass
under the same bound.
"""

from __future__ import annotations

import asyncio
import json
import shutil
from collections.abc import Callable
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from reliability.adversary.journal import tokens_digest
from reliability.adversary.oracle import (
    CLAIMED_AFTER_THE_ANSWER,
    FleetTopology,
    judge_kept,
    load_kept,
    refused_at_a_pin,
    tap_saw_every_copy,
    topology_mismatches,
    unserved_stretches,
)
from reliability.adversary.run import Adversary, Config, Report, print_report, run_one
from reliability.adversary.schedule import Event
from rollfleet.schemas.names import claim_key

RUN_S = 10.0
SEED = 19
BOUND_S = 5.0


# -- the pure rules --------------------------------------------------------------------------------


def test_unserved_stretches_measure_asking_without_service() -> None:
    # Asked from 0 to 10, served at 1 and 9: nothing served from 1 to 9 while asking.
    assert unserved_stretches([(0.0, 10.0)], [1.0, 9.0]) == [(0.0, 1.0, 1.0), (1.0, 9.0, 8.0), (9.0, 10.0, 1.0)]
    # Refusals are points: refused at 2, 5 and 8 with nothing served is a 6 s stretch.
    assert unserved_stretches([(2.0, 2.0), (5.0, 5.0), (8.0, 8.0)], []) == [(2.0, 8.0, 6.0)]
    # Nobody asking: no stretch, however long nothing was served.
    assert unserved_stretches([], [1.0]) == []
    # An outage the run injected is not counted (overlapping outages once).
    assert unserved_stretches([(0.0, 10.0)], [], [(2.0, 5.0), (4.0, 6.0)]) == [(0.0, 10.0, 6.0)]


def test_a_creation_is_judged_against_the_fleets_topology() -> None:
    fleet = FleetTopology(ack_wait=2.0, max_deliver=10, duplicate_window=15.0, replicas=1)
    r3 = FleetTopology(ack_wait=2.0, max_deliver=10, duplicate_window=15.0, replicas=3)

    def consumer(ack_wait: float, replicas: int, of: FleetTopology = fleet) -> list[str]:
        settings = {"ack_wait": ack_wait, "max_deliver": 10, "num_replicas": replicas}
        return topology_mismatches("consumer", settings, of, windowed=False)

    def stream(replicas: int, window: float, windowed: bool, of: FleetTopology = fleet) -> list[str]:
        settings = {"num_replicas": replicas, "duplicate_window": window}
        return topology_mismatches("stream", settings, of, windowed=windowed)

    assert consumer(2.0, 0) == []
    assert consumer(30.0, 0) == ["ack_wait 30.0 (the fleet's: 2.0)"]
    assert stream(1, 15.0, True) == [] and stream(1, 120.0, False) == []  # (progress: a window of its own)
    assert stream(1, 600.0, True)
    assert stream(1, 15.0, True, r3)  # an R1 stream on the cluster
    assert consumer(2.0, 0, r3) == [] and consumer(2.0, 1, r3)  # (0: its stream's replicas)
    assert topology_mismatches("consumer", {"max_deliver": 10}, fleet, windowed=False)  # (unknown: not the fleet's)


def test_a_pinned_sessions_refusal_is_judged_only_once_a_turn_has_pinned_it() -> None:
    assert refused_at_a_pin({"session": {"last_version": 6, "replica": "w2", "next_turn": 1}})
    assert not refused_at_a_pin({"session": {"last_version": None, "replica": None, "next_turn": 0}})
    assert refused_at_a_pin({"cls": "NoCompatibleReplica"})  # (a journal that says nothing: judged)
    assert refused_at_a_pin(None)


def test_a_run_that_injected_or_judged_nothing_fails() -> None:
    report = Report(config=Config(seed=1), events=0, checks={"version": 3})
    assert not report.passed and report.vacuous == "the run injected no events"
    report = Report(config=Config(seed=1), events=2, checks={})
    assert not report.passed and report.vacuous == "the oracle judged no fact"
    assert Report(config=Config(seed=1), events=2, checks={"version": 3}).passed
    assert Report(config=Config(seed=1), events=2, checks={"version": 3}).summary()["violations"] == 0
    assert Report(config=Config(seed=1), events=0, checks={"version": 3}).summary()["violations"] == 1


async def test_a_skipped_event_is_not_counted_as_injected(tmp_path: Path) -> None:
    adversary = Adversary(Config(seed=1, quiet=True), tmp_path)
    try:
        await adversary.guarded(Event(0.0, "second_client"))  # no trainer runs: nobody to impersonate
        await adversary.guarded(Event(0.0, "hide", {"which": "latest", "for_s": 1.0}))  # nothing committed
    finally:
        adversary.events_journal.close()
    assert adversary.injected == {}
    assert adversary.skipped == {"second_client": 1, "hide": 1}


# -- the recorded run ------------------------------------------------------------------------------

INPUTS = ("oracle.json", "tap.json", "trainer.jsonl", "rogue.jsonl")


@pytest.fixture(scope="module")
def recorded(tmp_path_factory: pytest.TempPathFactory) -> Path:
    workdir = tmp_path_factory.mktemp("oracle-mutations") / "run"
    # (without the trainer's RolloutLoop and the gateways' HTTP callers: their invariants are tried
    # on histories made for them, tests/test_oracle_loop_gateway.py)
    cfg = Config(seed=SEED, duration=RUN_S, available_s=BOUND_S, workdir=workdir, keep=True, quiet=True,
                 loop=False, gateway_sessions=0)  # fmt: skip
    report = asyncio.run(run_one(cfg))
    print_report(report)
    assert report.crashed is None, report.crashed
    assert all((workdir / name).is_file() for name in INPUTS)
    return workdir


class History:
    """A copy of a recorded run's inputs, to be mutated and judged again."""

    def __init__(self, src: Path, dst: Path) -> None:
        dst.mkdir(parents=True)
        for name in INPUTS:
            shutil.copy(src / name, dst / name)
        (dst / "base").symlink_to(src / "base")  # the trainer's weights: read only
        self.dir = dst
        self.doc = json.loads((dst / "oracle.json").read_text())
        self.tap = json.loads((dst / "tap.json").read_text())
        self.trainer = [json.loads(line) for line in (dst / "trainer.jsonl").read_text().splitlines() if line]
        # Keys the trainer cancelled: a cancel's record says what the answer was (a sample ended
        # early where it was stopped), so the mutations that must pass leave their answers alone.
        self.cancelled = {r["key"] for r in self.trainer if r.get("ev") == "cancel"}
        self.flagged: str | None = None  # what a mutation's violation must name (a job id), if anything

    def calls(self) -> dict[str, dict[str, Any]]:
        return {r["rid"]: r for r in self.trainer if r.get("ev") in ("submit", "turn")}

    def answers(self, kind: str = "result") -> list[dict[str, Any]]:
        return [r for r in self.trainer if r.get("ev") == "answer" and r.get("kind") == kind]

    def judge(self) -> dict[str, list[str]]:
        (self.dir / "oracle.json").write_text(json.dumps(self.doc))
        (self.dir / "tap.json").write_text(json.dumps(self.tap))
        (self.dir / "trainer.jsonl").write_text("".join(json.dumps(r) + "\n" for r in self.trainer))
        out: dict[str, list[str]] = {}
        for v in judge_kept(self.dir):
            out.setdefault(v.check, []).append(f"{v.key}: {v.message}")
        return out


def _error(record: dict[str, Any], cls: str, code: str, **more: Any) -> None:
    keep = {k: record[k] for k in ("ev", "rid", "op", "key", "t0", "t", "inc", "sid", "turn", "spent") if k in record}
    record.clear()
    record.update(keep, kind="error", cls=cls, code=code, retryable=True, message=f"{cls} (mutated)", **more)


def refuse_everything(h: History) -> None:
    """No job was ever stored: every call refused NoCompatibleReplica at submit."""
    h.trainer = [r for r in h.trainer if r.get("ev") not in ("stored", "answer", "hang", "reask")]
    for r in h.calls().values():
        turn = {"sid": r["sid"], "turn": r["turn"], "spent": True} if "sid" in r else {}
        answer = {
            "ev": "answer",
            "rid": r["rid"],
            "op": r["op"],
            "key": r["key"],
            "t": r["t"] + 0.01,
            "t0": r["t"],
            "inc": r["inc"],
            **turn,
        }
        _error(answer, "NoCompatibleReplica", "no_compatible_replica", at="submit")
        h.trainer.append(answer)
    h.tap["deliveries"], h.tap["published"] = [], []
    h.doc["finals"] = {}


def no_calls(h: History) -> None:
    h.trainer = [r for r in h.trainer if r.get("ev") in ("start", "connected", "done")]
    h.tap["deliveries"], h.tap["published"] = [], []
    h.doc["finals"] = {}


def relabel_engine_failure(h: History) -> None:
    for r in h.answers():
        _error(r, "EngineFailure", "engine_failure")


def relabel_replayable_interrupted(h: History) -> None:
    calls = h.calls()
    mutated = 0
    for r in h.answers():
        req = calls[r["rid"]].get("req") or {}
        if req.get("retry") == "replayable":
            _error(r, "Interrupted", "interrupted")
            mutated += 1
    assert mutated, "the recorded run has no replayable answer"


def label_one_version_off(h: History) -> None:
    calls = h.calls()
    mutated = 0
    for r in h.answers():
        req = calls[r["rid"]].get("req") or {}
        if req.get("kind") == "exact":
            r["version_start"] += 1
            r["version_end"] += 1
            r["spans"] = [[[v + 1, a, b] for v, a, b in spans] for spans in r["spans"]]
            mutated += 1
    assert mutated, "the recorded run has no exact answer"


def second_answer_for_a_key(h: History) -> None:
    """A fresh client's re-ask of a key returns another job's answer than the trainer got."""
    finals = h.doc["finals"]
    key = next(k for k, f in sorted(finals.items()) if f.get("kind") == "result")
    finals[key] = {**finals[key], "job_id": "another-job", "tokens": "0" * 16}


def dead_fleet(h: History) -> None:
    """Every worker process dead two seconds into the trainer's run, none restarted."""
    t_trainer = min(float(t["start"]) for t in h.doc["timeline"]["trainers"])
    for w in h.doc["timeline"]["workers"]:
        w["end"] = max(float(w["start"]) + 0.5, min(float(w["end"] or 1e18), t_trainer + 2.0))
        w["how"] = "exited 2"


def consumer_declared_with_the_default_ack_wait(h: History) -> None:
    """A jobs consumer the broker created (a gateway declaring a lost one) with nats' and our
    default 30 s ack-wait, not the fleet's: a dead holder's job then waits 30 s."""
    created = [d for d in h.tap["declared"] if d[1] == "consumer" and d[3] is not None]
    assert created, "the recorded run saw no jobs consumer created"
    created[-1][3]["ack_wait"] = 30.0
    h.flagged = created[-1][2]


def jobs_stream_declared_with_its_declarers_window(h: History) -> None:
    """The jobs stream created again (after a wipe) with a window of its declarer's own."""
    jobs = [d for d in h.tap["declared"] if d[1] == "stream" and d[2].endswith("JOBS") and d[3] is not None]
    assert jobs, "the recorded run saw no jobs stream"
    jobs[-1][3]["duplicate_window"] = 600.0
    h.flagged = jobs[-1][2]


def swap_tokens(h: History, reverse: bool = False) -> None:
    """Tokens swapped consistently between answers of the same shape (every copy of a job's answer,
    in the journal and the final re-ask, gets another job's token ids and digest; lengths and spans
    unchanged): only recomputing them can tell."""
    jobs: dict[str, dict[str, Any]] = {}
    for r in h.answers():
        if r.get("token_ids"):
            jobs.setdefault(r["job_id"], r)
    groups: dict[str, dict[str, dict[str, Any]]] = {}  # shape -> tokens -> one job's answer
    for r in jobs.values():
        groups.setdefault(json.dumps(r["lengths"]), {}).setdefault(json.dumps(r["token_ids"]), r)
    by_job: dict[str, tuple[Any, str]] = {}
    for same in groups.values() if not reverse else ():
        distinct = list(same.values())
        if len(distinct) >= 2:
            moved = [(r["token_ids"], r["tokens"]) for r in distinct]
            for r, lie in zip(distinct, moved[1:] + moved[:1], strict=True):
                by_job[r["job_id"]] = lie
    if not by_job:
        # A short run under load may answer no two jobs of one shape: then one answer's tokens are
        # reversed instead (same lengths, spans and digest scheme; a consistent lie all the same).
        for r in jobs.values():
            moved_ids = [list(reversed(ids)) for ids in r["token_ids"]]
            if moved_ids != r["token_ids"] and not r.get("forged_tokens"):
                by_job[r["job_id"]] = (moved_ids, tokens_digest([SimpleNamespace(token_ids=t) for t in moved_ids]))
                break
    assert by_job, "the recorded run has no answer whose tokens can be moved"
    digests = {job: lie[1] for job, lie in by_job.items()}
    for r in [*h.answers(), *h.doc["finals"].values()]:
        if r.get("kind") == "result" and r.get("job_id") in by_job:
            r["token_ids"], r["tokens"] = by_job[r["job_id"]]
    for p in h.tap["published"]:  # (what the wiretap saw published tells the same lie)
        if p.get("job_id") in digests and p.get("kind") == "result":
            p["digest"] = digests[p["job_id"]]
            if p.get("desc"):
                p["desc"]["tokens"] = digests[p["job_id"]]


def interrupted_though_a_frozen_holder_finished(h: History, convert: bool = False) -> None:
    """An at_most_once job's holder was frozen (SIGSTOP) for a while; another replica answered it
    Interrupted, and then the holder, alive all along, finished it (issue 30, items 8 and 9)."""
    submit, answer = _at_most_once_call(h, convert)
    key, job, worker = answer["key"], answer["job_id"], answer["worker_id"]
    done = min(float(p["t"]) for p in h.tap["published"] if p["job_id"] == job)
    other = next(w for w in ("w1", "w2", "w3", "w4") if w != worker)
    h.tap["published"].append(
        {
            "t": done - 0.2,
            "subject": f"rf.adv.results.trainer.x.{job}.{other}",
            "kind": "failure",
            "key": key,
            "job_id": job,
            "worker": other,
            "digest": "0" * 16,
            "code": "interrupted",
        }
    )
    _error(answer, "Interrupted", "interrupted")
    h.doc["finals"][key] = {k: answer[k] for k in ("kind", "cls", "code", "retryable", "message", "t")}
    for w in h.doc["timeline"]["workers"]:
        if w["worker_id"] == worker and float(w["start"]) <= done and (w["end"] is None or done < float(w["end"])):
            w["stops"] = [[float(submit["t"]), (float(submit["t"]) + done) / 2]]  # frozen while it ran


def claimed_by_two_processes(h: History) -> None:
    """An at_most_once job's claim stored by two processes (no hand-back between): two other
    processes' claim creates, both acknowledged, while the job was asked."""
    submit, answer = _at_most_once_call(h)
    key, t = claim_key(answer["job_id"]), float(submit["t"])
    # (not while the wiretap was away, a broker restart in the recorded run: claims it could not
    # have seen are not judged, and this history must be)
    while away := [b for a, b in h.tap["gaps"] if a - 0.1 <= t <= b + 0.1]:
        t = max(away) + 0.2
    for i, holder in enumerate(("w8:4001-0badc1a1", "w9:4002-0badc1a2")):
        h.tap["claims"].append([t + 0.01 * (i + 1), key, f"{holder}@{t:.3f}", "PUT", "stored"])


def _gateway_answer(h: History) -> dict[str, Any]:
    """A result the trainer got over HTTP from a ``rollfleet gateway`` (its key the gateways' client's)."""
    found = [r for r in h.answers() if r.get("client") == "gateway" and r.get("spans") and r.get("token_ids")]
    assert found, "the recorded run has no result answered through a gateway"
    return found[0]


def gateway_answer_one_version_off(h: History) -> None:
    """A gateway's answer relabelled one version up (every span), its tokens as they were: only
    recomputing them from the trainer's bytes at the labelled version can tell."""
    r = _gateway_answer(h)
    r["version_start"] += 1
    r["version_end"] += 1
    r["spans"] = [[[v + 1, a, b] for v, a, b in spans] for spans in r["spans"]]
    h.flagged = r["job_id"]


def second_answer_for_a_gateway_key(h: History) -> None:
    """The re-ask at the end (a client with the gateways' id) returns another job's answer for a key
    the trainer was answered through a gateway."""
    r = _gateway_answer(h)
    final = h.doc["finals"].get(r["key"])
    assert final is not None and final.get("kind") == "result", "the gateway's key was not re-asked"
    h.doc["finals"][r["key"]] = {**final, "job_id": "another-job", "tokens": "0" * 16}
    h.flagged = "another-job"


def gateway_call_hangs_past_its_deadline(h: History) -> None:
    """A call over HTTP the trainer was answered is left unanswered instead, its caller giving up
    15 s past every copy's deadline: the caller giving up early is unverified, this is a hang."""
    r = _gateway_answer(h)
    copies = [float(d.get("deadline") or 0) for d in h.tap["deliveries"] if d["key"] == r["key"]]
    due = max([float(r["t0"]) + 20.0, *copies])
    keep = {k: r[k] for k in ("rid", "op", "key", "t0", "client", "inc") if k in r}
    r.clear()
    r.update(keep, ev="hang", tries=3, t=due + 15.0)
    for other in [o for o in h.trainer if o.get("ev") == "http_attempt" and o.get("rid") == keep["rid"]]:
        other["t"] = min(float(other["t"]), due + 15.0)


def _stored_answer_of_a_plain_call(h: History) -> tuple[dict[str, Any], dict[str, Any]]:
    """A plain trainer call answered with a result that the results stream holds at the end, and
    its ``stored`` record (its deadline)."""
    stored = {r["rid"]: r for r in h.trainer if r.get("ev") == "stored"}
    for r in h.answers():
        if r.get("client") or r.get("sid") or r["key"] in h.cancelled or r["rid"] not in stored:
            continue
        if any(e.get("job_id") == r.get("job_id") for e in h.doc["stored"].get(r["key"], [])):
            return r, stored[r["rid"]]
    raise AssertionError("the recorded run has no plain result its results stream still holds")


def expired_though_its_answer_was_stored(h: History, never_stored: bool = False) -> None:
    """A call whose answer a worker stored before its deadline is answered ``Expired`` at the
    deadline instead (``lost``); with ``never_stored``, the stream does not hold that answer at
    the end either (no stream leader took it), which is no violation."""
    r, stored = _stored_answer_of_a_plain_call(h)
    key, deadline = r["key"], float(stored["deadline"])
    _error(r, "Expired", "expired")
    r["t"] = deadline
    h.doc["finals"].pop(key, None)  # (the re-ask's agreement is the `once` check's)
    if never_stored:
        h.doc["stored"].pop(key, None)


def replay_coordinate_altered(h: History, part: str) -> None:
    """One accepted echo answer's replay coordinate says another prompt, or another version's
    bytes, than the harness's own facts (the request's prompt, the trainer's weights)."""
    for r in h.answers():
        wire = r.get("replay")
        if r["key"] in h.cancelled or not wire or not any(d for _, d in wire["versions"]):
            continue
        if part == "prompt":
            wire["prompt"] = "00" * 8
        else:
            wire["versions"] = [[v, "ff" * 8 if d else d] for v, d in wire["versions"]]
        h.flagged = str(r["job_id"])
        return
    raise AssertionError("the recorded run has no answer with a replay coordinate and a digest")


MUTATIONS: dict[str, tuple[Callable[[History], None], str]] = {
    "refuse-everything": (refuse_everything, "available"),
    "no-calls": (no_calls, "available"),
    "relabelled-engine-failure": (relabel_engine_failure, "answered"),
    "relabelled-interrupted": (relabel_replayable_interrupted, "answered"),
    "label-one-version-off": (label_one_version_off, "version"),
    "second-answer-for-a-key": (second_answer_for_a_key, "once"),
    "dead-fleet": (dead_fleet, "available"),
    "swapped-tokens": (swap_tokens, "served"),
    "claimed-by-two-processes": (claimed_by_two_processes, "twice"),
    "gateway-answer-one-version-off": (gateway_answer_one_version_off, "served"),
    "second-answer-for-a-gateway-key": (second_answer_for_a_gateway_key, "once"),
    "gateway-call-hangs-past-its-deadline": (gateway_call_hangs_past_its_deadline, "resolution"),
    "expired-though-its-answer-was-stored": (expired_though_its_answer_was_stored, "lost"),
    "reversed-tokens": (partial(swap_tokens, reverse=True), "served"),
    "replay-coordinate-of-another-prompt": (partial(replay_coordinate_altered, part="prompt"), "replayed"),
    "replay-coordinate-of-other-bytes": (partial(replay_coordinate_altered, part="digest"), "replayed"),
    "consumer-declared-with-the-default-ack-wait": (consumer_declared_with_the_default_ack_wait, "topology"),
    "jobs-stream-declared-with-its-declarers-window": (jobs_stream_declared_with_its_declarers_window, "topology"),
    "interrupted-though-a-frozen-holder-finished": (interrupted_though_a_frozen_holder_finished, "twice"),
    "interrupted-though-a-frozen-holder-finished (converted call)": (
        partial(interrupted_though_a_frozen_holder_finished, convert=True),
        "twice",
    ),
}


@pytest.mark.timeout(240)
def test_the_unmutated_history_passes(recorded: Path, tmp_path: Path) -> None:
    found = History(recorded, tmp_path / "h").judge()
    assert found == {}, found


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", list(MUTATIONS))
def test_a_mutated_history_is_flagged(name: str, recorded: Path, tmp_path: Path) -> None:
    mutate, expected = MUTATIONS[name]
    h = History(recorded, tmp_path / "h")
    mutate(h)
    found = h.judge()
    assert expected in found, f"{name}: not flagged by {expected!r}; the oracle said {found}"
    if h.flagged is not None:  # (the very answer it mutated, not another)
        assert any(h.flagged in m for m in found[expected]), found[expected]


@pytest.mark.timeout(240)
def test_checks_are_counted_once_per_judged_fact(recorded: Path) -> None:
    oracle = load_kept(recorded)
    oracle.judge()
    assert oracle.tap.deliveries and oracle.broker_log  # (deliveries and log lines once inflated these)
    assert oracle.checks["rogue"] == 1
    assert oracle.checks["permissions"] == 1
    described = [d for d in oracle.tap.declared if d[3] is not None]
    assert oracle.checks["topology"] == len(described) > 0  # one per creation the broker described
    resumed = {
        (c.key, (c.answer or {}).get("job_id"))
        for c in oracle.calls
        if c.is_result and (c.req or {}).get("retry") == "resume"
    }
    assert oracle.checks["resumed"] == len(resumed) > 0  # one per result, not one per span


# -- histories that are fine, which the oracle once flagged ---------------------------------------------


def _call_of(h: History, retry: str, once: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """A plain call with that retry policy, its key asked once and not cancelled, answered with a
    result: (its submit, its answer). ``once``: its job delivered once (seen), to the replica that
    answered it, and run there whole (a resumable job resumed after a kill has two deliveries and
    spans by two replicas: make test run I picked one, and its mutation judged the other's span)."""
    calls = h.calls()
    keys = [c["key"] for c in calls.values()]
    for r in h.answers():
        req = calls[r["rid"]].get("req") or {}
        if req.get("retry") == retry and r.get("spans") and keys.count(r["key"]) == 1 and r["key"] not in h.cancelled:
            if once and not _delivered_once_to_its_answerer(h, r):
                continue
            return calls[r["rid"]], r
    raise AssertionError(f"the recorded run has no {retry} answer")


def _delivered_once_to_its_answerer(h: History, r: dict[str, Any]) -> bool:
    seen = [d for d in h.tap["deliveries"] if d["job_id"] == r["job_id"]]
    return len(seen) == 1 and seen[0]["worker"] == r["worker_id"] and seen[0].get("attempt") == 1


def _once_delivered(
    h: History, retry: str, convert: bool = False, once: bool = False
) -> tuple[dict[str, Any], dict[str, Any]]:
    """A call with ``retry`` as ``_call_of`` finds it (``once`` passed on); a short run under load may have answered
    none: then a replayable call whose job was delivered once, to the replica that answered it
    whole, becomes one (its request and its delivery say ``retry``; nothing else differs for one
    delivery, since a replayable job takes no claim and keeps no checkpoint, and neither is
    judged for a job that one replica ran once)."""
    try:
        if not convert:
            return _call_of(h, retry, once=once)
    except AssertionError:
        pass
    calls = h.calls()
    keys = [c["key"] for c in calls.values()]
    for r in h.answers():
        submit = calls[r["rid"]]
        req = submit.get("req") or {}
        seen = [d for d in h.tap["deliveries"] if d["job_id"] == r["job_id"]]
        whole = all(f in ("length", "stop") for f in r.get("finishes") or ["?"])
        if (
            req.get("retry") == "replayable"
            and r.get("spans")
            and keys.count(r["key"]) == 1
            and r["key"] not in h.cancelled
            and whole
            and _delivered_once_to_its_answerer(h, r)
            and not r.get("client")  # (the trainer's own key: these histories store under its client id)
        ):
            req["retry"] = seen[0]["retry"] = retry
            if retry == "resume":  # a resumable run names the replica of each span (a replayable one: None)
                named = [[r["worker_id"]] * len(spans) for spans in r["spans"]]
                for desc in (r, h.doc["finals"].get(r.get("idem_key") or r["key"])):
                    if desc and desc.get("job_id") == r["job_id"]:
                        desc["replicas"] = named
            return submit, r
    raise AssertionError(f"the recorded run has no {retry} answer, nor a replayable one delivered once")


def _at_most_once_call(h: History, convert: bool = False) -> tuple[dict[str, Any], dict[str, Any]]:
    """An at_most_once call (``convert``: one converted from a replayable call, always; its claim
    is judged only between two holders)."""
    return _once_delivered(h, "at_most_once", convert)


def interrupted_then_a_later_job(h: History, convert: bool = False) -> None:
    """An at_most_once job answered Interrupted (as a worker published it); after the duplicate
    window a new job under the same key is finished by a replica that is draining. The later
    job is another job: it does not make the Interrupted answer wrong."""
    _submit, answer = _at_most_once_call(h, convert)
    key, job, worker, t = answer["key"], answer["job_id"], answer["worker_id"], float(answer["t"])
    h.tap["published"] = [p for p in h.tap["published"] if p["job_id"] != job]
    h.tap["published"].append(
        {
            "t": t - 0.1,
            "subject": f"rf.adv.results.trainer.x.{job}.{worker}",
            "kind": "failure",
            "key": key,
            "job_id": job,
            "worker": worker,
            "digest": "0" * 16,
            "code": "interrupted",
        }
    )
    _error(answer, "Interrupted", "interrupted")
    h.doc["finals"][key] = {k: answer[k] for k in ("kind", "cls", "code", "retryable", "message", "t")}
    later = t + float(h.doc["cfg"]["duplicate_window"]) + 5.0
    desc = {
        "kind": "result",
        "job_id": "a-later-job",
        "worker_id": worker,
        "version_start": 0,
        "version_end": 0,
        "spans": [],
        "tokens": "1" * 16,
        "finished_at": later,
    }
    h.tap["published"].append(
        {
            "t": later,
            "subject": f"rf.adv.results.trainer.x.a-later-job.{worker}",
            "kind": "result",
            "key": key,
            "job_id": "a-later-job",
            "worker": worker,
            "digest": "1" * 16,
            "desc": desc,
        }
    )
    for w in h.doc["timeline"]["workers"]:
        if w["worker_id"] == worker and float(w["start"]) <= later and (w["end"] is None or later < float(w["end"])):
            w["end"], w["how"] = later + 1.0, "terminated"  # it drained, alive, while it finished that job


def resumed_delivery_the_tap_missed(h: History) -> None:
    """A resumable job's first delivery went to another replica (seen); its second, to the replica
    that made every token and answered, the wiretap missed (it mirrored that inbox too late)."""
    _submit, answer = _once_delivered(h, "resume", once=True)
    job = answer["job_id"]
    other = next(w for w in ("w1", "w2", "w3", "w4") if w != answer["worker_id"])
    for d in h.tap["deliveries"]:
        if d["job_id"] == job:
            d["worker"], d["attempt"] = other, 1
    answer["attempt"] = 2
    final = h.doc["finals"].get(answer.get("idem_key") or answer["key"])
    if final and final.get("job_id") == job:
        final["attempt"] = 2


def a_holder_seen_after_its_id_restarted(h: History) -> None:
    """An at_most_once job's holder refreshes its claim; the wiretap sees that write only after
    another process of the same worker id started (the first one stopped just after claiming).
    One process held the claim: the claim's own holder names it, not the worker id's newest
    process; and a client's mark that the holder stopped (refreshed 0) starts nothing."""
    submit, answer = _at_most_once_call(h)
    key, worker, t = claim_key(answer["job_id"]), answer["worker_id"], float(submit["t"])
    holder = f"{worker}:4003-0badc1a3"
    h.tap["claims"] = [c for c in h.tap["claims"] if c[1] != key]
    h.tap["claims"] += [
        [t + 0.01, key, f"{holder}@{t + 0.01:.3f}", "PUT", "stored"],
        [t + 0.30, key, f"{holder}@{t + 0.02:.3f}", "PUT", "stored"],  # (seen late)
        [t + 0.35, key, f"{holder}@0", "PUT", "stored"],
    ]
    for w in h.doc["timeline"]["workers"]:
        if w["worker_id"] == worker and float(w["start"]) <= t + 0.01 and (w["end"] is None or t < float(w["end"])):
            later = {**w, "start": t + 0.2}
            w["end"], w["how"] = t + 0.1, "killed"
            h.doc["timeline"]["workers"].append(later)
            break


def a_moved_copy_stored_while_the_tap_was_disconnected(h: History) -> None:
    """A job's first copy was delivered to another replica (seen, attempt 1); the client moved it,
    and its new copy was stored and delivered, attempt 1 again, to the replica that answered it,
    while the wiretap was disconnected: it saw neither. The answer's "attempt 1" is the new copy's,
    not the first copy's delivery to the other replica (campaign: flagged ``delivered``)."""
    _submit, answer = _once_delivered(h, "replayable", once=True)
    job = answer["job_id"]
    other = next(w for w in ("w1", "w2", "w3", "w4") if w != answer["worker_id"])
    [seen] = [d for d in h.tap["deliveries"] if d["job_id"] == job]
    seen["worker"] = other
    t_run = float(answer.get("finished_at") or answer["t"])
    h.tap["gaps"].append([float(seen["t"]) + 0.001, max(float(seen["t"]) + 0.002, t_run - 0.001)])


FINE: dict[str, Callable[[History], None]] = {
    "a-moved-copy-stored-while-the-tap-was-disconnected": a_moved_copy_stored_while_the_tap_was_disconnected,
    "a-holder-seen-after-its-id-restarted": a_holder_seen_after_its_id_restarted,
    "interrupted-then-a-later-job": interrupted_then_a_later_job,
    "interrupted-then-a-later-job (converted call)": partial(interrupted_then_a_later_job, convert=True),
    "resumed-delivery-the-tap-missed": resumed_delivery_the_tap_missed,
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("name", list(FINE))
def test_a_history_that_is_fine_passes(name: str, recorded: Path, tmp_path: Path) -> None:
    h = History(recorded, tmp_path / "h")
    FINE[name](h)
    found = h.judge()
    assert found == {}, f"{name}: {found}"


def test_a_copy_the_wiretap_may_have_missed_leaves_delivered_unverified() -> None:
    gaps = [[10.0, 12.0]]
    assert tap_saw_every_copy([], 0.0, 100.0)
    assert tap_saw_every_copy(gaps, 0.0, 9.9) and tap_saw_every_copy(gaps, 12.1, 20.0)  # connected throughout
    assert not tap_saw_every_copy(gaps, 0.0, 10.0)  # disconnected as the run began
    assert not tap_saw_every_copy(gaps, 11.0, 11.5)  # the whole life inside the gap
    assert not tap_saw_every_copy([[10.0, float("inf")]], 20.0, 30.0)  # never reconnected


@pytest.mark.timeout(240)
def test_a_moved_copy_missed_while_disconnected_is_counted_unverified(recorded: Path, tmp_path: Path) -> None:
    h = History(recorded, tmp_path / "h")
    a_moved_copy_stored_while_the_tap_was_disconnected(h)
    assert h.judge() == {}
    oracle = load_kept(h.dir)
    oracle.judge()
    unmutated = load_kept(History(recorded, tmp_path / "unmutated").dir)
    unmutated.judge()
    # (The gap added may cover other jobs of the recorded run too: at least the moved copy's is counted.)
    reason = "delivered: a copy may have been stored while the wiretap was disconnected"
    assert oracle.unverified[reason] >= unmutated.unverified[reason] + 1, (oracle.unverified, unmutated.unverified)


# -- publisher faults (publisher_kill, publisher_race): the commits and the truth the KV says --------


@pytest.mark.timeout(240)
def test_an_answer_no_stream_leader_took_is_not_lost(recorded: Path, tmp_path: Path) -> None:
    """An answer seen on the wire that the results stream does not hold at the end (and no store
    loss took) was never stored: its call answered ``Expired`` is not ``lost`` (campaign seed 17,
    --cluster). Only ``lost`` is judged: the call now waits to its deadline, which may make the
    recorded run's short bound of ``available`` fail, as it would for any call left waiting."""
    h = History(recorded, tmp_path / "h")
    expired_though_its_answer_was_stored(h, never_stored=True)
    assert "lost" not in h.judge()


def test_publisher_faults_come_from_a_stream_of_their_own() -> None:
    """Adding publisher faults left every other event of a seed where it was; about one kill and
    one race per 30 s; their kill points are scenario 4's."""
    from reliability.adversary.schedule import PUBLISHER_KILL_POINTS, links, pauses, publishers, random_schedule, skews
    from reliability.scenarios.policy import PUBLISH_POINTS

    assert set(PUBLISHER_KILL_POINTS) == set(PUBLISH_POINTS)
    kinds = ("publisher_kill", "publisher_race")
    for seed in (19, 1905, 7):
        others = [e for e in random_schedule(seed, 90.0) if e.kind not in kinds]
        before = [e for e in random_schedule(seed, 90.0) if e not in publishers(seed, 90.0)]
        assert others == before
        assert pauses(seed, 90.0) + skews(seed, 90.0) + links(seed, 90.0)  # (the other streams still there)
    long = [e.kind for s in range(20) for e in publishers(s, 600.0)]
    per_30s = {k: long.count(k) / (20 * 594.0 / 30.0) for k in kinds}
    assert all(0.7 < rate < 1.3 for rate in per_30s.values()), per_30s


def test_a_race_won_by_the_perturbed_copy_becomes_the_trainers_lineage(tmp_path: Path) -> None:
    from harness.weights import write_base_checkpoint
    from reliability.adversary.trainer_weights import TrainerWeights
    from reliability.adversary.truth import tensors_key

    w = TrainerWeights(write_base_checkpoint(tmp_path / "base"), SEED)
    won = w.adopting({3: 77})
    assert tensors_key(w.candidate(3, 77)) != tensors_key(w.at(3))
    assert tensors_key(won.at(3)) == tensors_key(w.candidate(3, 77))
    assert tensors_key(won.at(2)) == tensors_key(w.at(2))  # earlier versions as they were
    assert tensors_key(won.at(4)) != tensors_key(w.at(4))  # later ones build on the winner's bytes
    assert won.adopting({}).adopted == {} and tensors_key(won.adopting({}).at(4)) == tensors_key(w.at(4))


def _keyed_answer(h: History, *kinds: str) -> tuple[dict[str, Any], dict[str, Any]]:
    """A plain call of one of those constraint kinds, the first kind found first (not resumed, its
    key asked once) answered with a result whose every token a keyed echo worker made: (its
    submit, its answer). (A 10 s run under a loaded machine may answer a single plain call of a
    kind, or none: a mutation that needs only a lower bound takes a ``min`` or a ``staleness`` one.)"""
    calls = h.calls()
    keys = [c["key"] for c in calls.values()]
    echo = {w["worker_id"] for w in h.doc["timeline"]["workers"] if w["engine"] == "echo"}
    found = [r for r in h.answers() if (calls[r["rid"]].get("req") or {}).get("kind") in kinds]
    for r in sorted(found, key=lambda r: kinds.index(calls[r["rid"]]["req"]["kind"])):
        req = calls[r["rid"]].get("req") or {}
        if (
            req.get("retry") != "resume"
            and r.get("token_ids")
            and keys.count(r["key"]) == 1
            and r["worker_id"] in echo
            and not r.get("forged_tokens")
            and not r.get("client")  # (the trainer's own: a gateway's answer carries no finished_at)
        ):
            return calls[r["rid"]], r
    raise AssertionError(f"the recorded run has no {' or '.join(kinds)} answer made by a keyed echo worker")


def _relabel(h: History, submit: dict[str, Any], answer: dict[str, Any], version: int) -> None:
    """Every copy of the answer labelled ``version``, with the tokens the trainer's bytes at that
    version make (a consistent lie: only a rule about which versions exist can tell)."""
    from reliability.adversary.trainer_weights import TrainerWeights
    from reliability.adversary.truth import tensors_key
    from rollfleet.workers.engines.keyed import VOCAB, keyed_tokens

    payload = submit["req"]["payload"]
    key = tensors_key(TrainerWeights(h.dir / "base", SEED).at(version))
    ids = [
        keyed_tokens(key, payload["prompt"], len(t), seed=payload.get("seed"), sample=i, vocab=VOCAB)
        for i, t in enumerate(answer["token_ids"])
    ]
    digest = tokens_digest([SimpleNamespace(token_ids=t) for t in ids])
    # (its replay coordinate lists the version, with the trainer's content digest of its bytes)
    listed = [[version, TrainerWeights(h.dir / "base", SEED).content_digest(version).hex()]]
    job = answer["job_id"]
    for r in [*h.answers(), *h.doc["finals"].values(), *(x for x in h.trainer if x.get("ev") == "reask")]:
        if r.get("kind") == "result" and r.get("job_id") == job:
            r.update(token_ids=ids, tokens=digest, version_start=version, version_end=version)
            r["spans"] = [[[version, 0, len(t)]] for t in ids]
            if r.get("replay"):
                r["replay"] = {**r["replay"], "versions": listed}
    for p in h.tap["published"]:
        if p.get("job_id") == job and p.get("kind") == "result":
            p["digest"] = digest
            if p.get("desc"):
                p["desc"].update(tokens=digest, version_start=version, version_end=version)
                if p["desc"].get("replay"):
                    p["desc"]["replay"] = {**p["desc"]["replay"], "versions": listed}


def _kill_fact(version: int, point: str, t_start: float, t_end: float, committed: bool) -> dict[str, Any]:
    name = f"killed-v{version}-0"
    return {
        "kind": "kill",
        "version": version,
        "point": point,
        "publisher": name,
        "pid": 1,
        "code": -9,
        "t_start": t_start,
        "t_end": t_end,
        "latest_before": version - 1,
        "latest_after": version if committed else version - 1,
        "entry_publisher": name if point.startswith("commit:") else None,
        "error": None,
    }


def _finished(h: History, answer: dict[str, Any]) -> float:
    """When ``answer`` was finished, on the harness's clock: its first publication the wiretap saw
    (its own ``finished_at`` is the worker's clock, which a ``skew`` event moves by up to 2 s)."""
    seen = [float(p["t"]) for p in h.tap["published"] if p.get("job_id") == answer["job_id"]]
    return min(seen) if seen else float(answer["finished_at"])


def _killed_publisher(h: History, point: str, *, started_after_s: float | None = None) -> dict[str, Any]:
    """A publisher of the version after the run's last commit SIGKILLed at ``point`` (the KV read
    right after: ``latest`` at N only past the CAS); a min answer relabelled with that version.
    ``started_after_s``: that publisher began this long after the answer was finished."""
    commits = h.doc["timeline"]["commits"]
    version = max(int(c[0]) for c in commits) + 1
    submit, answer = _keyed_answer(h, "min", "staleness")
    finished = _finished(h, answer)
    t_start = finished - 1.0 if started_after_s is None else finished + started_after_s
    t_end = max([float(r["t"]) for r in h.trainer if "t" in r] + [t_start]) + 30.0  # (after every constraint)
    fact = _kill_fact(version, point, t_start, t_end, committed=point == "commit:before-announce")
    h.doc["timeline"]["publishers"] = [fact]
    _relabel(h, submit, answer, version)
    return fact


def _raced(h: History, winner: str, codes: dict[str, int] | None = None) -> int:
    """The committed version most answers' spans name (>= 1) was committed by one of two racing
    publishers, not the adversary: the trainer's tensors against a perturbed copy; the KV's
    ``v.<N>`` names ``winner``."""
    spans = [s[0] for r in h.answers() for sample in r.get("spans") or [] for s in sample]
    versions = [v for v in spans if v >= 1]
    assert versions, "the recorded run has no answer labelled past v0"
    version = max(set(versions), key=versions.count)
    commits = h.doc["timeline"]["commits"]
    mine = next(c for c in commits if int(c[0]) == version)
    commits.remove(mine)
    contenders = {"trainer": f"race-v{version}-trainer", "perturbed": f"race-v{version}-perturbed-12345"}
    h.doc["timeline"]["publishers"] = [
        {
            "kind": "race",
            "version": version,
            "salt": 12345,
            "contenders": contenders,
            "pids": {"trainer": 1, "perturbed": 2},
            "codes": codes or {winner: 0, next(k for k in contenders if k != winner): 1},
            "t_start": float(mine[1]),
            "t_end": float(mine[2]),
            "latest_before": version - 1,
            "latest_after": version,
            "entry_publisher": contenders[winner],
            "error": None,
        }
    ]
    return version


@pytest.mark.timeout(240)
@pytest.mark.parametrize("point", ["publish:after-rename", "commit:before-cas"])
def test_a_result_labelled_with_a_version_never_committed_is_flagged(
    point: str, recorded: Path, tmp_path: Path
) -> None:
    h = History(recorded, tmp_path / "h")
    fact = _killed_publisher(h, point)
    found = h.judge()
    never = [m for m in found.get("version", []) if "never committed" in m]
    assert never, f"a result labelled v{fact['version']} (publisher killed at {point}) not flagged: {found}"
    assert point in never[0]
    assert set(found) == {"version"}, found  # (its tokens are those v{N}'s bytes make: nothing else tells)


def _moved_copy(h: History, second_acks: list[str], *, resubmitted: bool = False, lost: bool = False) -> str:
    """A job one replica ran and answered, stored again meanwhile (a client moved it) and delivered
    to another replica, which said ``second_acks`` on its copy (0.004 s, then 0.6 s, after it)
    and claimed and answered nothing: the job's id. ``resubmitted``: the copy is a new submission
    of the key (other bytes), not a move; ``lost``: the broker went back to an older store while
    the copy ran."""
    out = [(a, b) for a, b in h.doc["timeline"]["broker_down"] + h.doc["timeline"].get("broker_paused", [])]
    workers = {d["worker"] for d in h.tap["deliveries"] if d["worker"]}
    by_job: dict[str, list[dict[str, Any]]] = {}
    for d in h.tap["deliveries"]:
        by_job.setdefault(str(d["job_id"]), []).append(d)
    for p in sorted(h.tap["published"], key=lambda p: p["t"]):
        ds = by_job.get(str(p.get("job_id")), [])
        if p.get("kind") != "result" or len(ds) != 1 or ds[0]["worker"] != p.get("worker"):
            continue
        d1, t2 = ds[0], (ds[0]["t"] + p["t"]) / 2
        other = sorted(workers - {d1["worker"]})
        if p["t"] - d1["t"] < 0.8 or not other or any(a <= p["t"] + 1 and b >= d1["t"] - 1 for a, b in out):
            continue
        tokens = d1["ack"].split(".")  # $JS.ACK.<stream>.<consumer>.<delivered>.<stream seq>.<...>
        tokens[5] = str(int(tokens[5]) + 100000)
        ack = ".".join(tokens)
        h.tap["deliveries"].append({**d1, "t": t2, "worker": other[0], "stream_seq": int(d1["stream_seq"]) + 100000,
                                    "ack": ack, "inbox": d1["inbox"] + "-copy", "attempt": 1})  # fmt: skip
        h.tap["acks"][ack] = [[t2 + 0.004 + 0.596 * i, k] for i, k in enumerate(second_acks)]
        if resubmitted:
            h.tap["deliveries"][-1]["submitted_at"] = float(d1["submitted_at"] or d1["t"]) + 16.0
        if lost:
            h.doc["timeline"]["stores_lost"] = [
                {"kind": "rollback", "lost_from": t2 - 0.5, "at": t2 + 0.1, "back": t2 + 0.3}
            ]
        return str(d1["job_id"])
    raise AssertionError("the recorded run has no answer to build a moved copy of")


@pytest.mark.timeout(240)
def test_a_moved_copy_acked_in_progress_then_handed_back_was_not_run_twice(recorded: Path, tmp_path: Path) -> None:
    """Campaign 8, seed 4096: the copy's taker acked progress (+WPI) while it asked whether the
    first holder lived, then handed the copy back (-NAK), claiming and answering nothing: it ran
    nothing. Without the hand-back, the same history is a double run (``moved``)."""
    h = History(recorded, tmp_path / "fine")
    job = _moved_copy(h, ["+WPI", "-NAK"])
    found = h.judge()
    assert not [m for m in found.get("moved", []) if job in m], found
    h = History(recorded, tmp_path / "bad")
    job = _moved_copy(h, ["+WPI"])
    found = h.judge()
    assert [m for m in found.get("moved", []) if job in m], found


@pytest.mark.timeout(240)
def test_a_moved_copy_claimed_only_after_the_first_answer_was_stored_is_unverified_not_moved(
    recorded: Path, tmp_path: Path
) -> None:
    """Campaign 1, seed 24769: a turn moved off a replica whose link to the broker stalled upward;
    the copy's taker watched the stale claim (+WPI), the holder's writes landed when the link
    healed, it stored its answer and released the claim, and the taker claimed the copy 1.77 s
    after that answer, then acked it (+ACK) answering nothing: it found the answer once it held
    the claim. Unverified, never a pass; claimed while the first run still held it, the same
    history is a double run (``moved``)."""
    for name, after_the_answer in (("fine", True), ("bad", False)):
        h = History(recorded, tmp_path / name)
        job = _moved_copy(h, [])
        copy = h.tap["deliveries"][-1]
        answer = min((p for p in h.tap["published"] if p.get("job_id") == job), key=lambda p: p["t"])
        key = claim_key(job)
        # (after the first holder's own claim writes and its release, if the job is claimed)
        since = max([float(answer["t"]), *(float(c[0]) for c in h.tap["claims"] if c[1] in (job, key))])
        claimed = since + 0.5 if after_the_answer else float(copy["t"]) + 0.1
        h.tap["claims"].append([claimed, key, f"{copy['worker']}:4242-feedface@{claimed:.3f}", "PUT", "stored"])
        h.tap["claims"].append([claimed + 0.3, key, "", "DEL", "stored"])
        h.tap["acks"][copy["ack"]] = [[float(copy["t"]) + 0.004, "+WPI"], [claimed + 0.3, "+ACK"]]
        found = h.judge()
        moved = [m for m in found.get("moved", []) if job in m]
        if after_the_answer:
            assert not moved, found
            oracle = load_kept(h.dir)
            oracle.judge()
            assert oracle.unverified.get(f"moved: {CLAIMED_AFTER_THE_ANSWER}") == 1, dict(oracle.unverified)
        else:
            assert moved, found


@pytest.mark.timeout(240)
@pytest.mark.parametrize("why", ["resubmitted", "lost"])
def test_a_second_run_that_is_not_a_move_is_not_flagged_as_one(why: str, recorded: Path, tmp_path: Path) -> None:
    """Campaign 9: seed 64, a restarted trainer asked its key again past the duplicate window while
    the first job ran (other bytes, the same id); seed 389, a rollback took the copy's claim and
    answer and the broker delivered the job again. Neither is a client's move."""
    h = History(recorded, tmp_path / "h")
    job = _moved_copy(h, ["+WPI"], resubmitted=why == "resubmitted", lost=why == "lost")
    found = h.judge()
    assert not [m for m in found.get("moved", []) if job in m], found


@pytest.mark.timeout(240)
def test_a_commit_a_broker_rollback_may_have_taken_is_unverified_not_never_committed(
    recorded: Path, tmp_path: Path
) -> None:
    """Campaign 8, seed 21: a racer committed v16, replicas activated and served it, and 50 ms
    later the broker went back to a copy of its store 1.25 s older; the KV read after the race
    showed v15. A result labelled with a version whose publisher ran while the broker lost its
    store is unverified (the commit is a fact the store took), never ``never committed``; its
    tokens are still recomputed (``served``)."""
    h = History(recorded, tmp_path / "h")
    fact = _killed_publisher(h, "commit:before-announce")
    fact["latest_after"] = fact["version"] - 1  # (the KV as read after the rollback)
    t = float(fact["t_start"]) + 0.5
    h.doc["timeline"]["stores_lost"] = [{"kind": "rollback", "lost_from": t - 1.25, "at": t, "back": t + 1.5}]
    found = h.judge()
    assert not [m for m in found.get("version", []) if "never committed" in m], found
    assert "served" not in found, found
    oracle = load_kept(h.dir)
    oracle.judge()
    assert any("lost with the broker's store" in k and k.startswith("version") for k in oracle.unverified)


@pytest.mark.timeout(240)
def test_a_version_committed_by_a_killed_publisher_is_committed(recorded: Path, tmp_path: Path) -> None:
    """Killed past the commit boundary (before the announcement): the KV's latest is N, so N was
    committed, and a result labelled N is fine; labelled N but finished before N's publisher
    began is not."""
    h = History(recorded, tmp_path / "h")
    _killed_publisher(h, "commit:before-announce")
    assert h.judge() == {}
    h = History(recorded, tmp_path / "h2")
    _killed_publisher(h, "commit:before-announce", started_after_s=5.0)
    found = h.judge()
    assert any("committed only" in m for m in found.get("version", [])), found


@pytest.mark.timeout(240)
def test_tokens_of_the_race_loser_are_flagged(recorded: Path, tmp_path: Path) -> None:
    """The KV says the perturbed publisher won v<N>, but the replicas served the trainer's bytes
    (the loser's) as N: ``served`` recomputes them from the winner's bytes and flags them."""
    h = History(recorded, tmp_path / "h")
    version = _raced(h, "perturbed")
    found = h.judge()
    assert any(f"labelled v{version}" in m for m in found.get("served", [])), found


@pytest.mark.timeout(240)
def test_a_race_won_by_the_trainers_publisher_passes(recorded: Path, tmp_path: Path) -> None:
    h = History(recorded, tmp_path / "h")
    _raced(h, "trainer")
    assert h.judge() == {}


@pytest.mark.timeout(240)
def test_two_publishers_both_reporting_they_won_a_race_is_flagged(recorded: Path, tmp_path: Path) -> None:
    h = History(recorded, tmp_path / "h")
    _raced(h, "trainer", codes={"trainer": 0, "perturbed": 0})
    found = h.judge()
    assert any("exited reporting success" in m for m in found.get("version", [])), found


@pytest.mark.timeout(240)
@pytest.mark.parametrize("lost", [True, False])
def test_a_race_whose_commit_the_store_lost_is_not_a_false_success(lost: bool, recorded: Path, tmp_path: Path) -> None:
    """The perturbed publisher committed v<N> and exited 0, then the broker went back to a copy of
    its store from before the commit: the KV names neither contender. Not judged then (the
    promise ends with the store); without the loss, the same facts are a false success."""
    h = History(recorded, tmp_path / "h")
    version = _raced(h, "perturbed")
    race = h.doc["timeline"]["publishers"][0]
    race.update(entry_publisher=None, latest_after=version - 1)
    if lost:
        _lost(h, "rollback", float(race["t_start"]) - 1.0, float(race["t_end"]) + 0.5)
    false_success = [m for m in h.judge().get("version", []) if "exited reporting success" in m]
    assert bool(false_success) is not lost, false_success


@pytest.mark.timeout(240)
@pytest.mark.parametrize("first_copy_seen", [False, True])
def test_a_result_of_a_job_stored_twice_is_judged_per_copy(
    first_copy_seen: bool, recorded: Path, tmp_path: Path
) -> None:
    """A restarted trainer stored the same job again: a second message, whose deliveries count
    from 1 again. The wiretap saw the second copy's first delivery go to another worker, and the
    first copy's second one, but missed the first copy's first: the result (attempt 1) may have
    run on that one, so it is not judged (seed 101 of the campaign of 2026-12-04 was flagged so).
    Seen going elsewhere too, it is flagged."""
    h = History(recorded, tmp_path / "h")
    _submit, answer = _once_delivered(h, "replayable", convert=True)
    first = next(d for d in h.tap["deliveries"] if d["job_id"] == answer["job_id"])
    other = next(d["worker"] for d in h.tap["deliveries"] if d["worker"] not in (None, answer["worker_id"]))
    h.tap["deliveries"].remove(first)
    h.tap["deliveries"].append({**first, "stream_seq": first["stream_seq"] + 100_000, "worker": other})
    # The first copy was seen delivered again later (a second attempt), its first delivery not.
    h.tap["deliveries"].append({**first, "worker": other, "attempt": 2, "t": first["t"] + 1.0})
    if first_copy_seen:
        h.tap["deliveries"].append({**first, "worker": other})
    h.tap["stored_jobs"][answer["job_id"]] = 2
    flagged = [m for m in h.judge().get("delivered", []) if answer["job_id"] in m]
    assert bool(flagged) is first_copy_seen, flagged


@pytest.mark.timeout(240)
@pytest.mark.parametrize("rolled_back", [True, False])
def test_a_delivery_counted_again_after_a_rollback_is_not_flagged(
    rolled_back: bool, recorded: Path, tmp_path: Path
) -> None:
    """The result ran on a delivery (attempt 1) the wiretap missed; the broker then went back to a
    copy of its store from before that delivery, and delivered the job again as attempt 1 to
    another worker (seed 123 of the campaign of 2026-12-04, with the bucket store). Without the
    rollback, two first deliveries to two workers are flagged."""
    h = History(recorded, tmp_path / "h")
    _submit, answer = _once_delivered(h, "replayable", convert=True)
    first = next(d for d in h.tap["deliveries"] if d["job_id"] == answer["job_id"])
    other = next(d["worker"] for d in h.tap["deliveries"] if d["worker"] not in (None, answer["worker_id"]))
    finished = _finished(h, answer)
    # The oracle dates the run by the worker's own clock, less its known skew (up to 2 s); the
    # loss spans both that and the wiretap's times, and the delivery after it comes later still
    # (a recorded run whose worker's clock ran 1.3 s ahead fell outside a 1 s window).
    own = float(answer["finished_at"])
    h.tap["deliveries"].remove(first)
    h.tap["deliveries"].append({**first, "worker": other, "t": max(finished, own) + 5.0})
    if rolled_back:
        _lost(h, "rollback", min(float(first["t"]), own) - 2.5, max(finished, own) + 2.5)
    flagged = [m for m in h.judge().get("delivered", []) if answer["job_id"] in m]
    assert bool(flagged) is not rolled_back, flagged


# -- the broker's store lost (broker_rollback, broker_wipe, delete_stream): exempt exactly what it took --


def _lost(h: History, kind: str, lost_from: float, at: float, target: str | None = None) -> None:
    """A store loss in the timeline (``Timeline.stores_lost``), as ``reliability.adversary.broker_store``
    records one."""
    loss = {"kind": kind, "lost_from": lost_from, "at": at, "back": at + 0.5}
    h.doc["timeline"].setdefault("stores_lost", []).append({**loss, **({"target": target} if target else {})})


def _reasked_result(h: History) -> tuple[str, float]:
    """The key ``second_answer_for_a_key`` changes, and when the wiretap saw its answer published."""
    finals = h.doc["finals"]
    key = next(k for k, f in sorted(finals.items()) if f.get("kind") == "result")
    seen = [float(p["t"]) for p in h.tap["published"] if p.get("job_id") == finals[key]["job_id"]]
    assert seen, "the wiretap did not see the re-asked answer published"
    return key, min(seen)


def _lost_before_the_reask(h: History, key: str, seen: float) -> float:
    """When a store loss that took the answer published at ``seen`` ends (the broker back): half a
    second later, or halfway to the fresh client's re-ask if that came sooner (a loss the re-ask
    came before did not take what it read)."""
    return seen + min(0.5, (float(h.doc["finals"][key]["t"]) - seen) / 2)


@pytest.mark.timeout(240)
def test_a_second_answer_after_the_store_lost_the_first_is_not_flagged(recorded: Path, tmp_path: Path) -> None:
    """The broker went back to a copy of its store taken before the answer was stored (or wiped it,
    or the results stream was deleted), so a re-ask after that gets another answer or none: the
    promise of one answer per key ends there, by design."""
    losses = (("rollback", None), ("wipe", None), ("delete_stream", "results"))
    cases = [(kind, target, False) for kind, target in losses]
    # The answer published under another client's subject than the key's first caller (a key the
    # trainer also sent over a gateway): it is dated by its job id all the same, not by when the
    # job was stored, seconds earlier, which would put it before the rollback's copy.
    cases.append(("rollback", None, True))
    for i, (kind, target, elsewhere) in enumerate(cases):
        h = History(recorded, tmp_path / f"h{i}")
        key, seen = _reasked_result(h)
        if elsewhere:
            job = h.doc["finals"][key]["job_id"]
            for p in h.tap["published"]:
                if p.get("job_id") == job:
                    head, tail = p["subject"].split(".results.", 1)
                    client, rest = tail.split(".", 1)
                    p["subject"] = f"{head}.results.{client}-elsewhere.{rest}"
        back = _lost_before_the_reask(h, key, seen)
        second_answer_for_a_key(h)
        _lost(h, kind, 0.0 if kind != "rollback" else seen - 1.0, back, target)
        assert h.judge() == {}, (kind, elsewhere)


@pytest.mark.timeout(240)
@pytest.mark.parametrize(
    "window",
    [
        ("rollback", None, 0.5, 2.0),  # the copy was taken after the answer was stored: it survived
        ("rollback", None, -5.0, -1.0),  # the writes lost were older than the answer
        ("delete_stream", "claims", -5.0, 0.5),  # another stream than the results was deleted
        ("delete_stream", "policy", -5.0, 0.5),
    ],
)
def test_a_second_answer_outside_what_the_store_lost_is_flagged(
    window: tuple[str, str | None, float, float], recorded: Path, tmp_path: Path
) -> None:
    kind, target, start, end = window
    h = History(recorded, tmp_path / "h")
    _key, seen = _reasked_result(h)
    second_answer_for_a_key(h)
    _lost(h, kind, seen + start, seen + end, target)
    assert "once" in h.judge()


def _claim_lost_then_another_holder(h: History) -> tuple[float, float]:
    """An at_most_once job claimed by another process shortly before its (real) holder claimed it:
    (when that other claim was written, when the real holder first claimed)."""
    _submit, answer = _at_most_once_call(h)
    key = claim_key(answer["job_id"])
    first = min(float(c[0]) for c in h.tap["claims"] if c[1] == key and c[4] == "stored")
    other = first - 1.0
    h.tap["claims"].append([other, key, f"w8:4001-0badc1a1@{other:.3f}", "PUT", "stored"])
    return other, first


@pytest.mark.timeout(240)
def test_a_claim_the_store_lost_is_not_a_second_start(recorded: Path, tmp_path: Path) -> None:
    h = History(recorded, tmp_path / "h")
    other, first = _claim_lost_then_another_holder(h)
    _lost(h, "delete_stream", 0.0, (other + first) / 2, "claims")  # the claims bucket deleted between
    assert h.judge() == {}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("which", ["lost-after-the-second-claim", "results-deleted", "rollback-copy-after-the-claim"])
def test_a_claim_the_store_kept_is_still_a_second_start(which: str, recorded: Path, tmp_path: Path) -> None:
    h = History(recorded, tmp_path / "h")
    other, first = _claim_lost_then_another_holder(h)
    if which == "lost-after-the-second-claim":
        _lost(h, "delete_stream", 0.0, first + 0.2, "claims")
    elif which == "results-deleted":
        _lost(h, "delete_stream", 0.0, (other + first) / 2, "results")
    else:
        _lost(h, "rollback", other + 0.4, other + 0.6)  # the copy, taken after the claim, holds it
    assert "twice" in h.judge()


def _stored_again_and_delivered_elsewhere(h: History, taker_lives_s: float | None) -> str:
    """A result's job stored again (a sticky turn moved off its replica) and the copy delivered to
    another replica, w7, 0.1 s after the holder took the job and before it finished it; w7 says
    nothing on the copy, claims nothing and answers nothing. Its process ends ``taker_lives_s``
    after the delivery (SIGKILLed at a fault point, say), or lives on (None). The job's id."""
    _submit, answer = _once_delivered(h, "replayable", convert=True)
    first = next(d for d in h.tap["deliveries"] if d["job_id"] == answer["job_id"])
    at = float(first["t"]) + 0.1
    h.doc["timeline"]["workers"].append(
        {
            "worker_id": "w7",
            "engine": "echo",
            "start": at - 5.0,
            "end": None if taker_lives_s is None else at + taker_lives_s,
            "paused_at": None,
            "how": "running" if taker_lives_s is None else "killed",
            "armed": None,
            "stops": [],
            "skew_s": 0.0,
        }
    )
    copy = {**first, "t": at, "stream_seq": first["stream_seq"] + 100_000, "worker": "w7", "ack": first["ack"] + "x"}
    h.tap["deliveries"].append(copy)
    h.tap["stored_jobs"][answer["job_id"]] = 2
    return str(answer["job_id"])


@pytest.mark.timeout(240)
@pytest.mark.parametrize("taker", ["killed", "alive"])
def test_a_moved_copy_whose_taker_was_refused_its_claim_and_killed_is_not_a_second_run(
    taker: str, recorded: Path, tmp_path: Path
) -> None:
    """A sticky turn moved off its frozen replica (SIGSTOP) was delivered to a replica that tried
    to claim it, was refused (the frozen holder's claim stood), acked progress (+WPI) while it
    watched that claim, and was SIGKILLed 0.9 s later; the first holder woke and finished it. The
    taker claimed nothing and answered nothing: it ran nothing, so no double run (unverified: what
    a killed process did with a copy it held is unseen). A taker that lived on and never let go
    of the copy, or answered it, is still judged."""
    h = History(recorded, tmp_path / "h")
    job = _stored_again_and_delivered_elsewhere(h, 0.9 if taker == "killed" else None)
    copy = h.tap["deliveries"][-1]
    at = float(copy["t"])
    h.tap["claims"].append([at + 0.01, claim_key(job), f"w7:4007-0badc1a7@{at:.3f}", "PUT", "refused"])
    h.tap["acks"][copy["ack"]] = [[at + 0.02, "+WPI"], [at + 0.6, "+WPI"]]
    moved = [m for m in h.judge().get("moved", []) if job in m]
    assert bool(moved) is (taker == "alive"), moved


@pytest.mark.timeout(240)
@pytest.mark.parametrize("taker", ["killed at once", "silent", "claimed it"])
def test_a_moved_copy_whose_taker_never_claimed_it_is_not_a_second_run(
    taker: str, recorded: Path, tmp_path: Path
) -> None:
    """Campaign seeds 11 and 64: a turn moved off its frozen (or cut off) replica was delivered to a
    replica held at a fault point, which said nothing on it, claimed nothing and answered nothing;
    the first holder finished it. Nothing ran it twice, whether the taker was SIGKILLed 0.06 s
    later or lived on. A taker that claimed the copy (a job is claimed before it runs) ran it."""
    h = History(recorded, tmp_path / "h")
    job = _stored_again_and_delivered_elsewhere(h, 0.06 if taker == "killed at once" else None)
    if taker == "claimed it":
        at = max(float(d["t"]) for d in h.tap["deliveries"] if d["job_id"] == job) + 0.05
        h.tap["claims"].append([at, claim_key(job), f"w7:4007-0badc1a7@{at:.3f}", "PUT", "stored"])
    moved = [m for m in h.judge().get("moved", []) if job in m]
    assert bool(moved) is (taker == "claimed it"), moved


@pytest.mark.timeout(240)
def test_a_resubmit_answered_with_the_pending_handle_is_a_job_the_store_lost(recorded: Path, tmp_path: Path) -> None:
    """Seed 3 of a campaign: a key asked again after the broker's store was wiped got the pending
    handle back (the job stored and delivered before the wipe, the same sequence): that job was
    lost with the store, and it is answered Expired by design, not stranded."""
    h = History(recorded, tmp_path / "h")
    submit, answer = _once_delivered(h, "replayable", convert=True)
    stored = next(r for r in h.trainer if r.get("ev") == "stored" and r["rid"] == submit["rid"])
    wiped = float(stored["t"]) + 0.5
    deadline = stored["deadline"] = float(stored["t"]) + 30.0  # (long enough to wait past STARVE_S)
    again = {**submit, "rid": submit["rid"] + "-again", "op": "resubmit", "t": wiped + 1.0}
    h.trainer += [again, {**stored, "rid": again["rid"], "op": "resubmit", "t0": wiped + 1.0, "t": wiped + 1.0}]
    # Nobody ran it: the stored job and its answer went with the wipe; every call for the key expired.
    h.tap["published"] = [p for p in h.tap["published"] if p.get("job_id") != answer["job_id"]]
    h.doc["finals"].pop(answer["key"], None)
    for r in (answer, {"rid": again["rid"], "key": answer["key"], "t0": wiped + 1.0, "inc": answer["inc"]}):
        expired = {"ev": "answer", "op": "resubmit", **r, "t": deadline + 0.5}
        _error(expired, "Expired", "expired")
        if r is answer:
            answer.clear()
            answer.update(expired)
        else:
            h.trainer.append(expired)
    _lost(h, "wipe", 0.0, wiped)
    assert "stranded" not in h.judge()


@pytest.mark.timeout(240)
@pytest.mark.parametrize("holder_seen", [True, False])
def test_an_exact_job_its_holder_runs_past_its_versions_last_replica_is_not_orphaned(
    holder_seen: bool, recorded: Path, tmp_path: Path
) -> None:
    """Campaign seed 11: an exact job delivered to a replica that then drained (SIGTERM), finishing
    it 23.9 s later while no replica took jobs at its version any more. A job its holder runs is
    not orphaned. With no holder seen, the same history is: nobody could serve it, and its answer
    came long after the client's orphan grace."""
    h = History(recorded, tmp_path / "h")
    calls = h.calls()
    keys = [c["key"] for c in calls.values()]
    workers = h.doc["timeline"]["workers"]
    found = []
    for r in h.answers():
        seen = [d for d in h.tap["deliveries"] if d["job_id"] == r["job_id"]]
        if not (r.get("spans") and keys.count(r["key"]) == 1 and r["key"] not in h.cancelled and len(seen) == 1):
            continue
        d, late = seen[0], float(seen[0]["t"]) + 12.0
        mine = [w for w in workers if w["worker_id"] == d["worker"]]
        life = next((w for w in mine if w["start"] <= d["t"] and (w["end"] is None or d["t"] < w["end"])), None)
        if life is None or r.get("client") or any(d["t"] < w["start"] <= late + 1.0 for w in mine):
            continue
        if not any(x.get("ev") == "stored" and x.get("rid") == r["rid"] for x in h.trainer):
            continue  # (answered from an answer stored before, with no job of its own stored)
        found.append((calls[r["rid"]].get("req") or {}, r, d, life))
    assert found, "the recorded run has no answer delivered once to a replica that lived on"
    req, answer, delivery, life = next((f for f in found if f[0].get("kind") == "exact"), found[0])
    if req.get("kind") != "exact":  # (a short run may have answered no exact job whole: one becomes one)
        req.update(kind="exact", value=answer["version_start"])
        delivery["constraint"] = ["exact", answer["version_start"]]
        for r in h.trainer:
            if r.get("ev") == "stored" and r["rid"] == answer["rid"]:
                r["constraint"] = ["exact", answer["version_start"]]
    life["end"] = None  # (its holder lives on past the answer)
    found = (answer, delivery)
    answer, delivery = found
    t0 = float(delivery["t"])
    late = t0 + 12.0  # past the orphan bound (8 s) after every replica stopped taking jobs
    # From just after the delivery every replica drains: none takes a job at the job's version.
    last: dict[str, Any] = {}
    for t, w, status in sorted(h.tap["fleet"], key=lambda f: f[0]):
        if status and t <= t0:
            last[w] = status
    h.tap["fleet"] = [f for f in h.tap["fleet"] if f[0] <= t0]
    h.tap["fleet"] += [[t0 + 0.1, w, {**status, "state": "draining"}] for w, status in last.items()]
    stored = next(r for r in h.trainer if r.get("ev") == "stored" and r["rid"] == answer["rid"])
    stored["deadline"] = late + 30.0
    answer["t"] = late
    for p in h.tap["published"]:
        if p.get("job_id") == answer["job_id"]:
            p["t"] = late - 0.05
    if holder_seen:  # it acked progress as it ran, and the job when it stored the answer
        h.tap["acks"][delivery["ack"]] = [[t0 + 0.3 * i, "+WPI"] for i in range(1, 40)] + [[late, "+ACK"]]
    else:
        h.tap["deliveries"].remove(delivery)
        h.tap["acks"].pop(delivery["ack"], None)
    orphaned = [m for m in h.judge().get("orphan", []) if m.startswith(f"{answer['key']}: ")]
    assert bool(orphaned) is not holder_seen, orphaned


def _answered_interrupted_then_asked_again(h: History) -> tuple[str, float]:
    """A call answered ``Interrupted`` (stored as the key's failure answer), and a fresh client's
    re-ask at the end that found nothing stored: (its key, when the failure was stored)."""
    _submit, answer = _once_delivered(h, "replayable", convert=True)
    key, job = answer["key"], answer["job_id"]
    stored = min(float(p["t"]) for p in h.tap["published"] if p.get("job_id") == job)
    h.tap["published"] = [p for p in h.tap["published"] if p.get("job_id") != job]
    h.tap["published"].append(
        {"t": stored, "subject": f"rf.adv.results.trainer.x.{job}.w1", "kind": "failure", "key": key,
         "job_id": job, "worker": "w1", "digest": "0" * 16, "code": "interrupted"}
    )  # fmt: skip
    _error(answer, "Interrupted", "interrupted")
    h.doc["finals"][key] = {"kind": "timeout", "t": float(h.doc["finals"].get(key, {}).get("t") or stored + 5.0)}
    return key, stored


@pytest.mark.timeout(240)
@pytest.mark.parametrize("wiped", [True, False])
def test_a_failure_answer_the_store_lost_is_not_a_second_answer(wiped: bool, recorded: Path, tmp_path: Path) -> None:
    """Campaign seed 2718: a call answered Interrupted, its stored failure answer then lost with a
    wipe of the broker's store; the fresh client's re-ask at the end found nothing. The promise of
    one answer per key ends with the store that held it. Without the wipe, it is a second answer."""
    h = History(recorded, tmp_path / "h")
    key, stored = _answered_interrupted_then_asked_again(h)
    assert key in h.doc["finals"]
    if wiped:
        _lost(h, "wipe", 0.0, stored + 0.2)
    once = [m for m in h.judge().get("once", []) if "returned timeout" in m]
    assert bool(once) is not wiped, once


@pytest.mark.timeout(240)
@pytest.mark.parametrize("lost", [True, False])
def test_a_call_whose_job_the_store_lost_is_not_unserved_asking(lost: bool, recorded: Path, tmp_path: Path) -> None:
    """Campaign seed 2718: two calls whose jobs were lost when the jobs stream was deleted waited,
    by design, for their deadlines (answered Expired a minute later) while the fleet idled: that is
    no stop of service. A call whose job the store kept, waiting as long unserved, is one."""
    h = History(recorded, tmp_path / "h")
    submit, answer = _once_delivered(h, "replayable", convert=True)
    stored = next(r for r in h.trainer if r.get("ev") == "stored" and r["rid"] == submit["rid"])
    end = max(float(r["t"]) for r in h.trainer) + 30.0  # long after the run's last answer
    stored["deadline"] = end - 0.5
    h.tap["published"] = [p for p in h.tap["published"] if p.get("job_id") != answer["job_id"]]
    h.tap["deliveries"] = [d for d in h.tap["deliveries"] if d["job_id"] != answer["job_id"]]
    h.doc["finals"].pop(answer["key"], None)
    _error(answer, "Expired", "expired")
    answer["t"] = end
    if lost:
        _lost(h, "delete_stream", 0.0, float(stored["t"]) + 0.5, "jobs")
    unserved = [m for m in h.judge().get("available", []) if "nothing was served" in m]
    assert bool(unserved) is not lost, unserved


@pytest.mark.timeout(240)
@pytest.mark.parametrize("processes", [1, 2])
def test_sealed_claims_refreshed_by_one_process_are_one_holder(processes: int, recorded: Path, tmp_path: Path) -> None:
    """Campaign seed 778: a resumable job's claim is sealed (``<holder>#<mac>@<time>``) and its MAC
    changes with every refresh; one process refreshing it is one holder, not two. Two processes
    sealing claims of the job with no hand-back between started it twice."""
    h = History(recorded, tmp_path / "h")
    _submit, answer = _at_most_once_call(h, convert=True)
    key, t = claim_key(answer["job_id"]), max(float(c[0]) for c in h.tap["claims"]) + 1.0
    holders = ["w8:4001-0badc1a1", "w8:4001-0badc1a1" if processes == 1 else "w9:4002-0badc1a2"]
    for i, (holder, mac) in enumerate(zip(holders, ("6e0c7a", "d41f09"), strict=True)):
        h.tap["claims"].append([t + i, key, f"{holder}#{mac}@{t + i:.3f}", "PUT", "stored"])
    twice = [m for m in h.judge().get("twice", []) if answer["job_id"] in m]
    assert bool(twice) is (processes == 2), twice


@pytest.mark.timeout(240)
@pytest.mark.parametrize("losses", [2, 1])
def test_runs_each_after_a_store_loss_took_the_last_ones_answer_are_not_twice(
    losses: int, recorded: Path, tmp_path: Path
) -> None:
    """Campaign broker-stores seed 3: an at_most_once key asked again after the results stream was
    deleted ran again, and again after a wipe: three runs, each after the last one's answer was
    lost. With the second loss missing, the second and third runs are two runs of one job."""
    h = History(recorded, tmp_path / "h")
    _submit, answer = _at_most_once_call(h, convert=True)
    first = next(p for p in h.tap["published"] if p.get("job_id") == answer["job_id"] and p.get("desc"))
    t = float(first["t"])
    for i, worker in enumerate(("w8", "w9"), start=1):
        at = t + 10.0 * i
        h.tap["published"].append({**first, "t": at, "worker": worker, "desc": {**first["desc"], "finished_at": at}})
    _lost(h, "delete_stream", 0.0, t + 5.0, "results")
    if losses == 2:
        _lost(h, "wipe", 0.0, t + 15.0)
    twice = [m for m in h.judge().get("twice", []) if answer["job_id"] in m and "generated" in m]
    assert bool(twice) is (losses == 1), twice


def test_a_write_heard_just_after_a_loss_took_effect_was_lost_with_it(recorded: Path) -> None:
    """Campaign 10, seed 41 (``--cluster``): the claims bucket's deletion waited 0.93 s on a paused
    node; the holder's claim writes of that time were heard as it took effect. The loss counts from
    when the deletion returned (``broker_store.delete_stream``), and a write heard within
    ``LOSS_MARGIN_S`` after it was stored before it."""
    from reliability.adversary.oracle import LOSS_MARGIN_S

    oracle = load_kept(recorded)
    at = 1000.0
    oracle.tl.stores_lost = [{"kind": "delete_stream", "target": "claims", "lost_from": 0.0, "at": at, "back": at}]
    assert oracle.lost_with_store(at - 5.0, "claims") is not None
    assert oracle.lost_with_store(at + LOSS_MARGIN_S / 2, "claims") is not None
    assert oracle.lost_with_store(at + 1.0, "claims") is None  # written to the bucket declared again
    assert oracle.lost_with_store(at - 5.0, "results") is None  # another stream's facts


@pytest.mark.timeout(240)
def test_a_withdrawal_the_broker_lost_with_its_store_is_unverified_not_a_lie(recorded: Path, tmp_path: Path) -> None:
    """Campaign seed 1905: cancel() withdrew a queued job 0.66 s after the broker's store was copied;
    the broker then restarted on that copy, where the job still lay, and a replica ran it. The
    withdrawal was lost with the store: unverified. Without the loss, the same history is a lie
    ("withdrawn", yet answered)."""
    for name, lost in (("lost", True), ("kept", False)):
        h = History(recorded, tmp_path / name)
        submit, answer = _once_delivered(h, "replayable", convert=True)
        published = min(float(p["t"]) for p in h.tap["published"] if p.get("job_id") == answer["job_id"])
        asked = max(float(submit["t"]), published - 0.3)  # withdrawn, then run from the older copy
        h.trainer.append({"ev": "cancel", "rid": answer["rid"], "key": answer["key"], "t_asked": asked,
                          "outcome": "withdrawn", "t": asked + 0.01, "inc": answer["inc"]})  # fmt: skip
        _error(answer, "Cancelled", "cancelled")
        if lost:  # (the broker back on a copy taken before the withdrawal, before the job ran)
            _lost(h, "rollback", asked - 0.5, (asked + published) / 2)
        found = h.judge()
        flagged = [m for m in found.get("cancelled", []) if "said withdrawn" in m]
        assert bool(flagged) is not lost, found
