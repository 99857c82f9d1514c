"""Where the request path's CPU goes: rollfleet against the minimal nats-py loop, side by side.

``python -m benchmarks.request_path_account [--jobs N] [--rounds R]`` runs both systems of
``bench_request_path`` (worker processes, one broker, the same window) and writes
``benchmarks/results/request_path_account.{json,md}``:

- CPU per job of each process (client, both workers, broker), from /proc, median of the rounds;
- the client's garbage collector: collections and time per job, by generation (``gc.callbacks``);
- calls per job on each side (``sys.setprofile``, in a run of its own: counting slows a run
  down, so these runs are not timed): Python-level calls and all calls, and the functions whose
  call counts differ most between the two systems, by module;
- the contract's own per-job work, each step timed alone in this process (``timeit``, best of
  five): what rollfleet does for a job that the minimal loop does not (check and fingerprint the
  request, issue and verify its job id, decode and check the job and the answer, label and name
  the answer, count it), summed per side and set against the minimal loop's whole CPU per job:
  the throughput that work alone would leave, had rollfleet no other cost at all.

The workers run under a small bootstrap (``python -c``) that arms the counter on SIGUSR1 and
writes its counts on the second one, then runs the module it was given as ``__main__``: the
worker itself is unchanged. A diagnostic, not a target: ``make bench`` does not run it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import json
import os
import signal
import statistics
import sys
import tempfile
import time
import timeit
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks import bench_request_path as rp
from benchmarks._fleet import REPO
from harness import temp_broker

RESULTS = REPO / "benchmarks" / "results"
WINDOW = 256

_BOOTSTRAP = (
    "import runpy, sys; from benchmarks.request_path_account import arm_counter; arm_counter(); "
    "sys.argv = sys.argv[1:]; runpy.run_module(sys.argv[0], run_name='__main__', alter_sys=True)"
)


# -- counting calls ----------------------------------------------------------------------------


def _where(filename: str) -> str:
    """A code object's file, short: the package path below site-packages, the stdlib module, or
    the repository path."""
    for cut in ("/site-packages/", f"/python{sys.version_info[0]}.{sys.version_info[1]}/", str(REPO) + "/"):
        if cut in filename:
            return filename.split(cut, 1)[1]
    return filename


class CallCounter:
    def __init__(self) -> None:
        self.calls: collections.Counter[str] = collections.Counter()

    def _profile(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call":
            code = frame.f_code
            self.calls[f"{_where(code.co_filename)}:{code.co_name}"] += 1
        elif event == "c_call":
            self.calls[f"<C>:{getattr(arg, '__qualname__', repr(arg))}"] += 1

    def start(self) -> None:
        self.calls.clear()
        sys.setprofile(self._profile)

    def stop(self) -> dict[str, int]:
        sys.setprofile(None)
        return dict(self.calls)


def arm_counter() -> None:
    """In a worker process (the bootstrap): the first SIGUSR1 starts counting calls, the second
    writes the counts to ``$RF_ACCOUNT_DIR/calls-<pid>.json``."""
    counter = CallCounter()
    on = [False]

    def toggle(signum: int, frame: Any) -> None:
        if not on[0]:
            on[0] = True
            counter.start()
            return
        on[0] = False
        counts = counter.stop()
        out = Path(os.environ["RF_ACCOUNT_DIR"]) / f"calls-{os.getpid()}.json"
        out.write_text(json.dumps(counts))

    signal.signal(signal.SIGUSR1, toggle)


def _counted(cmd: list[str]) -> list[str]:
    """``[python, -m, module, *args]`` run under the bootstrap."""
    assert cmd[1] == "-m", cmd
    return [cmd[0], "-c", _BOOTSTRAP, *cmd[2:]]


# -- the two systems ---------------------------------------------------------------------------


def _system(name: str, url: str, tmp: Path, wrap: Callable[[list[str]], list[str]] = list) -> Any:
    if name == "rollfleet":
        return rp.RollfleetSystem(url, "proc", tmp, wrap=wrap)
    job_bytes, result_bytes = rp.message_sizes()
    return rp.BaselineSystem(url, "proc", tmp, job_bytes, result_bytes, wrap=wrap)


class _GcTimer:
    def __init__(self) -> None:
        self.by_gen: dict[int, list[float]] = {}
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
            return
        entry = self.by_gen.setdefault(info["generation"], [0, 0.0])
        entry[0] += 1
        entry[1] += time.perf_counter() - self._t0


async def _timed(name: str, url: str, tmp: Path, jobs: int, broker_pid: int) -> dict[str, float]:
    system = _system(name, url, tmp)
    await system.start()
    try:
        await rp.throughput(system.job, max(50, jobs // 10), WINDOW)
        pids = [p.pid for p in system.procs]
        before = rp.cpu_snapshot(broker_pid, pids)
        timer = _GcTimer()
        gc.callbacks.append(timer)
        try:
            out = await rp.throughput(system.job, jobs, WINDOW)
        finally:
            gc.callbacks.remove(timer)
        after = rp.cpu_snapshot(broker_pid, pids)
    finally:
        await system.close()
    row = {"jobs_s": out["jobs_s"]}
    row |= {f"cpu_us_{k}": (after[k] - before[k]) / jobs * 1e6 for k in before}
    for gen in range(3):
        count, seconds = timer.by_gen.get(gen, [0, 0.0])
        row[f"client_gc{gen}_per_1000_jobs"] = count / jobs * 1000
        row[f"client_gc{gen}_us"] = seconds / jobs * 1e6
    return row


async def _counted_run(name: str, url: str, tmp: Path, jobs: int) -> dict[str, dict[str, float]]:
    out_dir = Path(tempfile.mkdtemp(prefix="rf-account-", dir=tmp))
    os.environ["RF_ACCOUNT_DIR"] = str(out_dir)
    system = _system(name, url, tmp, wrap=_counted)
    await system.start()
    try:
        await rp.throughput(system.job, max(50, jobs // 10), WINDOW)
        for proc in system.procs:
            os.kill(proc.pid, signal.SIGUSR1)
        await asyncio.sleep(0.5)
        client = CallCounter()
        client.start()
        try:
            await rp.throughput(system.job, jobs, WINDOW)
        finally:
            client_calls = client.stop()
        for proc in system.procs:
            os.kill(proc.pid, signal.SIGUSR1)
        files = [out_dir / f"calls-{p.pid}.json" for p in system.procs]
        deadline = time.monotonic() + 30
        while not all(f.exists() for f in files):
            if time.monotonic() > deadline:
                raise TimeoutError("the workers did not write their call counts")
            await asyncio.sleep(0.1)
        await asyncio.sleep(0.5)  # (written in one go; let the last write finish)
    finally:
        await system.close()
    workers: collections.Counter[str] = collections.Counter()
    for f in files:
        workers.update(json.loads(f.read_text()))
    return {
        "client": {k: v / jobs for k, v in client_calls.items()},
        "workers": {k: v / jobs for k, v in workers.items()},
    }


# -- the contract's own work, timed alone --------------------------------------------------------


def _best_us(fn: Callable[[], object], number: int = 2000) -> float:
    return min(timeit.repeat(fn, number=number, repeat=5)) / number * 1e6


def contract_work() -> dict[str, dict[str, float]]:
    """Each step of the contract a job passes, on the side that does it, in microseconds."""
    from prometheus_client import CollectorRegistry, Histogram

    from rollfleet.schemas import Names, RolloutResult, VersionConstraint, encode
    from rollfleet.schemas.limits import DEFAULT_LIMITS, check_job
    from rollfleet.schemas.messages import served_within
    from rollfleet.schemas.names import check_token
    from rollfleet.schemas.wire import decode_job
    from rollfleet.trainer_client import answers
    from rollfleet.trainer_client.own_job_ids import JobIds
    from rollfleet.trainer_client.requests import asked_of
    from rollfleet.workers.engines.echo import EchoEngine
    from rollfleet.workers.served_version import ServedVersion

    names, ids = Names("bench"), JobIds("bench", b"s" * 32)

    issued = ids.issue(None)

    def request() -> tuple[Any, bytes]:  # (submit's argument checks, then the job built; its id is a step of its own)
        asked = asked_of(None, 0, None, None)
        asked.resolve(0), asked.written
        return rp.sample_job(job_id=issued)

    job, data = request()
    subject = names.job_subject("min", 0)
    loop = asyncio.new_event_loop()
    generation = loop.run_until_complete(EchoEngine().generate(job.job_id, job.payload))
    now = time.time()

    def answer() -> RolloutResult:
        return rp.echo_result(job, generation.outputs, now)

    result = answer()
    result_data = encode(result)
    result_subject = names.result_subject("bench", job.idempotency_key, job.job_id, "echo-0")
    served = ServedVersion(0)
    histogram = Histogram("x_seconds", "x", registry=CollectorRegistry())
    constraint = VersionConstraint("min", 0)
    client = {
        "request: argument checks, encode, type-checked decode, payload checks, fingerprint, wire form": request,
        "job id: a nonce and its MAC": lambda: ids.issue(None),
        "answer: typed decode": lambda: answers.decode_outcome(result_data),
        "answer: its subject names its job and replica": lambda: answers.authentic(names, result_subject, result),
        "answer: its job id is one this client issued (MAC)": lambda: ids.issued(job.job_id, job.idempotency_key),
        "answer: the request's fingerprint, served within its constraint": lambda: (
            answers.judge(result, job.fingerprint, lambda _: True),
            served_within(constraint, result),
        ),
    }
    worker = {
        "job: decode, checks, subject, client id": lambda: (
            check_job(decode_job(data, max_bytes=DEFAULT_LIMITS.max_job_bytes)),
            names.parse_job_subject(subject),
            check_token(job.client_id, "client_id"),
        ),
        "job: admitted at the served version": lambda: (served.allows(job.constraint), job.claimed),
        "answer: labelled, checked within its constraint, encoded, named": lambda: (
            served_within(job.constraint, answer()),
            encode(result),
            names.result_subject(job.client_id, job.idempotency_key, job.job_id, "echo-0"),
        ),
        "metrics: two latency observations": lambda: (histogram.observe(0.001), histogram.observe(0.0001)),
    }
    engine = EchoEngine()

    async def generations(n: int) -> None:  # (inside one running loop, as a worker runs them)
        for _ in range(n):
            await engine.generate(job.job_id, job.payload)

    def echo_us() -> float:
        return min(timeit.repeat(lambda: loop.run_until_complete(generations(2000)), number=1, repeat=5)) / 2000 * 1e6

    out = {
        "client": {k: _best_us(fn) for k, fn in client.items()},
        "workers": {k: _best_us(fn) for k, fn in worker.items()},
        "engine": {"the echo engine's generation (the work a real engine does on a GPU)": echo_us()},
    }
    loop.close()
    return out


# -- the account -------------------------------------------------------------------------------


def _totals(calls: dict[str, float]) -> tuple[float, float]:
    python = sum(v for k, v in calls.items() if not k.startswith("<C>:"))
    return python, sum(calls.values())


def _by_module(calls: dict[str, float]) -> dict[str, float]:
    out: collections.Counter[str] = collections.Counter()
    for key, v in calls.items():
        if not key.startswith("<C>:"):
            out[key.rsplit(":", 1)[0]] += v
    return dict(out)


def _differences(ours: dict[str, float], base: dict[str, float], top: int) -> list[tuple[str, float, float]]:
    keys = set(ours) | set(base)
    rows = [(k, ours.get(k, 0.0), base.get(k, 0.0)) for k in keys]
    rows.sort(key=lambda r: -(r[1] - r[2]))
    return rows[:top]


async def account(jobs: int, rounds: int, counted_jobs: int) -> dict[str, Any]:
    with temp_broker("rf-account-") as broker, tempfile.TemporaryDirectory(prefix="rf-account-logs-") as logs:
        assert broker.proc is not None
        tmp = Path(logs)
        timed: dict[str, list[dict[str, float]]] = {"baseline": [], "rollfleet": []}
        for r in range(rounds):
            for name in ("baseline", "rollfleet") if r % 2 == 0 else ("rollfleet", "baseline"):
                timed[name].append(await _timed(name, broker.url, tmp, jobs, broker.proc.pid))
                print(f"round {r + 1}/{rounds} {name}: {timed[name][-1]['jobs_s']:.0f} jobs/s", flush=True)
        counts = {name: await _counted_run(name, broker.url, tmp, counted_jobs) for name in ("baseline", "rollfleet")}
    medians = {name: {k: statistics.median(r[k] for r in runs) for k in runs[0]} for name, runs in timed.items()}
    sides: dict[str, Any] = {}
    for side in ("client", "workers"):
        ours, base = counts["rollfleet"][side], counts["baseline"][side]
        (py_ours, all_ours), (py_base, all_base) = _totals(ours), _totals(base)
        sides[side] = {
            "python_calls_per_job": [py_ours, py_base],
            "all_calls_per_job": [all_ours, all_base],
            "more_calls_than_baseline": _differences(ours, base, 30),
            "python_calls_by_module": _differences(_by_module(ours), _by_module(base), 20),
        }
    return {
        "jobs": jobs,
        "rounds": rounds,
        "counted_jobs": counted_jobs,
        "window": WINDOW,
        "timed": medians,
        "timed_each_round": timed,
        "calls": sides,
    }


def write(doc: dict[str, Any]) -> tuple[Path, Path]:
    RESULTS.mkdir(parents=True, exist_ok=True)
    js, md = RESULTS / "request_path_account.json", RESULTS / "request_path_account.md"
    js.write_text(json.dumps(doc, indent=1))
    ours, base = doc["timed"]["rollfleet"], doc["timed"]["baseline"]
    lines = [
        "# request path: where the CPU goes",
        "",
        f"{time.strftime('%Y-%m-%dT%H:%M:%S')}; {doc['jobs']} jobs per round, window {doc['window']}, "
        f"{doc['rounds']} rounds alternating, medians; calls counted over {doc['counted_jobs']} further jobs "
        "(`python -m benchmarks.request_path_account`).",
        "",
        "| per job | rollfleet | minimal nats-py loop | difference |",
        "|---|---|---|---|",
        f"| jobs/s | {ours['jobs_s']:.1f} | {base['jobs_s']:.1f} | {ours['jobs_s'] / base['jobs_s']:.4f}x |",
    ]
    for key, label in (
        ("cpu_us_client", "CPU, client (us)"),
        ("cpu_us_workers", "CPU, both workers (us)"),
        ("cpu_us_broker", "CPU, broker (us)"),
    ):
        lines.append(f"| {label} | {ours[key]:.2f} | {base[key]:.2f} | {ours[key] - base[key]:+.2f} |")
    total_o = sum(ours[k] for k in ours if k.startswith("cpu_us_"))
    total_b = sum(base[k] for k in base if k.startswith("cpu_us_"))
    lines.append(f"| CPU, all (us) | {total_o:.2f} | {total_b:.2f} | {total_o - total_b:+.2f} |")
    for gen in range(3):
        lines.append(
            f"| client GC gen {gen}: time (us) | {ours[f'client_gc{gen}_us']:.2f} | {base[f'client_gc{gen}_us']:.2f} "
            f"| {ours[f'client_gc{gen}_us'] - base[f'client_gc{gen}_us']:+.2f} |"
        )
    for side in ("client", "workers"):
        c = doc["calls"][side]
        (po, pb), (ao, ab) = c["python_calls_per_job"], c["all_calls_per_job"]
        lines.append(f"| {side}: Python-level calls | {po:.1f} | {pb:.1f} | {po - pb:+.1f} |")
        lines.append(f"| {side}: all calls (with C) | {ao:.1f} | {ab:.1f} | {ao - ab:+.1f} |")
    work = doc["contract_us"]
    lines += [
        "",
        "## the contract's own work per job, each step timed alone",
        "",
        "| side | step | us |",
        "|---|---|---|",
    ]
    for side in ("client", "workers", "engine"):
        for step, us in work[side].items():
            lines.append(f"| {side} | {step} | {us:.3f} |")
    contract = sum(work["client"].values()) + sum(work["workers"].values())
    engine = sum(work["engine"].values())
    lines += [
        "",
        f"The contract's steps add {contract:.2f} us per job, the echo engine {engine:.2f} us, against the minimal "
        f"loop's {total_b:.2f} us of CPU per job in all: with no other cost at all, rollfleet would run at "
        f"{total_b / (total_b + contract):.4f}x its throughput ({total_b / (total_b + contract + engine):.4f}x with "
        f"the engine's work). The 0.9x target leaves {total_b / 9:.2f} us per job above the minimal loop; the "
        f"contract's steps take {contract / (total_b / 9) * 100:.1f} % of that, "
        f"{(contract + engine) / (total_b / 9) * 100:.1f} % with the engine's, before any plumbing (pulling, "
        "admitting and answering a job, the client's handles, the garbage they leave).",
    ]
    for side in ("client", "workers"):
        lines += ["", f"## {side}: calls per job, most above the baseline", "", "| function | rollfleet | baseline |"]
        lines.append("|---|---|---|")
        for key, o, b in doc["calls"][side]["more_calls_than_baseline"]:
            lines.append(f"| `{key}` | {o:.2f} | {b:.2f} |")
        lines += ["", f"## {side}: Python-level calls per job by module", "", "| module | rollfleet | baseline |"]
        lines.append("|---|---|---|")
        for key, o, b in doc["calls"][side]["python_calls_by_module"]:
            lines.append(f"| `{key}` | {o:.2f} | {b:.2f} |")
    md.write_text("\n".join(lines) + "\n")
    return js, md


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.request_path_account")
    p.add_argument("--jobs", type=int, default=15_000, help="jobs per timed round")
    p.add_argument("--rounds", type=int, default=6, help="timed rounds per system, alternating")
    p.add_argument("--counted-jobs", type=int, default=3_000, help="jobs of the call-counting run")
    args = p.parse_args(argv)
    doc = asyncio.run(account(args.jobs, args.rounds, args.counted_jobs))
    doc["contract_us"] = contract_work()  # (timed alone, with no loop running: it runs its own)
    js, md = write(doc)
    print(md.read_text())
    print(f"wrote {js} and {md}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
