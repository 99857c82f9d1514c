"""Test faults: stop a real process at a named point, so tests kill it exactly there.

``ROLLFLEET_FAULT=kill:<point>`` SIGKILLs the process at ``<point>``;
``ROLLFLEET_FAULT=pause:<point>`` prints ``PAUSED <point>`` on stdout and sleeps there until
the test kills it (or, with ``ROLLFLEET_FAULT_RELEASE=<path>``, until that file exists: the
process goes on from the point, as one that was frozen there);
``ROLLFLEET_FAULT=raise:<point>`` raises ``InjectedFault`` there (an error nothing around it
expected: a defect). Real processes die for real, so the tests exercise the
broker's redelivery and the store's recovery, not a simulation of them. Unset (production), a point costs one
dict lookup. These are test faults only; the storage hooks of object-store mounts are
``policy_store.hooks``.
"""

from __future__ import annotations

import os
import signal
import sys
import time

ENV = "ROLLFLEET_FAULT"
RELEASE_ENV = "ROLLFLEET_FAULT_RELEASE"  # a paused point returns once this file exists
POINTS = {
    # policy store, trainer side (policy_store.writer)
    "publish:after-shard": "a shard is written and fsynced, no index yet",
    "publish:before-rename": "the whole temporary version directory is complete",
    "publish:after-rename": "visible, before the store directory is fsynced and the hook runs",
    # policy store, replica side (policy_store.materialize)
    "apply:mid-version": "some tensors of a delta are applied in place, marker removed",
    "apply:before-marker": "the whole delta is applied and verified, marker not yet written",
    "seed:mid-copy": "part of a full version is copied into the staging directory",
    # object stores (policy_store.bucket)
    "bucket:mid-download": "a chunk of a version's download is written and journaled, others not yet",
    "bucket:mid-upload": "a file of a version is uploaded, its index not yet",
    # the commit (trainer_client.versions)
    "commit:before-cas": "v.<N> is created in the policy KV, latest not yet moved",
    "commit:before-announce": "latest moved, versions.published not yet sent",
    # the worker
    "worker:before-result-store": "a job's claim (if it has one) checked a last time, its answer not yet stored",
    "worker:after-result-before-ack": "a job's result is stored, the job not yet acked",
    "worker:mid-chunks": "a chunk of a large answer is stored, its head not yet",
    "worker:before-activation": "a version is prepared, the engine not yet paused",
    "worker:mid-prepare": "a newer version is being prepared (nothing of it read yet), the old one served",
    "worker:mid-activation": "exact jobs of the old version are drained, the engine not yet paused",
    "worker:job-delivered": "a job was delivered, not yet decoded or admitted",
    "worker:after-materialize": "a version is materialized (local marker moved), not yet staged on the engine",
    "worker:mid-drain": "activating: exact jobs of the old version may still run, none handed back yet",
}
ACTIONS = ("kill", "pause", "raise")


class InjectedFault(RuntimeError):
    """Raised at a point by ``ROLLFLEET_FAULT=raise:<point>``: stands for an unexpected error."""


# The environment's own mapping, read without ``os.environ.get``'s key encoding and the KeyError
# it raises and catches for an unset variable (a worker passes two points per job). It is the
# mapping ``os.environ`` writes through to, so a fault armed while the process runs is seen.
_ENVIRON = getattr(os.environ, "_data", None)
_KEY: object = os.environ.encodekey(ENV) if _ENVIRON is not None else ENV  # type: ignore[attr-defined]


def point(name: str) -> None:
    """Kill or pause here if ``ROLLFLEET_FAULT`` names this point."""
    raw = _ENVIRON.get(_KEY) if _ENVIRON is not None else os.environ.get(ENV)
    if not raw:
        return
    spec = os.environ.get(ENV) or ""
    action, _, where = spec.partition(":")
    if action not in ACTIONS or where not in POINTS:
        raise ValueError(f"{ENV}={spec!r}: expected <{'|'.join(ACTIONS)}>:<point>, points: {', '.join(POINTS)}")
    if where != name:
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action == "raise":
        raise InjectedFault(f"fault injected at {name}")
    sys.stdout.write(f"PAUSED {name}\n")
    sys.stdout.flush()
    release = os.environ.get(RELEASE_ENV)
    while not (release and os.path.exists(release)):  # (the whole process stops here, its loop too)
        time.sleep(0.02 if release else 3600)


def env(action: str, name: str, release: str | os.PathLike[str] | None = None) -> dict[str, str]:
    """The environment entry that arms ``name`` in a child process; ``release``: a pause there
    ends once this file exists."""
    if action not in ACTIONS or name not in POINTS:
        raise ValueError(f"unknown fault {action}:{name}")
    armed = {ENV: f"{action}:{name}"}
    return armed if release is None else {**armed, RELEASE_ENV: os.fspath(release)}
