"""The gateways' sessions and keyless callers (the lane of ``reliability.adversary.gateway_load``),
judged from raw facts: the HTTP answers as the caller read them, the wiretap's deliveries (each
job's client id, session, prompt) and published answers, acks, the processes' lives, and the
trainer's weights. What a gateway says about itself is never read.

- ``once``: a key is one answer on this door too: every 200 for an ``Idempotency-Key`` (its
  tries through either gateway, after the caller left, a try reusing it for another body, and
  the re-ask of every answered keyed turn at the end through each gateway, its session long
  gone on) names the same job and the same tokens, and that re-ask gets its answer within the
  gateway's time-out (not a time-out, nor ``Expired``: its answer is stored; another typed
  refusal is counted not verifiable). And a trajectory (one
  ``X-Session-Id``) runs at most one turn per key plus one per keyless try (each try counted
  from the record journaled before it was sent): the turn jobs the wiretap saw delivered in its
  session are no more than that (a retried key that ran a new turn,
  advancing the session, shows as one job too many).
- ``version``: a turn's 200 answer lies within the ``weight_version`` that turn asked for (exact:
  every span at it; a floor: none below it), and within its session's policy (a gateway's
  sessions are ``monotonic``: never below the last version of the trajectory's previous answer).
- ``served``: every token of a turn's 200 answer is what the trainer's weights at its span's
  version make, from the prompt that try sent (``truth``).
- ``gone``: no job generates for nobody: a keyless request whose caller left (closed the
  connection) has each of its jobs (found by the prompt the wiretap saw, unique to each try) no
  longer generating ``GONE_S`` after the caller left: every delivery of it ended by then (its
  answer, a partial one when stopped, published; or its delivery acked, handed back or its worker
  gone) and none begins later. The bound runs longer by the time the gateway, the broker or the
  holder was frozen or out meanwhile; a caller's gateway that died before the bound, or the
  wiretap away, leaves it not verifiable.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

from reliability.adversary.journal import prompt_digest
from reliability.adversary.oracle_loop import Judge

GONE_S = 5.0  # a job whose keyless caller left stops generating within this long
OUT_GRACE_S = 5.0  # after a broker outage: the gateway and the replicas reconnect
ENDS_A_DELIVERY = ("+ACK", "-NAK", "+TERM")
UNSEEN_WORK = "gone: no sign its worker worked on the delivery past the bound (no progress ack, no answer)"


def inputs_of(input_ids: Any) -> list[list[int]]:
    """A body's inputs: one list of token ids, or a batch of them."""
    if input_ids and isinstance(input_ids[0], list):
        return [list(x) for x in input_ids]
    return [list(input_ids or [])]


def calls_of(records: Sequence[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """rid -> the call (``gw_call``) with its tries as they ended (``gw_try``) and as they were
    sent (``gw_send``), each in order."""
    calls: dict[str, dict[str, Any]] = {}
    for r in records:
        if r.get("ev") == "gw_call":
            calls[r["rid"]] = {**r, "tries": [], "sent": []}
        elif r.get("ev") in ("gw_try", "gw_send") and r.get("rid") in calls:
            calls[r["rid"]]["tries" if r["ev"] == "gw_try" else "sent"].append(r)
    return calls


def turns_allowed(its: Sequence[dict[str, Any]]) -> int:
    """How many turn jobs a trajectory's calls may have run: one per key a try carried, one per
    keyless try. A try counts from its ``gw_send`` (journaled before it is sent) as well as its
    ``gw_try`` (after it ended): a trainer SIGKILLed while a try is under way writes no
    ``gw_try``, and that try's turn still runs (campaign seed 747109: a keyed third turn sent
    0.18 s before the SIGKILL ran, answered 0.15 s after it)."""
    keys: set[str] = set()
    keyless = 0
    for c in its:
        ended = [t for t in c["tries"] if not str(t.get("outcome", "")).startswith("no address")]
        sent = c.get("sent") or []
        keys.update(str(t["key"]) for t in [*ended, *sent] if t.get("key") is not None)
        keyless += max(
            len({t.get("try") for t in ended if t.get("key") is None}),
            len({t.get("try") for t in sent if t.get("key") is None}),
        )
    return len(keys) + keyless


def _answered(t: dict[str, Any]) -> dict[str, Any] | None:
    answer = t.get("answer")
    return answer if t.get("status") == 200 and isinstance(answer, dict) and answer.get("kind") == "result" else None


def _versions(answer: dict[str, Any]) -> list[int]:
    vs: set[int] = set()
    if answer.get("version_start") is not None:
        vs = {int(answer["version_start"]), int(answer["version_end"])}
    for spans in answer.get("spans") or []:
        vs.update(int(s[0]) for s in spans if int(s[2]) > int(s[1]))
    return sorted(vs)


def judge_keys_and_turns(
    judge: Judge,
    calls: dict[str, dict[str, Any]],
    session_of_job: dict[str, str],
    jobs_of_session: dict[str, set[str]],
    finals: dict[str, dict[str, Any]] | None = None,
    lost: Callable[[float, float], bool] = lambda answered, asked: False,
) -> None:
    """``once``: one answer per key; no more turn jobs in a trajectory than its keys and keyless
    tries. ``finals``: the keyed turns asked again at the end through each gateway
    (``gw:<key>@<gateway>``: the answer read, ``http-none`` for none); ``lost(answered, asked)``:
    whether a store loss took an answer stored at ``answered`` before it was asked again."""
    answers_of_key: dict[str, list[tuple[str, str, str]]] = defaultdict(list)  # key -> (job, tokens, rid)
    answered_at: dict[str, float] = {}
    for c in calls.values():
        for t in c["tries"]:
            a = _answered(t)
            if a is not None and t.get("key") is not None:
                answers_of_key[t["key"]].append((str(a.get("job_id")), str(a.get("tokens")), c["rid"]))
                answered_at[t["key"]] = min(float(t.get("t_end") or 0.0), answered_at.get(t["key"], float("inf")))
    for key, seen in answers_of_key.items():
        for at, final in sorted(
            (k.split("@", 1)[1], f) for k, f in (finals or {}).items() if k.split("@", 1)[0] == f"gw:{key}"
        ):
            if lost(answered_at[key], float(final.get("t") or 0.0)):
                judge.unverified["once: a gateway key's answer lost with the broker's store before its re-ask"] += 1
            elif final.get("kind") == "http-result" and final.get("status", 200) == 200:
                seen.append((str(final.get("job_id")), str(final.get("tokens")), f"the re-ask through {at}"))
            elif final.get("kind") == "http-none":
                # Its answer is stored: a door that hands out nothing for its key keeps it from its caller.
                judge.check("once", False, key, f"asked again at the end through {at}: no answer in "
                            f"{final.get('waited_s')} s ({final.get('error', '')[:120]})")  # fmt: skip
            elif final.get("cls") == "Expired" or final.get("status") == 504:
                # (nor is an answer stored long ago expired: ``lost`` for a plain key)
                judge.check("once", False, key, f"asked again at the end through {at}: answered "
                            f"{final.get('status')} {final.get('cls')} ({str(final.get('message'))[:120]}), "
                            f"though its answer is stored")  # fmt: skip
            else:
                judge.unverified[f"once: a gateway key asked again at the end was refused ({final.get('cls')})"] += 1
    for key, seen in sorted(answers_of_key.items()):
        distinct = sorted({(job, tokens) for job, tokens, _ in seen})
        judge.check(
            "once",
            len(distinct) == 1,
            key,
            f"a gateway key answered 200 with {len(distinct)} different answers (jobs {[j for j, _ in distinct]}) "
            f"over {len(seen)} tries",
        )
    trajectories: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for c in calls.values():
        if c.get("traj"):
            trajectories[c["traj"]].append(c)
    for traj, its in sorted(trajectories.items()):
        tries = [t for c in its for t in c["tries"] if not str(t.get("outcome", "")).startswith("no address")]
        named = {session_of_job[str(a["job_id"])] for t in tries if (a := _answered(t)) and str(a.get("job_id"))
                 in session_of_job}  # fmt: skip
        if not named:
            judge.unverified["once: a trajectory with no answered turn the wiretap saw"] += 1
            continue
        jobs = set().union(*(jobs_of_session.get(s, set()) for s in named))
        allowed = turns_allowed(its)
        judge.check(
            "once",
            len(jobs) <= allowed,
            traj,
            f"trajectory {traj} (session {sorted(named)}) ran {len(jobs)} turn jobs for {allowed} keys and keyless "
            f"tries: a retried key ran another turn",
        )


def judge_answers(
    judge: Judge,
    calls: dict[str, dict[str, Any]],
    *,
    served: Callable[[dict[str, Any], list[int], int | None], list[str] | None],
) -> None:
    """``version`` and ``served`` for every 200 a turn was answered. ``served(answer, prompt,
    seed)``: the tokens that differ from what the labelled weights make (None: none recomputed)."""
    trajectories: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for c in sorted(calls.values(), key=lambda c: float(c["t0"])):
        if c.get("traj"):
            trajectories[c["traj"]].append(c)
    for traj, its in sorted(trajectories.items()):
        floor: tuple[int, str] | None = None  # the last answered turn's version_end, and its key
        for c in its:
            asked = (c.get("body") or {}).get("weight_version") or {}
            seed = ((c.get("body") or {}).get("sampling_params") or {}).get("sampling_seed")
            ends: list[int] = []
            for t in c["tries"]:
                a = _answered(t)
                if a is None:
                    continue
                vs = _versions(a)
                wrong = []
                if "exact_version" in asked and any(v != int(asked["exact_version"]) for v in vs):
                    wrong.append(f"asked exact_version {asked['exact_version']}")
                if "min_required_version" in asked and any(v < int(asked["min_required_version"]) for v in vs):
                    wrong.append(f"asked min_required_version {asked['min_required_version']}")
                if floor is not None and c["kind"] == "turn" and vs and min(vs) < floor[0]:
                    wrong.append(f"its previous answered turn ({floor[1]}) was served at v{floor[0]} (monotonic)")
                judge.check(
                    "version",
                    not wrong,
                    t.get("key") or traj,
                    f"turn {c.get('turn')} of {traj} answered 200 by {t.get('gateway')} at versions {vs} "
                    f"(job {a.get('job_id')}): {'; '.join(wrong)}",
                )
                bad = served(a, inputs_of(t.get("input_ids"))[0], seed)
                if bad is None:
                    judge.unverified["served: no token of a gateway turn made by a keyed engine"] += 1
                else:
                    what = f"turn {c.get('turn')} of {traj} (job {a.get('job_id')}): {'; '.join(bad)[:400]}"
                    judge.check("served", not bad, t.get("key") or traj, what)
                if c["kind"] == "turn" and vs:
                    ends.append(int(a.get("version_end") or max(vs)))
            if ends:
                floor = (max(ends), c.get("key") or c["rid"])


def _extended(t0: float, span: float, windows: Sequence[tuple[float, float, float]]) -> float:
    """When ``span`` seconds of time in which something could be done have passed since ``t0``:
    every window ``(from, to, grace)`` (a process frozen, the broker out, and ``grace`` after it)
    does not count."""
    merged: list[list[float]] = []
    for a, b in sorted((float(a), float(b) + grace) for a, b, grace in windows if float(b) + grace > t0):
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    now, left = t0, span
    for a, b in merged:
        if a > now:
            step = min(left, a - now)
            now, left = now + step, left - step
            if left <= 0:
                return now
        now = max(now, b)
    return now + left


def judge_gone(
    judge: Judge,
    calls: dict[str, dict[str, Any]],
    *,
    deliveries: Sequence[Any],
    published: Sequence[Any],
    acks: dict[str, list[tuple[float, str]]],
    gateway_lives: Sequence[Any],
    worker_lives: Sequence[Any],
    outages: Sequence[Sequence[float]],
    gaps: Sequence[Sequence[float]],
    client_id: str,
    run_end: float,
) -> dict[str, int]:
    """``gone`` for every keyless try whose caller left. Returns notes."""
    notes: dict[str, int] = defaultdict(int)
    by_prompt: dict[str, list[Any]] = defaultdict(list)
    for d in deliveries:
        if getattr(d, "prompt", None) and d.client_id == client_id:
            by_prompt[d.prompt].append(d)
    answers_by_job: dict[str, list[Any]] = defaultdict(list)
    for p in published:
        if p.job_id:
            answers_by_job[p.job_id].append(p)
    deliveries_by_job: dict[str, list[Any]] = defaultdict(list)
    for d in deliveries:
        if d.job_id:
            deliveries_by_job[d.job_id].append(d)
    for c in calls.values():
        for t in c["tries"]:
            if not t.get("gone") or t.get("key") is not None:
                continue
            notes["gateway_callers_left"] += 1
            digests = {prompt_digest(x) for x in inputs_of(t.get("input_ids"))}
            jobs = sorted({d.job_id for g in digests for d in by_prompt.get(g or "", []) if d.job_id})
            if not jobs:
                notes["gateway_callers_left_before_a_job_was_delivered"] += 1
            t_gone = float(t["t_gone"])
            life = next(
                (g for g in gateway_lives if g.name == t.get("gateway") and g.start <= float(t["t_sent"])
                 and (g.end is None or float(t["t_sent"]) < g.end)),
                None,
            )  # fmt: skip
            windows = [(a, b, 0.0) for a, b in (getattr(life, "stops", None) or [])]
            windows += [(float(a), float(b), OUT_GRACE_S) for a, b in outages]
            bound = _extended(t_gone, GONE_S, windows)
            if life is None or (life.end is not None and life.end <= bound):
                # Its gateway died (or was stopped) before the bound: nobody was left to cancel.
                if jobs:
                    judge.unverified["gone: the caller's gateway ended before the bound"] += 1
                continue
            for job in jobs:
                # Only the job as this try's request made it: a session turn's job id can carry
                # another try's request later (a keyless retry through another gateway asked the
                # same turn again, with its own prompt; seed 8080): its run and its answer are that
                # request's, judged by its own caller's leaving.
                own = [d for d in deliveries_by_job[job] if not d.prompt or d.prompt in digests]
                others = [d.t for d in deliveries_by_job[job] if d.prompt and d.prompt not in digests]
                reused = min(others, default=None)
                answers = [p for p in answers_by_job[job] if reused is None or p.t < reused]
                if reused is not None:
                    notes["gateway_job_ids_carrying_another_request"] += 1
                late = _generating_after(own, answers, acks, worker_lives, t_gone, windows, run_end)
                if late is not None and any(a <= late[1] and t_gone <= b for a, b in gaps):
                    judge.unverified["gone: the wiretap away meanwhile"] += 1
                    continue
                if late is not None and late[0] == UNSEEN_WORK:
                    judge.unverified[UNSEEN_WORK] += 1
                    continue
                judge.check(
                    "gone",
                    late is None,
                    f"job {job}",
                    f"a keyless request's caller left {t.get('gateway')} at {t_gone:.3f} ({c['kind']}, try "
                    f"{t.get('try')}), yet its job was {late[0] if late else ''} until {late[1] if late else 0:.3f}, "
                    f"{(late[1] if late else 0) - t_gone:.2f} s after (the bound: {bound - t_gone:.2f} s)",
                )
    return dict(notes)


def _generating_after(
    delivered: Sequence[Any],
    answers: Sequence[Any],
    acks: dict[str, list[tuple[float, str]]],
    worker_lives: Sequence[Any],
    t_gone: float,
    windows: Sequence[tuple[float, float, float]],
    run_end: float,
) -> tuple[str, float] | None:
    """(what, until) if a delivery of a job was generating past the bound (``GONE_S`` after
    ``t_gone``, not counting ``windows`` nor the time its holder was frozen); None if none was."""
    for d in sorted(delivered, key=lambda d: d.t):
        mine = sorted((p for p in answers if p.t >= d.t and (p.worker is None or p.worker == d.worker)),
                      key=lambda p: p.t)  # fmt: skip
        first = mine[0] if mine else None
        if first is not None and first.kind == "failure" and first.t - d.t < 1.0:
            continue  # (answered with an error at once: it never generated)
        ends = [first.t] if first is not None else []
        ends += [t for t, kind in acks.get(d.ack, []) if t >= d.t and kind in ENDS_A_DELIVERY]
        life = next((w for w in worker_lives if w.worker_id == d.worker and w.start <= d.t
                     and (w.end is None or d.t < w.end)), None)  # fmt: skip
        if life is not None and life.end is not None:
            ends.append(float(life.end))
        end = min(ends) if ends else run_end
        frozen = [(float(a), float(b), 0.0) for a, b in (getattr(life, "stops", None) or [])]
        bound = _extended(t_gone, GONE_S, [*windows, *frozen])
        if end > bound:
            # Generating past the bound is a fact only where something shows it: the delivery
            # came after it, its answer did, or its worker acked it after it (a running job's
            # holder sends a progress ack every third of the ack wait). A delivery with none of
            # these past the bound was not seen to be worked on: not verifiable either way.
            worked = d.t > bound or (first is not None and first.t > bound)
            worked = worked or any(t > bound for t, _ in acks.get(d.ack, []))
            if not worked:
                return UNSEEN_WORK, end
            what = f"delivered to {d.worker} at {d.t:.3f} and generating" + (
                f" (answered at {first.t:.3f})" if first is not None else " (never answered)"
            )
            return what, end
    return None
