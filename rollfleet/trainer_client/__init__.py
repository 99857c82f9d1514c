"""What a training loop imports: RolloutClient, RolloutHandle, Session, FleetView, PolicyPublisher,
and RolloutLoop (groups, staleness-bounded admission, waste accounting) on top of them."""

from rollfleet.policy_store.publisher import PolicyPublisher  # the store's write side, re-exported
from rollfleet.trainer_client.client import RolloutClient
from rollfleet.trainer_client.fleet import FleetView
from rollfleet.trainer_client.handle import RolloutHandle
from rollfleet.trainer_client.loop import (
    WASTE_CAUSES,
    Batch,
    FailedGroup,
    Group,
    LoopConfig,
    RolloutLoop,
    Sample,
    StepStats,
)
from rollfleet.trainer_client.sessions import Session

__all__ = [
    "WASTE_CAUSES",
    "Batch",
    "FailedGroup",
    "FleetView",
    "Group",
    "LoopConfig",
    "PolicyPublisher",
    "RolloutClient",
    "RolloutHandle",
    "RolloutLoop",
    "Sample",
    "Session",
    "StepStats",
]
