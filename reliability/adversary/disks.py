"""Worker disk faults: a replica's own disk full, or read-only, for a few seconds (column D).

Real OS faults, no mocks:

``disk_full``      RLIMIT_FSIZE of the running worker process lowered to 0 (``prlimit --pid``,
                   util-linux): every write that grows a file fails with EFBIG, as writes to a full
                   disk fail with ENOSPC (CPython ignores SIGXFSZ). In-place writes to blocks a
                   file already has go through, as they do on a full disk. Its log file is on the
                   same "disk": its log lines are lost meanwhile, and it must go on regardless
                   (``rollfleet.runtime.logs.LineLogger``); the oracle reads no worker log.
``disk_readonly``  the worker's ``--local-dir`` bind-mounted read-only over itself: every open for
                   writing, create, rename or unlink there fails with EROFS, as on a filesystem
                   remounted read-only after I/O errors (ext4's ``errors=remount-ro``). ``chmod -w``
                   would not do: the harness runs as root, which write permission does not bind.
                   Needs mount privilege (root with CAP_SYS_ADMIN); skipped, and said, without it.

Both last 2-8 s (``for_s``) and are then lifted. ``victim``: ``random`` (whatever the replica
does meanwhile), or ``preparing`` (a version is published right after the fault begins, so the
replica prepares it on the failing disk). The promise judged (``converged``, per fault): the
replica keeps serving what it has (``served``, ``available`` judge that as always) and, once its
disk is back, reaches the version latest then within ``CONVERGE_S``: a failed prepare is retried
after the backoff of ``rollfleet.workers.version_following`` (2, 4, 8 s), and a half-written version is
never trusted (its marker absent: the retry reseeds).

The adversary calls ``disk_event`` (one line in ``run_event``) and ``watch_after_disks`` (one in
``settle``); the oracle calls ``judge_disks`` (one line in ``judge``). ``disk_verdict`` is the pure
rule it applies to each fault.
"""

from __future__ import annotations

import asyncio
import functools
import shutil
import subprocess
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

DISK_FAULT_KINDS = ("disk_full", "disk_readonly")
CONVERGE_S = 20.0  # a failed version's retries (2, 4, 8 s apart) after a fault of up to 8 s, a drain
DAMAGE_BEFORE_S = 60.0  # a store fault this recent may have lengthened the version's backoff (MAX_RETRY_S)


# -- the faults (real OS ones) -----------------------------------------------------------------------


def limit_file_size(pid: int, limit: str) -> None:
    """Set the soft RLIMIT_FSIZE of a running process (``"0"``, ``"unlimited"``); the hard limit
    stays unlimited, so lifting it again needs no privilege (the harness lacks CAP_SYS_RESOURCE)."""
    subprocess.run(["prlimit", "--pid", str(pid), f"--fsize={limit}:unlimited"], check=True, capture_output=True)


def mount_readonly(path: Path) -> None:
    """Bind-mount ``path`` read-only over itself: writes there fail with EROFS until ``unmount``."""
    subprocess.run(["mount", "--bind", str(path), str(path)], check=True, capture_output=True)
    try:
        subprocess.run(["mount", "-o", "remount,bind,ro", str(path)], check=True, capture_output=True)
    except subprocess.CalledProcessError:
        unmount(path)
        raise


def unmount(path: Path) -> None:
    """Undo ``mount_readonly``; lazily where a file opened through the mount keeps it busy."""
    done = subprocess.run(["umount", str(path)], capture_output=True)
    if done.returncode != 0:
        subprocess.run(["umount", "-l", str(path)], check=True, capture_output=True)


@functools.cache
def can_mount() -> bool:
    """Whether this host lets the harness bind-mount a directory read-only (tried once, on a
    scratch directory)."""
    if shutil.which("mount") is None or shutil.which("umount") is None:
        return False
    with tempfile.TemporaryDirectory(prefix="rf-mount-probe-") as d:
        try:
            mount_readonly(Path(d))
        except (subprocess.CalledProcessError, OSError):
            return False
        try:
            unmount(Path(d))
        except (subprocess.CalledProcessError, OSError):
            return False
    return True


def why_not(kind: str) -> str | None:
    """Why this host cannot inject ``kind`` (None: it can)."""
    if kind == "disk_full" and shutil.which("prlimit") is None:
        return "no prlimit (util-linux)"
    if kind == "disk_readonly" and not can_mount():
        return "no mount privilege (root with CAP_SYS_ADMIN) for a read-only bind mount"
    return None


# -- the adversary's side --------------------------------------------------------------------------


async def disk_event(adv: Any, kind: str, p: dict[str, Any]) -> bool:
    """One disk fault on one echo worker, lifted after ``for_s`` (recorded in
    ``Timeline.disk_faults`` for the oracle); False when skipped."""
    m = adv.machine
    reason = why_not(kind)
    if reason is not None:
        adv.say(f"{kind} skipped", reason=reason)
        return False
    wp = await adv.victim("random", "echo")
    local = m.workdir / "local" / wp.worker_id if wp is not None else None
    if wp is None or local is None or not local.is_dir():
        adv.say(f"{kind} skipped", reason="no victim")
        return False
    adv.busy.add(wp.worker_id)  # (no other event, nor the fleet keeper, touches it meanwhile)
    record: dict[str, Any] = {"kind": kind, "worker": wp.worker_id, "start": wp.start, "victim": p["victim"]}
    mounted = False
    try:
        try:
            if kind == "disk_full":
                limit_file_size(wp.proc.pid, "0")
            else:
                mount_readonly(local)
                mounted = True
        except subprocess.CalledProcessError as exc:  # (the process ended meanwhile)
            adv.say(f"{kind} skipped", worker=wp.worker_id, reason=(exc.stderr or b"").decode()[:200])
            return False
        record["from"] = time.time()
        adv.say("disk full" if kind == "disk_full" else "disk read-only", worker=wp.worker_id, **p)
        if p["victim"] == "preparing":  # a version to prepare on the failing disk
            adv.spawn(adv.publish(f"under {kind}"))
        await asyncio.sleep(p["for_s"])
        return True
    finally:
        try:
            if kind == "disk_full" and wp.alive:
                limit_file_size(wp.proc.pid, "unlimited")
            elif mounted:
                unmount(local)
        except subprocess.CalledProcessError as exc:  # (it died just now: its limit went with it)
            adv.say("disk fault not lifted", worker=wp.worker_id, kind=kind, error=(exc.stderr or b"").decode()[:200])
        finally:
            if "from" in record:
                record["to"] = time.time()
                m.timeline.disk_faults.append(record)
                adv.say("disk back", worker=wp.worker_id, kind=kind)
            adv.busy.discard(wp.worker_id)


async def watch_after_disks(adv: Any) -> None:
    """Keep the run going (the tap listening) until every replica whose disk came back has reached
    the version latest then, or ``CONVERGE_S`` has passed since (so the oracle can judge the last
    faults too); at most that long."""
    m = adv.machine
    faults = list(getattr(m.timeline, "disk_faults", []))
    if not faults:
        return
    until = max(float(f["to"]) for f in faults) + CONVERGE_S + 1.5
    if until <= time.time():
        return
    adv.say("watching the replicas whose disk came back", for_s=round(until - time.time(), 1))
    commits = sorted((c, v) for v, _, c in m.timeline.commits)
    while time.time() < until:
        replicas = {r.worker_id: r for r in adv.admin.fleet.replicas()}
        behind = []
        for f in faults:
            latest = max((v for c, v in commits if c <= float(f["to"])), default=0)
            proc = m.current.get(f["worker"])
            if proc is None or proc.start != f["start"] or not proc.alive:
                continue  # (that process is gone: nothing to watch)
            r = replicas.get(f["worker"])
            if r is None or r.active_version < latest:
                behind.append(f["worker"])
        if not behind:
            return
        await asyncio.sleep(0.5)


# -- the oracle's side -----------------------------------------------------------------------------


def _overlaps(windows: list[tuple[float, float]], a: float, b: float) -> bool:
    return any(x <= b and y >= a for x, y in windows)


def disk_verdict(
    fault: dict[str, Any],
    proc: tuple[float, float | None],
    seen: list[tuple[float, int]],
    latest: int,
    *,
    horizon: float,
    disturbed: list[tuple[float, float]],
    damaged: list[tuple[float, float]],
    bound: float = CONVERGE_S,
) -> tuple[str, str]:
    """The rule ``converged`` applies to one disk fault, on plain data: ("ok" | "violation" |
    "unverified", why).

    ``proc``: the faulted process's (start, end or None); ``seen``: its registry entries (time,
    active version); ``latest``: the version committed last when the disk came back;
    ``horizon``: the last moment the run watched the registry; ``disturbed``: windows in which this
    replica was frozen or cut off, or the broker out, or its disk failed again; ``damaged``: windows
    of store faults (a version hidden, corrupt or slow to read: its failures are the store's, and
    lengthen the backoff)."""
    healed = float(fault["to"])
    deadline = healed + bound
    from reliability.adversary.objstore import converged_by

    ok, shown = converged_by(seen, latest, deadline)
    if ok:  # (at latest by the deadline: whatever came after, it did not stay behind)
        return "ok", f"at v{shown}"
    end = proc[1]
    if (end is not None and end < deadline) or deadline > horizon:
        return "unverified", "the replica process, or the run, ended within the bound"
    if _overlaps(disturbed, healed, deadline):
        return "unverified", "the replica frozen or cut off, the broker out, or its disk failing again within the bound"
    if _overlaps(damaged, float(fault["from"]) - DAMAGE_BEFORE_S, deadline):
        return "unverified", "a store fault near the disk fault"
    if ok is None:
        return "unverified", "the replica's registry unheard near the bound"
    return "violation", (
        f"still at v{shown} {bound:g} s after its disk came back ({fault['kind']} for "
        f"{healed - float(fault['from']):.1f} s), v{latest} committed by then"
    )


def judge_disks(o: Any) -> None:
    """``converged`` for every disk fault in the oracle's timeline (``Oracle.check``; what cannot
    be judged counts as not verifiable)."""
    faults = list(getattr(o.tl, "disk_faults", []) or [])
    if not faults:
        return
    entries: dict[str, list[tuple[float, int]]] = defaultdict(list)
    for t, worker, status in o.tap.fleet:
        if status is not None:
            entries[worker].append((t, int(status.active_version)))
    horizon = max((t for t, _, _ in o.tap.fleet), default=0.0)
    damaged = [(float(a), float(b)) for _, a, b in [*o.tl.hidden, *o.tl.corrupt]]
    damaged += [(float(a), float(b)) for _, a, b in getattr(o.tl, "slow", []) or []]
    damaged += [(float(f["from"]), float(f["to"])) for f in getattr(o.tl, "store_faults", []) or []]
    for f in faults:
        proc = next((w for w in o.tl.workers if w.worker_id == f["worker"] and w.start == f["start"]), None)
        if proc is None or "to" not in f:
            o.unverified["converged: a disk fault's process not in the timeline"] += 1
            continue
        again = [(float(g["from"]), float(g["to"])) for g in faults if g is not f and g["worker"] == f["worker"]]
        disturbed = [*map(tuple, proc.stops), *map(tuple, o.broker_out), *again]
        verdict, why = disk_verdict(
            f,
            (proc.start, proc.end),
            [e for e in entries[f["worker"]] if e[0] >= proc.start],
            o.latest_at(float(f["to"])),
            horizon=horizon,
            disturbed=disturbed,  # type: ignore[arg-type]
            damaged=damaged,
        )
        if verdict == "unverified":
            o.unverified[f"converged: {why}"] += 1
            continue
        o.check("converged", verdict == "ok", f["worker"], f"{f['worker']} {why}")
