"""The rollout loop's configuration (``LoopConfig``), checked whole when it is made: a value out of
range raises ``InvalidRequest`` naming the field. What each setting does is written at the rule
it sets in ``loop_machine``'s docstring.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

from rollfleet.schemas import RetryPolicy, SamplingParams
from rollfleet.schemas.errors import InvalidRequest
from rollfleet.trainer_client.loop_types import FailurePolicy, StalePolicy

_RETRY_POLICIES = ("replayable", "at_most_once", "resume")
_LOOP_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


@dataclass
class LoopConfig:
    group_size: int = 8
    batch_groups: int = 4
    max_staleness: int = 1
    split_groups: bool = False  # n jobs of one sample each, instead of one job of n samples
    stale: StalePolicy = "drop"
    on_failure: FailurePolicy = "requeue"
    max_attempts: int = 3  # tries of one prompt before its group is reported failed
    oversample: int = 0  # tails continued at the fresh floor per batch (rule 7); no room beyond the bound
    group_deadline_s: float | None = None
    dynamic_sampling: bool = False  # drop groups whose rewards are all equal, refill
    # Stop a job still generating when a commit puts its group at risk of going stale, and
    # continue each stopped sample at the new version from its tokens so far (token-id prompts).
    partial_rollout: bool = False
    max_in_flight: int | None = None  # groups; None: the staleness bound alone
    sampling: SamplingParams = field(default_factory=SamplingParams)  # for prompts given as tokens/text
    extra: dict[str, Any] = field(default_factory=dict)
    retry_policy: RetryPolicy = "replayable"
    job_timeout_s: float | None = 600.0
    # A fresh version with no replica at (or preparing) it yet: wait this long before admitting
    # groups that an older version may serve (they would be the first to go stale).
    activation_grace_s: float = 30.0
    # Names the loop: its jobs' idempotency keys and its metrics' ``loop`` label. A loop restarted
    # with the same client id, ``loop_id`` and prompts reclaims its predecessor's jobs and answers.
    # None: a fresh id for each loop (nothing is reclaimed).
    loop_id: str | None = None

    def __post_init__(self) -> None:
        for name in ("group_size", "batch_groups", "max_attempts"):
            _check_int(name, getattr(self, name), 1)
        _check_int("max_staleness", self.max_staleness, 0)
        _check_int("oversample", self.oversample, 0)
        if self.max_in_flight is not None:
            _check_int("max_in_flight", self.max_in_flight, 1)
        _check_choice("stale", self.stale, ("drop", "requeue", "keep"))
        _check_choice("on_failure", self.on_failure, ("requeue", "report"))
        _check_choice("retry_policy", self.retry_policy, _RETRY_POLICIES)
        for name in ("split_groups", "dynamic_sampling", "partial_rollout"):
            if not isinstance(getattr(self, name), bool):
                raise _bad(name, f"must be a bool, got {getattr(self, name)!r}")
        for name in ("group_deadline_s", "job_timeout_s"):
            value = getattr(self, name)
            if value is not None and not (is_number(value) and math.isfinite(value) and value > 0):
                raise _bad(name, f"must be None or a finite number of seconds > 0, got {value!r}")
        grace = self.activation_grace_s
        if not (is_number(grace) and math.isfinite(grace) and grace >= 0):
            raise _bad("activation_grace_s", f"must be a finite number of seconds >= 0, got {grace!r}")
        if not isinstance(self.sampling, SamplingParams):
            raise _bad("sampling", f"must be a SamplingParams, got {type(self.sampling).__name__}")
        if not isinstance(self.extra, dict):
            raise _bad("extra", f"must be a dict, got {type(self.extra).__name__}")
        if self.loop_id is not None and not (isinstance(self.loop_id, str) and _LOOP_ID.match(self.loop_id)):
            raise _bad("loop_id", f"must match [A-Za-z0-9_-]{{1,64}}, got {self.loop_id!r}")


def _bad(name: str, what: str) -> InvalidRequest:
    return InvalidRequest(f"LoopConfig.{name} {what}", detail=name)


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def _check_int(name: str, value: object, least: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < least:
        raise _bad(name, f"must be an int >= {least}, got {value!r}")


def _check_choice(name: str, value: object, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise _bad(name, f"must be one of {', '.join(allowed)}, got {value!r}")
