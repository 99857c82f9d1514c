"""The autoscaler's invariants, judged from raw facts (``--autoscale MIN:MAX``, the ``autoscaler``
schedule): the fleet's followers sized by real ``rollfleet autoscale --driver local`` processes.

The facts (``Timeline.autoscale``, gathered by ``reliability.adversary.autoscaler``), never the
controller's own status document or metrics:

- the controller processes the harness started, with their lives, freezes (SIGSTOP), the moment
  each was told to stop (SIGTERM: a clean stop releases the lease) and the bounds on its command
  line;
- the worker processes that existed, found in ``/proc`` by their command lines (and those the
  harness started beside them, ``fixed``: replicas the planner counts too): start (the
  kernel's start time), end, the controller process that was their parent when first seen (who
  launched them), how they ended (SIGKILLed or SIGTERMed by the adversary, retired by a
  controller, or exited on their own) and when they were told to stop;
- each controller's ``autoscale retired`` lines (a SIGTERM it sent, with its time), from its log;
- the lease key's writes as the broker stored them (an ordered consumer on the fleet bucket's
  ``autoscaler.lease``: each stored write with the broker's time stamp, its operation and the
  holder it names), and when that consumer was away;
- the evaluator's requests: exact jobs at a version the followers have left, submitted with
  ``wait_for_replica=True``, and their answers.

The invariants:

- ``fleet-size``: once settled, the worker processes alive and not told to stop number within the
  acting controller's ``[min, max]``. *Settled* at ``t``: over the last ``react_s`` (two of the
  controller's intervals and a slack) one controller process acted throughout (the last lease
  write before each moment is its own, less than half a lease time old, and it is alive and not
  frozen), the broker was up (and ``BROKER_GRACE_S`` before), and the adversary neither killed
  nor SIGTERMed a worker. A worker that exits on its own is no excuse: a crash-looping launch
  leaves the fleet short, and that is a finding. One check per settled stretch.
- ``one-acting``: each action of a controller (a worker it launched: its parent when first seen,
  at its start; a worker it retired: its ``autoscale retired`` line) lies within its lease: the
  last write the broker stored by then names it, and is less than half a lease time (plus
  ``SLACK_S``) older. Between two consecutive actions of different controllers lies at least the
  lease's handover bound, half a lease time (a holder acts only within half a lease time of its
  last renewal, a contender takes over only after a whole one of silence), unless the first was
  stopped cleanly (it released the lease) before the second acted. One check per action.
- ``held-wait``: every waiting request for a held version is answered by its deadline with a
  result made at exactly that version (its tokens recomputed from the trainer's weights where
  the oracle has them), unless no controller acted for ``need_s`` of its wait (then it is not
  verifiable, never passed). One check per request.
- ``scaled-job``: each resumable job run beside a scale-in (the ``scale_in`` event fills every
  follower's slots with them) is answered by its deadline, its spans tiling its tokens, each token
  what its span's version makes, and the same answer comes back when its key is asked again.

No job is lost or answered twice by scaling: the oracle's own ``lost``, ``once``, ``twice`` and
``moved`` judge every job, the scaled workers' included, since those workers are in the
timeline like any other (a retired one as ``terminated``: it drained).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

from reliability.adversary.journal import seed_used

SLACK_S = 0.5  # a log line's or the broker's time stamp against the moment it stands for
STAMP_SLACK_S = 0.2  # the broker's clock, the kernel's start times and the log's against each other
REACT_SLACK_S = 3.0  # besides two intervals: a tick's reads and the harness's look at /proc
SAMPLE_S = 0.25
BROKER_GRACE_S = 5.0  # after a broker outage: the controller reads the registry again
WAIT_SLACK_S = 2.0  # the client's deadline grace
RETIRED = "terminated (retired by "  # a worker's ``how`` once a controller retired it (it drains)
ADVERSARY_ENDS = ("killed", "terminated")  # a worker the adversary SIGKILLed or SIGTERMed


def holder_pid(holder: str | None) -> int | None:
    """The process id in a lease holder's name (``<host>:<pid>``)."""
    if not holder:
        return None
    tail = holder.rsplit(":", 1)[-1]
    return int(tail) if tail.isdigit() else None


def _within(intervals: Iterable[Sequence[float]], t: float) -> bool:
    return any(a <= t <= b for a, b in intervals)


def _alive(life: dict[str, Any], t: float) -> bool:
    return float(life["start"]) <= t and (life.get("end") is None or t < float(life["end"]))


class AutoscaleFacts:
    """The facts of one run, indexed (plain data in: ``Timeline.autoscale``)."""

    def __init__(self, facts: dict[str, Any], broker_out: Sequence[Sequence[float]] = ()) -> None:
        self.facts = facts
        policy = facts.get("policy") or {}
        self.interval_s = float(policy.get("interval_s", 1.0))
        self.ttl_s = float(policy.get("lease_ttl_s", 10.0))
        self.react_s = 2 * self.interval_s + REACT_SLACK_S
        self.need_s = float(policy.get("need_s", 20.0))
        self.controllers: list[dict[str, Any]] = list(facts.get("controllers") or [])
        self.by_pid = {int(c["pid"]): c for c in self.controllers if c.get("pid") is not None}
        self.by_name = {str(c["name"]): c for c in self.controllers}
        self.workers: list[dict[str, Any]] = list(facts.get("workers") or [])
        self.lease = sorted(facts.get("lease") or [], key=lambda r: float(r["t"]))
        self.lease_gaps = [list(g) for g in facts.get("lease_gaps") or []]
        self.broker_out = [list(b) for b in broker_out]

    # -- who acts -----------------------------------------------------------------------------
    def last_write(self, t: float) -> dict[str, Any] | None:
        """The last write of the lease key the broker stored at or before ``t``."""
        out = None
        for r in self.lease:
            if float(r["t"]) > t:
                break
            out = r
        return out

    @staticmethod
    def names(w: dict[str, Any] | None, c: dict[str, Any]) -> bool:
        """Whether a lease write is a PUT naming controller ``c``."""
        return w is not None and str(w.get("op", "PUT")).upper() == "PUT" and holder_pid(w.get("holder")) == c["pid"]

    def acting_at(self, t: float) -> dict[str, Any] | None:
        """The controller process acting at ``t`` by the lease's rules, as the broker stored its
        writes (strictly: its last renewal less than half a lease time old, less the slack), alive
        and not frozen; None when none may act."""
        w = self.last_write(t)
        if w is None or str(w.get("op", "PUT")).upper() != "PUT":
            return None
        c = self.by_pid.get(holder_pid(w.get("holder")) or -1)
        if c is None or not _alive(c, t) or _within(c.get("stops") or [], t):
            return None
        if t - float(w["t"]) >= self.ttl_s / 2 - SLACK_S:
            return None
        return c

    def broker_quiet(self, t: float) -> bool:
        return not any(a <= t <= b + BROKER_GRACE_S for a, b in self.broker_out)

    # -- the fleet ------------------------------------------------------------------------------
    def counted(self, t: float) -> list[dict[str, Any]]:
        """Worker processes alive at ``t`` and not told to stop (draining replicas are leaving)."""
        return [
            w
            for w in self.workers
            if _alive(w, t) and not (w.get("leaving_at") is not None and float(w["leaving_at"]) <= t)
        ]

    def disturbances(self) -> list[float]:
        """Moments the adversary took a worker away (SIGKILL, SIGTERM): the fleet is short until the
        acting controller's next tick replaces it. A retirement by a controller is no disturbance,
        nor is a worker that exits on its own (a finding when it leaves the fleet short)."""
        out = []
        for w in self.workers:
            how = str(w.get("how") or "")
            if how.startswith(RETIRED):
                continue
            if w.get("leaving_at") is not None:
                out.append(float(w["leaving_at"]))
            elif w.get("end") is not None and how.startswith(ADVERSARY_ENDS):
                out.append(float(w["end"]))
        return sorted(out)

    def settled_stretches(self, t0: float, t1: float) -> list[tuple[float, float, dict[str, Any]]]:
        """Maximal stretches of ``[t0, t1]`` in which the fleet is settled, each with the controller
        acting throughout (its bounds are the ones judged)."""
        hits = self.disturbances()
        out: list[tuple[float, float, dict[str, Any]]] = []
        since: float | None = None  # since when the same controller acts, the broker quiet
        who: dict[str, Any] | None = None
        cur: list[Any] | None = None
        t = t0
        while t <= t1:
            c = self.acting_at(t)
            if c is None or not self.broker_quiet(t):
                since, who = None, None
            elif who is None or c is not who:
                since, who = t, c
            calm = since is not None and t - since >= self.react_s
            calm = calm and not any(t - self.react_s < h <= t for h in hits)
            if calm and who is not None:
                if cur is not None and cur[2] is who and t - cur[1] <= SAMPLE_S * 1.5:
                    cur[1] = t
                else:
                    cur = [t, t, who]
                    out.append(cur)  # type: ignore[arg-type]
            t += SAMPLE_S
        return [(a, b, c) for a, b, c in out]


def check_fleet_size(
    f: AutoscaleFacts,
    t0: float,
    t1: float,
    check: Callable[[str, bool, str | None, str], bool],
    at: Callable[[float], str],
) -> float:
    """``fleet-size``; returns the settled seconds judged."""
    settled = 0.0
    for a, b, c in f.settled_stretches(t0, t1):
        settled += b - a
        lo, hi = (int(x) for x in c["bounds"])
        bad: tuple[float, list[dict[str, Any]]] | None = None
        t = a
        while t <= b:
            n = f.counted(t)
            if not lo <= len(n) <= hi:
                bad = (t, n)
                break
            t += SAMPLE_S
        if bad is None:
            check("fleet-size", True, None, "")
            continue
        t, n = bad
        ids = ", ".join(sorted(str(w["worker_id"]) for w in n)) or "none"
        side = f"above max {hi}" if len(n) > hi else f"below min {lo}"
        check(
            "fleet-size",
            False,
            None,
            f"{len(n)} worker processes alive and not told to stop at {at(t)} ({ids}), {side}, while settled: "
            f"controller {c['name']} (pid {c['pid']}) acting since at least {at(a - f.react_s)}, the broker up, "
            f"no worker killed or stopped by the adversary in the {f.react_s:g} s before",
        )
    return settled


def actions(f: AutoscaleFacts) -> tuple[list[dict[str, Any]], int]:
    """Every action a controller took, in time order: launches (a worker whose parent it was when
    first seen, at the worker's start) and retirements (its ``autoscale retired`` lines); and how
    many launches had no known parent (the launcher died before the harness looked)."""
    out: list[dict[str, Any]] = []
    orphans = 0
    for w in f.workers:
        parent = w.get("parent")
        if w.get("fixed"):
            continue  # (a worker the harness started: no controller's action)
        if parent is None:
            orphans += 1
            continue
        out.append({"t": float(w["start"]), "controller": str(parent), "what": f"launched {w['worker_id']}"})
    for r in f.facts.get("retires") or []:
        out.append({"t": float(r["t"]), "controller": str(r["controller"]), "what": f"retired {r['worker_id']}"})
    return sorted(out, key=lambda a: a["t"]), orphans


def check_one_acting(
    f: AutoscaleFacts,
    check: Callable[[str, bool, str | None, str], bool],
    unverified: Callable[[str], None],
    at: Callable[[float], str],
) -> None:
    """``one-acting``: each action within its controller's lease; handovers no faster than the bound."""
    acts, orphans = actions(f)
    for _ in range(orphans):
        unverified("one-acting: a worker whose launcher had died before the harness saw it")
    prev: dict[str, Any] | None = None
    for a in acts:
        c = f.by_name.get(a["controller"])
        t = a["t"]
        if c is None:
            unverified("one-acting: an action of a controller the harness did not start")
            continue
        if any(g0 <= t + SLACK_S and t - f.ttl_s <= g1 for g0, g1 in f.lease_gaps):
            unverified("one-acting: the lease's writes unseen around the action (the watch was away)")
            prev = a
            continue
        w = f.last_write(t)
        if not f.names(w, c):
            # (its own take, stamped a moment after the action's time by another clock's rounding)
            w = next((r for r in f.lease if t < float(r["t"]) <= t + STAMP_SLACK_S and f.names(r, c)), w)
        mine = f.names(w, c)
        fresh = w is not None and t <= float(w["t"]) + f.ttl_s / 2 + SLACK_S
        handover = ""
        if prev is not None and prev["controller"] != a["controller"]:
            p = f.by_name.get(prev["controller"]) or {}
            released = p.get("termed_at") is not None and float(p["termed_at"]) <= t
            if t - prev["t"] < f.ttl_s / 2 - SLACK_S and not released:
                handover = (
                    f"; {t - prev['t']:.2f} s after controller {prev['controller']} {prev['what']} at "
                    f"{at(prev['t'])}, inside the lease's handover bound ({f.ttl_s / 2:g} s), the other not stopped"
                )
        if not (mine and fresh) or handover:
            if w is None:
                lease = "no lease write stored by then"
            elif not mine:
                lease = f"the lease's last write ({at(float(w['t']))}, {w.get('op')}) names {w.get('holder')!r}"
            elif not fresh:
                lease = f"its last renewal was {t - float(w['t']):.2f} s before (acting past half a lease time)"
            else:
                lease = "within its lease"
            check(
                "one-acting",
                False,
                None,
                f"controller {c['name']} (pid {c['pid']}) {a['what']} at {at(t)}: {lease}{handover}",
            )
        else:
            check("one-acting", True, None, "")
        prev = a


def check_waits(
    f: AutoscaleFacts,
    check: Callable[[str, bool, str | None, str], bool],
    unverified: Callable[[str], None],
    at: Callable[[float], str],
    served: Callable[[dict[str, Any], dict[str, Any]], str | None] | None = None,
    committed: set[int] | None = None,
) -> None:
    """``held-wait``: a waiting request for a held version answered by its deadline, at that version
    (``committed``: the versions the adversary committed; a request for another is nobody's to serve)."""
    for e in f.facts.get("evals") or []:
        t0, deadline, v = float(e["t0"]), float(e["deadline"]), int(e["version"])
        ans = e.get("answer") or {}
        if committed is not None and v not in committed:
            unverified("held-wait: a request for a version never committed")
            continue
        problem = None
        late = True  # (a result made at the wrong version, or with wrong tokens, is never excused)
        if ans.get("kind") != "result":
            what = ans.get("cls") or ans.get("kind") or "nothing"
            problem = f"answered {what} at {at(float(ans['t']))}" if ans.get("t") is not None else "never answered"
        elif float(ans["t"]) > deadline + WAIT_SLACK_S:
            problem = f"answered only at {at(float(ans['t']))}, {float(ans['t']) - deadline:.1f} s past its deadline"
        else:
            labels = {int(ans.get("version_start", -1)), int(ans.get("version_end", -1))}
            labels |= {int(s[0]) for spans in ans.get("spans") or [] for s in spans}
            late = False
            if labels != {v}:
                problem = f"answered with a result labelled {sorted(labels)}, not v{v}"
            elif served is not None:
                problem = served(e, ans)
        if problem is None:
            check("held-wait", True, e.get("key"), "")
            continue
        acted = 0.0
        t = t0
        while t <= deadline:
            if f.acting_at(t) is not None and f.broker_quiet(t):
                acted += SAMPLE_S
            t += SAMPLE_S
        if late and acted < f.need_s:
            unverified(f"held-wait: no controller acted {f.need_s:g} s of the request's wait")
            continue
        check(
            "held-wait",
            False,
            e.get("key"),
            f"exact v{v}, asked to wait for a replica at {at(t0)} with a deadline at {at(deadline)}: {problem} "
            f"(a controller acted {acted:.1f} s of that wait)",
        )


def spans_tile(desc: dict[str, Any]) -> str | None:
    """Whether each completion's spans tile its tokens from 0, without gap or overlap."""
    for i, spans in enumerate(desc.get("spans") or []):
        end = 0
        for _, a, b in spans:
            if int(a) != end or int(b) < int(a):
                return f"sample {i}'s spans {spans} do not tile its tokens"
            end = int(b)
        lengths = desc.get("lengths") or []
        if i < len(lengths) and end != int(lengths[i]):
            return f"sample {i}'s spans end at {end}, its tokens at {lengths[i]}"
    return None


def check_bursts(
    f: AutoscaleFacts,
    check: Callable[[str, bool, str | None, str], bool],
    unverified: Callable[[str], None],
    at: Callable[[float], str],
    served: Callable[[dict[str, Any], dict[str, Any]], str | None] | None = None,
    lost: Callable[[float], bool] | None = None,
) -> None:
    """``scaled-job``: a resumable job running while a scale-in retired replicas is answered once, by
    its deadline, with every token made by the version its span names and its spans whole; asked
    again at the end, the same answer comes back, unless ``lost``: the broker's store lost the answer
    (a rollback, a wipe, the results deleted), so a second run's is right (``once`` exempts it alike)."""
    for e in f.facts.get("bursts") or []:
        ans = e.get("answer") or {}
        problem = None
        if ans.get("kind") != "result":
            what = ans.get("cls") or ans.get("kind") or "nothing"
            problem = f"answered {what}" + (f" at {at(float(ans['t']))}" if ans.get("t") is not None else "")
        elif float(ans["t"]) > float(e["deadline"]) + WAIT_SLACK_S:
            problem = f"answered only at {at(float(ans['t']))}, past its deadline ({at(float(e['deadline']))})"
        else:
            problem = spans_tile(ans) or (served(e, ans) if served is not None else None)
            again = e.get("again")
            if (
                problem is None
                and again is not None
                and (again.get("job_id") != ans.get("job_id") or again.get("tokens") != ans.get("tokens"))
            ):
                if lost is not None and lost(float(ans["t"])):
                    unverified("scaled-job: its answer lost with the broker's store, asked again")
                    continue
                problem = (
                    f"asked again at the end, another answer came back ({again.get('cls') or again.get('job_id')})"
                )
        check(
            "scaled-job",
            problem is None,
            e.get("key"),
            f"resumable job submitted at {at(float(e['t0']))} beside a scale-in: {problem}",
        )


def judge_autoscaler(oracle: Any, facts: dict[str, Any]) -> None:
    """The autoscaler's invariants over one run, counted and reported through ``oracle``."""
    f = AutoscaleFacts(facts, oracle.broker_out)
    t_first = float(facts.get("t0") or oracle.t_first)

    def at(t: float) -> str:
        return f"{t - t_first:.1f} s"

    def unverified(reason: str) -> None:
        oracle.unverified[reason] += 1

    t1 = float(facts.get("t_end") or t_first)
    settled = check_fleet_size(f, t_first, t1, oracle.check, at)
    check_one_acting(f, oracle.check, unverified, at)
    served = _served_by(oracle)
    committed = {int(v) for _, v in getattr(oracle, "commits", [])} or None
    check_waits(f, oracle.check, unverified, at, served=served, committed=committed)
    store_loss = getattr(oracle, "lost_with_store", None)

    def lost(t: float) -> bool:
        return store_loss is not None and store_loss(t, "results", after=t1) is not None

    check_bursts(f, oracle.check, unverified, at, served=served, lost=lost)
    acts, _ = actions(f)
    oracle.notes["autoscaler"] = {
        "settled_s": round(settled, 2),
        "controllers": len(f.controllers),
        "worker_processes": len(f.workers),
        "launches": sum(1 for a in acts if a["what"].startswith("launched")),
        "retirements": sum(1 for a in acts if a["what"].startswith("retired")),
        "lease_writes": len(f.lease),
        "waiting_requests": len(facts.get("evals") or []),
        "resumable_jobs_beside_scale_ins": len(facts.get("bursts") or []),
        "decisions": facts.get("decisions") or {},
        "scale_ins": facts.get("scale_ins") or [],
    }


def _served_by(oracle: Any) -> Callable[[dict[str, Any], dict[str, Any]], str | None] | None:
    """The tokens of a waiting request's answer recomputed from the trainer's weights (keyed echo)."""
    if getattr(oracle, "weights", None) is None:
        return None
    try:
        from reliability.adversary.truth import Truth
    except ImportError:
        return None
    truth = Truth(oracle.weights)
    versions = sorted({v for _, v in oracle.commits})

    def served(e: dict[str, Any], ans: dict[str, Any]) -> str | None:
        # (unseeded: a resumable job runs on its job's seed, which its coordinate records)
        seed = seed_used({}, ans)
        verdict = truth.judge(ans, e["prompt"], seed=seed, keyed_replica=lambda w: True, versions=versions)
        if verdict.mismatches:
            return "its tokens are not what their labels' weights make: " + verdict.mismatches[0].describe()
        return None

    return served
