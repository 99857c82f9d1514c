"""A worker's settings and their defaults: the one table that ``WorkerConfig``'s defaults, the
``rollfleet worker`` flags (their defaults and help) and the configuration reference
(``rollfleet.cli.reference.worker_defaults_markdown``, in docs/configuration.md) are made from.

A default is written here and nowhere else; ``tests/test_worker_settings.py`` fails when the
config, the CLI or the reference says otherwise. A setting with a flag is parsed by its default's
type: a whole number as a count (at least 1), a float as seconds, a bool as a switch that is off.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class WorkerSetting:
    """One ``WorkerConfig`` field: its default, what it means (the flag's help, the reference's
    text), and its ``rollfleet worker`` flag (None: set only through ``WorkerConfig``)."""

    field: str
    default: int | float | bool
    meaning: str
    flag: str | None = None
    # Where the command's default is not the library's: a ``rollfleet worker`` started with a store
    # waits for the trainer's first commit; a worker built in a program does not, unless told to.
    cli_default: int | float | None = None
    note: str = ""  # said in the reference only (too long for --help)

    @property
    def seconds(self) -> bool:
        return isinstance(self.default, float)

    @property
    def dest(self) -> str:
        """The flag's attribute on argparse's namespace."""
        assert self.flag is not None
        return self.flag.lstrip("-").replace("-", "_")

    @property
    def flag_default(self) -> int | float | bool:
        return self.default if self.cli_default is None else self.cli_default


def shown(value: int | float | bool) -> str:
    """A default as the help and the reference print it: ``4``, ``20 s``, ``off``."""
    if isinstance(value, bool):
        return "on" if value else "off"
    return f"{value:g} s" if isinstance(value, float) else str(value)


# In the order the reference lists them: what an operator sets first, then the pulling machinery.
WORKER_SETTINGS: tuple[WorkerSetting, ...] = (
    WorkerSetting("capacity", 4, "jobs run at once; a worker never pulls more", "--capacity"),
    WorkerSetting(
        "heartbeat_s",
        20.0,
        "registry refresh (no acknowledgement); a replica silent for 3 of these stops counting as live",
        "--heartbeat",
        note="A client times each refresh by its own clock when it hears it, so replicas whose clocks disagree "
        "with the trainer's are judged alike.",
    ),
    WorkerSetting(
        "health_s",
        2.0,
        "the engine's health is checked this often (a dead or hung engine: the replica takes no jobs)",
        "--health",
        note="Checked locally: no broker traffic.",
    ),
    WorkerSetting(
        "exact_drain_s",
        30.0,
        "before an activation, how long exact jobs of the old version may run on; then they are aborted and "
        "handed back unanswered (another replica at that version may serve them)",
        "--exact-drain",
    ),
    WorkerSetting(
        "checkpoint_tokens",
        64,
        "resumable jobs: checkpoint the generation on the broker every N tokens (or --checkpoint-s, whichever first)",
        "--checkpoint-tokens",
    ),
    WorkerSetting(
        "checkpoint_s", 2.0, "resumable jobs: checkpoint the generation at least this often", "--checkpoint-s"
    ),
    WorkerSetting(
        "follow_versions", False, "without --store (echo): activate each committed version", "--follow-versions"
    ),
    WorkerSetting(
        "catch_up_wait_s",
        0.0,
        "with --store: how long to wait for a first commit before serving the base",
        "--catch-up-wait",
        cli_default=3600.0,
    ),
    WorkerSetting(
        "prepare_timeout_s",
        1800.0,
        "with --store: a prepare still running after this (a read that is slow or never returns) marks the "
        "replica degraded; it runs on, and its work is kept",
        "--prepare-timeout",
    ),
    WorkerSetting(
        "verify_live",
        False,
        "hash the live weights after each activation, reload them all if they differ from the checkpoint, and "
        "announce their digest",
        "--verify-live",
    ),
    WorkerSetting("resync_s", 120.0, "re-read `latest` this often (commits are normally heard at once)"),
    WorkerSetting("drain_timeout_s", 120.0, "on stop, how long jobs in flight may run to finish; then redelivered"),
    WorkerSetting("progress_s", 30.0, "period of the info-level progress line"),
    WorkerSetting(
        "aging_s",
        5.0,
        "a subject whose work has waited this long goes first, so loose work never starves behind tight work",
    ),
    WorkerSetting("wait_pull_s", 240.0, "a waiting pull request's expiry at the broker (renewed when it ends)"),
    WorkerSetting("hot_s", 30.0, "a subject stays listened to (gets waiting pulls) this long after its last job"),
    WorkerSetting("max_waiting_pulls", 6, "subjects with waiting pull requests at once (the version's window first)"),
    WorkerSetting("rebalance_s", 1.0, "slots idle this long on one subject may be taken back for backlog elsewhere"),
    WorkerSetting(
        "standby_s",
        240.0,
        "a subject whose pull request was refused (the broker's `max_waiting` reached) stands by this long unless "
        "called in",
    ),
)

WORKER_DEFAULTS: dict[str, int | float | bool] = {s.field: s.default for s in WORKER_SETTINGS}


def worker_default(field: str) -> Any:
    """``field``'s default (a KeyError at import for a field the table lacks)."""
    return WORKER_DEFAULTS[field]
