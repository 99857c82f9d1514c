"""``python -m reliability``: run every scenario at full size and write docs/reliability.md.

python -m reliability                 # all scenarios, long sizes (make reliability)
python -m reliability --quick         # CI sizes
python -m reliability --only 1,4      # some scenarios
python -m reliability --out PATH      # write the page elsewhere (default docs/reliability.md)
"""

from __future__ import annotations

import argparse
import asyncio
import datetime as dt
import json
import os
import platform
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from reliability.scenarios import contract, fuzz, machine_adversary, policy, request_path, security, sessions
from reliability.scenarios.common import REPO, Figures

Scenario = Callable[[Path], Awaitable[Figures]]


def scenarios(quick: bool) -> list[tuple[str, Scenario]]:
    """(id, run) per scenario; ``quick`` uses the CI sizes, otherwise the long ones."""
    q = quick

    async def s8(_: Path) -> Figures:
        return await asyncio.to_thread(fuzz.fuzz_all, 200 if q else 2000)

    return [
        (
            "1",
            lambda d: request_path.worker_kills(
                d, jobs=200 if q else 1500, kills=2 if q else 10, workers=3 if q else 4, rate=50.0 if q else 80.0
            ),
        ),
        (
            "2",
            lambda d: request_path.broker_restart(
                d, jobs=100 if q else 600, rate=40.0, down_s=1.0 if q else 2.0, restarts=1 if q else 3
            ),
        ),
        ("3", lambda d: request_path.cluster_node_loss(d, jobs=100 if q else 400, rate=30.0)),
        ("4", lambda d: policy.publisher_kills(d)),
        (
            "5",
            lambda d: policy.replica_killed_mid_apply(d, points=policy.APPLY_POINTS[:1] if q else policy.APPLY_POINTS),
        ),
        ("6", lambda d: policy.corrupt_deltas(d)),
        ("7", lambda d: policy.trainer_restart(d, jobs=60 if q else 200)),
        ("8", s8),
        ("9a", lambda d: security.hostile_versions(d)),
        ("9b", lambda d: security.token_end_to_end(d)),
        ("9c", lambda d: security.tls_end_to_end(d)),
        ("10", lambda d: contract.exact_pins(d, jobs=80 if q else 400, versions=5 if q else 15)),
        (
            "11",
            lambda d: sessions.sessions_under_kills(
                d, sessions=8 if q else 40, turns=5 if q else 8, workers=3, kills=2 if q else 8
            ),
        ),
        (
            "12",
            lambda d: machine_adversary.campaign(
                d,
                seeds=machine_adversary.SEEDS[:2] if q else machine_adversary.SEEDS,
                duration=30.0 if q else 60.0,
                hf_seeds=0 if q else 2,
                named=[] if q else machine_adversary.NAMED_RUNS,
                more=[] if q else machine_adversary.MORE_RUNS,
            ),
        ),
    ]


async def run_all(quick: bool, only: set[str] | None) -> list[Figures]:
    out: list[Figures] = []
    root = Path(tempfile.mkdtemp(prefix="rf-reliability-"))
    try:
        for sid, run in scenarios(quick):
            if only and sid not in only and sid.rstrip("abc") not in only:
                continue
            if sid == "9c" and shutil.which("openssl") is None:
                continue
            print(f"--- scenario {sid}", flush=True)
            t0 = time.monotonic()
            try:
                fig = await asyncio.wait_for(run(root / f"s{sid}"), 3600 if sid == "12" else 900)
            except Exception as exc:  # a crashed scenario is a result too
                fig = Figures(sid, f"scenario {sid} crashed", problems=[f"{type(exc).__name__}: {exc}"])
                fig.notes["traceback"] = traceback.format_exc()[-2000:]
                fig.seconds = time.monotonic() - t0
            print(fig.summary(), flush=True)
            out.append(fig)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return out


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.3g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value)[:400].replace("|", "\\|")
    return str(value).replace("|", "\\|").replace("\n", " ")[:400]


def render(figs: list[Figures], quick: bool, seconds: float) -> str:
    lines = [HEADER.strip(), ""]
    when = dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC")
    lines += [
        "## Figures",
        "",
        f"Measured by `make reliability` ({'CI' if quick else 'long'} sizes) on {when}: "
        f"{platform.system()} {platform.machine()}, {os.cpu_count()} CPUs, Python {platform.python_version()}, "
        f"loopback only; {seconds:.0f} s in all. Every scenario drives real processes.",
        "",
        "| # | scenario | submitted | completed | duplicated | lost | re-executed | faults "
        "| versions published / activated | time to recover (max) | result |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for f in figs:
        rec = f"{max(f.recover_s):.2f} s" if f.recover_s else "-"
        ok = "pass" if f.passed else "**FAIL**"
        lines.append(
            f"| {f.scenario} | {f.title} | {f.submitted} | {f.completed} | {f.duplicated} | {f.lost} | {f.reexecuted} "
            f"| {f.faults} | {f.versions_published} / {f.versions_activated} | {rec} | {ok} |"
        )
    lines += ["", "Scenario 8 counts examples (inputs tried) under *submitted* and *faults*.", ""]
    lines += ["## Details per scenario", ""]
    for f in figs:
        lines += [f"### {f.scenario}. {f.title}", "", f"Size: `{json.dumps(f.size)}`; {f.seconds:.1f} s.", ""]
        if f.recover_s:
            lines.append(f"Time to recover per fault (s): {', '.join(f'{r:.2f}' for r in f.recover_s)}.")
            lines.append("")
        for key, value in f.notes.items():
            if key != "traceback":
                lines.append(f"- {key}: {_fmt(value)}")
        if f.problems:
            lines += ["", "**Broken promises:**", ""] + [f"- {p}" for p in f.problems]
        lines.append("")
    lines.append(FOOTER.strip().replace("{PREFIX_TABLE}", PREFIX_TABLE.strip()))
    return "\n".join(lines) + "\n"


HEADER = """
# Reliability: what rollfleet promises, and the figures that back it

This page is written by `make reliability` (`python -m reliability`), which drives the real
system — a real `nats-server` (single node with a file store, or the 3-node cluster of
`broker_config/cluster/`), real `rollfleet worker` processes, real trainer and publisher
processes — on loopback, injects faults (SIGKILL at random or named points, corrupted and
hostile files, a killed broker or cluster node) and counts what was lost. The same scenario
functions run at small sizes in CI (`tests/test_reliability_*.py`).

## The promises, and where each one ends

**At-least-once execution (`retry_policy="replayable"`, the default).** A job is acked only
after its result is stored on the results stream, so a worker that dies at any moment leaves
its jobs unacked; the broker redelivers them after `ack_wait` and another worker runs them
again. *Ends:* after `max_deliver` deliveries (default 10) the broker stops redelivering a
job whose holders keep dying (the client then gets `Expired` at the deadline); and a job
still unserved at its deadline is answered `Expired` (retryable) rather than run late.

**One result per idempotency key within the duplicate window.** The key is the job's
`Nats-Msg-Id` (a resubmission within `duplicate_window_s`, default 600 s, stores no second
job) and the result's `Nats-Msg-Id` (a second result for the key within the window is
dropped by the results stream). A redelivered job whose result is already stored is acked
without running again, and the client drops a late duplicate of an answer it has already
handed out (it remembers the last 100,000). The same key for a different request (another
payload or constraint) is refused with `IdempotencyConflict`. *Ends:* past the duplicate
window the broker forgets the key: a resubmission then makes a new job, whose handle resolves
with that job's own result (a second result for the key); a re-execution
of a redelivered job more than a window after its first result (possible only with
`ack_wait` x `max_deliver` longer than the window) is not deduplicated either. Keep the
window longer than the longest time a job can be retried.

**`at_most_once`.** A worker claims such a job (`RF_<NS>_CLAIMS`, key = job id) before it
starts it. A redelivered job whose claim exists may have run on a holder that died: it is not
run again, and is answered with retryable `Interrupted` (the caller decides). It may have run
partly, or fully with its result lost in the crash — "at most once" is about *starting* it
again. A job handed back unrun (a replica that moved to another version received it, or an
activation's drain gave up on it and aborted it before answering) carries no claim and is
served normally elsewhere.

**A request is never served outside its constraint.** A worker pulls only subjects its served
version can serve, checks again when a job starts, and changes its served version only after
announcing an activation. Before it activates a new version it stops taking exact jobs of the
old one and lets those running finish, for up to `--exact-drain` seconds (30 by default,
reported as `drain_s` in each activation); past that bound it aborts them and hands them back
unanswered, so an exact job runs entirely at its version or not at all. Minimum-version jobs may
span an activation: their per-token version spans say which tokens came from which version. An
exact job that no replica will serve any more is withdrawn and answered `NoCompatibleReplica`
within seconds. As defence in depth, a worker never stores, and a client never hands out, a
result whose tokens fall outside its constraint (`ContractViolation`, counted). Scenario 10
tries this with random schedules of publications and jobs.

**A session's turns are answered once each, within the session's version policy.** A turn is
a job keyed `<session_id>/<turn>`, sent to the replica holding the session's context while it
is live and able; a turn that replica has not taken within `affinity_wait_s`, or that it holds
when it dies (no responders to a probe), is withdrawn from its subject and stored, as the same
job, on the shared subject: one answer wherever it runs (`replayable`: run again;
`at_most_once`: `Interrupted` if it had started). `pinned` turns run exactly at the first
turn's version, `monotonic` turns never below the previous turn's last version. Scenario 11
SIGKILLs replicas mid-turn while versions are published. *Ends:* a replica that is alive but
unreachable only for the client still gets its turns moved after the wait, and may finish the
original too; the second result for the key is dropped by the results stream (one answer),
but an `at_most_once` turn can then be answered `Interrupted` although its first run finished.

**Acknowledged means durable.** `submit` returns once JetStream has stored the job (file
storage); a submission that raised (`ServiceUnavailable`) or failed fast
(`NoCompatibleReplica`) was *not* stored and may be retried with the same key. *Ends:* the
single-node broker writes to the OS page cache without fsync per message, so a killed
*process* loses nothing (scenario 2), but a power loss of a single node can lose the last
writes; use the R3 cluster (scenario 3) for that.

**A restarted trainer gets its results.** Results go to a durable consumer per `client_id`
and stay on the results stream for `results_max_age_s` (24 h). *Ends:* the client acks a
result when it *receives* it, before the training loop consumes it, so results the dead
process had received but not consumed are not redelivered by the consumer; `client.result(key)`
then reads them back from the results stream, and resubmitting the key recovers them too,
without running anything again (scenario 7 resubmits every pending key). *Ends* at the
results stream's max age.

**No partial version is ever visible.** Files are written to a hidden temporary directory,
fsynced, the index last, renamed atomically; only then is `v.<N>` created in the policy KV
and `latest` moved by compare-and-set. A publisher killed anywhere before that CAS leaves
`latest` where it was (scenario 4); the next publisher cleans leftovers and continues.
A version directory that was renamed but never committed holds complete, verified files;
a later version may use it as its base, which is sound.

**Verified weights, fail-closed.** Every changed tensor's final-state checksum is checked
before a replica marks the version applied; a lineage, layout, checksum, format or name
problem fails the update and the replica keeps serving (and reports `degraded`), with its
local bytes restored (scenarios 6, 9a). A replica killed mid-apply has no marker and
reseeds on restart (scenario 5). *Ends:* a corrupt delta can only be routed around by a
full version (keyframe): the deltas after it are based on it. Publish with `keyframe_every`
small enough to bound that outage, or publish a keyframe when replicas report `degraded`.
A replica does not retry a version that failed on it; it waits for a newer one. A replica
(re)started while the latest commit is bad serves the newest version below it that verifies,
`degraded`, instead of exiting (a bad commit would otherwise empty the fleet as replicas
restart); it exits only when no version can be served (`tests/test_start_on_a_bad_latest.py`).

**Losing one node of a 3-node cluster loses nothing** (R3 streams, consumers and buckets).
Requests stall while the Raft groups on the request path elect new leaders (the fail-over:
a few seconds with nats-server's default election timers), plus at most about 2 s for the
pipeline to refill (a retried submit, pull requests renewed on a consumer leader change, a
client reconnect); a job in flight to a worker through the lost node is redelivered after
`ack_wait`. Submissions during the fail-over raise `ServiceUnavailable` and are retried by the caller with the same
key. *Ends:* losing two of three nodes stops the request path (no quorum) until one returns.

**Authentication and permissions.** With a config from `rollfleet permissions` (example:
`broker_config/auth/permissions.conf`) a worker cannot publish jobs or policy versions, delete
streams, change the shared job consumers, write another replica's registry entry, publish into
another namespace or read other roles' replies — proven in
`tests/test_deploy_auth.py::test_worker_is_refused_versions_and_jobs` (not repeated here).
**One live client per client_id**: a second one is refused with `ClientIdInUse`; a restarted
trainer takes over at once.
Token auth (`nats-server --auth`, `rollfleet worker --token`, `RolloutClient.connect(...,
token=)`) and mutual TLS work end to end (scenarios 9b, 9c). A process given a wrong token
or password fails its first connection at once with `AuthorizationError` (the worker exits
with code 2). *Ends:* a TLS handshake refused for a missing client certificate is retried
until the first-connection time-out (120 s) before `ServiceUnavailable`.
"""

FOOTER = """
## Findings while building this suite

- **Fixed (one line):** `rollfleet/policy_store/layout.py::read_header` raised `TypeError`
  (not `CorruptArtifact`) for a shard header whose `dtype` is a JSON list or object
  (`{"t": {"dtype": [], "shape": [1], "data_offsets": [0, 1]}}`): found by the scenario 8
  fuzzer; regression test in `tests/test_reliability_fuzz.py`.
- **Fixed:** results received but not consumed by a trainer that dies are acked already;
  `RolloutClient.result(key)` never returned for them (scenario 7, `result_api_sees_acked_unconsumed`).
  `result(key)` now reads the stored result back (`get_last_msg` on the key's results subject);
  test `tests/test_idempotency.py::test_result_consumed_by_a_dead_process_is_read_back`.
- **Fixed:** a client or worker with wrong credentials retried forever instead of failing
  with a clear error (`max_reconnect_attempts=-1` also applies to the first connect). The first
  connection now fails with `AuthorizationError`; test
  `tests/test_broker.py::test_wrong_credentials_fail_fast_with_a_typed_error`.
- **Fixed:** during a broker outage `RolloutClient.submit` could raise a raw
  `nats.errors.TimeoutError` (from the fail-fast `fleet.refresh()`), not `ServiceUnavailable`
  (seen in scenario 3's `submit_errors` of the run below); the refresh is now wrapped.

## The machine adversary (scenario 12)

Scenarios 1-11 try the schedules their authors thought of. Scenario 12 composes ordinary
events at random moments instead, against real processes, and an independent oracle judges
every run (`reliability/adversary/run.py`; CI runs two fixed seeds of 30 s each in
`tests/test_adversary.py`, so a CI failure replays exactly; `make adversary` and `make reliability`,
the campaign whose figures are above, draw fresh seeds too and print them first).

    python -m reliability.adversary --seed 1234 --duration 60            # one seed, replayed
    python -m reliability.adversary --seed 1234 --duration 60 --hf 1     # plus an hf replica
    python -m reliability.adversary --schedule drain-flaky-mount --seed 5 --duration 35 --hf 1 --workers 2
    python -m reliability.adversary --seed 1234 --cluster                 # a 3-node cluster, node events
    python -m reliability.adversary --seed 1234 --code ../other-checkout # another tree's rollfleet
    python -m reliability.adversary.oracle WORKDIR                      # judge a kept run again

A failing run prints each violation, its seed and the one-line command that replays it (the
seed fixes the schedule of events and the trainer's requests; the run is real time, so what
they meet varies a little), and keeps its work directory: the journals, the wiretap's dump,
every process's log.

**The machine.** A nats-server run with the config `rollfleet permissions` generates (one user
per worker id; a small `max_payload`, so ordinary answers are stored in chunks), keyed echo
`rollfleet worker` processes (optionally hf ones on a tiny model) following a policy store with
`--verify-live`, short exact drains and a pre-read hook, and a trainer *process*
(`reliability/adversary/load.py`) that submits exact, min and max_staleness jobs, replayable and
at_most_once, small and chunked, under fresh keys and colliding ones (`k`, `k:1`, `k/0`,
`sample`, `sample:0`, ...), resubmits the same request and reuses keys for other requests,
and runs pinned, monotonic and free sessions (a failed turn is asked again with
`generate(turn=k)`); every request and answer is journaled before and after.

**The events** (`reliability/adversary/schedule.py`): publishes, bursts, a version committed while its
directory is missing from the store, a committed directory that disappears for a while, a
corrupt shard, slow reads; SIGKILL of a worker at random or of the one holding a session
turn, an exact job, a chunked answer or an at_most_once job older than its claim; SIGTERM
(a graceful drain) of one running a long turn; a worker restarted armed with
`ROLLFLEET_FAULT=pause:<point>` and SIGKILLed there (a job delivered, mid-chunk, after a
result before its ack, after materializing, before activating, mid-drain, mid-activation);
a broker SIGKILLed and restarted; a worker (at random, or one holding a turn, an exact job, a
chunked answer or an at_most_once job) or the broker frozen (SIGSTOP) for seconds, then
resumed (SIGCONT; the oracle counts a frozen process as alive, and a frozen broker as out); a
job consumer deleted through the JetStream API; the
trainer SIGKILLed (with the replica holding its turn) and restarted under the same
client_id, resubmitting and resuming what it journaled; a second client with the trainer's
id; and a rogue worker, a legitimate worker user of the namespace, that subscribes to every
worker inbox for a while and stores forged answers (before the trainer asks, with an empty
fingerprint; and copies of the job ids and fingerprints it read).

**The oracle** (`reliability/adversary/oracle.py`) never reads the project's counters. Its eyes are
a wiretap (`reliability/adversary/tap.py`: a privileged user that mirrors each worker inbox it learns
from the broker's `/connz` and from the pull requests it hears, and drops the mirror when the
worker does, since a subscription left on a worker's inbox keeps a cancelled pull request
alive at the broker and jobs go into the void; answers as published, acks, claims, registry
writes, activations), the adversary's own timeline (process lives, outages, commits), the
journals, a fresh client's re-ask of every key at the end, and the trainer's weights, from
which it computes each version's digest itself. It checks: every accepted result within its
constraint or its session's policy; the digest the replica announced when it activated that
version equal to the trainer's (a missing digest counts for engines that give one); every
token the echo workers made equal to what the trainer's own weights at its span's labelled
version make (`served`: the workers run `--echo-keyed`, whose tokens are a function of the
tensor bytes they loaded, the context and the seed; the oracle keys the trainer's tensors with
its own code, `reliability/adversary/truth.py`, and recomputes each token, so a label that does not name
the weights that served is caught by the tokens, not by what the replica announced); the
result's job delivered to the worker it names; no forged answer accepted, and no key
decided by one; one answer per key across resubmits, a restarted trainer and the re-ask, and
never `IdempotencyConflict` for the same request; every request and turn resolved by its
deadline plus 5 s; no key answered `Expired` after a worker had published its answer; no job
waiting 10 s unheld while replicas able to serve it were idle or served newer jobs; an exact
job with no replica left at its version answered within 8 s; an at_most_once job started by
one worker process only, and never answered `Interrupted` after its draining replica
finished that same job, or finished it after it or the broker was frozen (another job under
the key later does not count); an error only a worker makes (`EngineFailure`, `Interrupted`,
...) handed to the trainer only where a worker published it, and `Interrupted` only for
at_most_once jobs and turns (`answered`); no job stored again and run elsewhere while its
replica ran it; the rogue
reading nothing; a second client refused `ClientIdInUse`; a failed turn asked again
answering at once with its error; a pinned session the fleet has left refused with a
non-retryable error that names its version; and *availability* (`available`): the trainer
made calls and some were served, nothing was served for no longer than 15 s while the trainer
was asking (a call waiting or refused), and no live replica was missing for longer than that
(the broker down or frozen, and 5 s after, excepted). The harness keeps the fleet at its size (a worker
killed and not restarted by its event, or one that exits on its own, is started again within
2 s), so a longer stop is the product's: a fleet dead for 48 s of 60 fails, and so does a run
whose every call was refused `NoCompatibleReplica`. A run that injected no event or judged
no fact fails too (`Report.passed`); skipped events are not counted, and each invariant counts
one check per fact it judges (a result, a job, a call), not per delivery or log line. What it
cannot see it counts as *not
verifiable*, never as passed (a delivery the wiretap mirrored too late, a result served
from a replica's start-up version, for which no activation was announced), the same way in
every invariant. The oracle itself is tested against known-bad histories
(`tests/test_oracle_mutations.py`): a short real run is recorded, then judged again as mutated
copies (everything refused, no calls, answers relabelled `EngineFailure` or `Interrupted`, a
label one version off, a second answer for a key, a fleet dead most of the run, tokens swapped
between answers, an `Interrupted` answer although the frozen holder finished the job), each of
which must be flagged by its invariant, while the unmutated run and
two histories it once misjudged pass.

### What it finds in the code before the fixes (commit f85f309)

{PREFIX_TABLE}
"""


# The machine adversary's findings in the code before the fixes (a table too wide for a Python line).
PREFIX_TABLE = (Path(__file__).with_name("adversary_findings.md")).read_text()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m reliability", description=__doc__)
    parser.add_argument("--quick", action="store_true", help="CI sizes")
    parser.add_argument("--only", default=None, help="comma-separated scenario ids (1-9)")
    parser.add_argument("--out", default=str(REPO / "docs" / "reliability.md"))
    args = parser.parse_args(argv)
    os.environ.setdefault("ROLLFLEET_LOG_LEVEL", "warning")
    only = set(args.only.split(",")) if args.only else None
    t0 = time.monotonic()
    figs = asyncio.run(run_all(args.quick, only))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    page = render(figs, args.quick, time.monotonic() - t0)
    failed = [f.scenario for f in figs if not f.passed]
    if failed:
        # The page states the promises as kept: never publish it over figures that break one.
        rejected = out.with_name(out.stem + ".failed.md")
        rejected.write_text(page)
        print(
            f"broken promises in scenarios {failed}; {out} left as it was, this run is in {rejected}", file=sys.stderr
        )
        return 1
    out.write_text(page)
    print(f"wrote {out}")
    return 0
