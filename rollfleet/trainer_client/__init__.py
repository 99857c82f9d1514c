"""What a training loop imports: RolloutClient, RolloutHandle, Session, FleetView, PolicyPublisher."""

from rollfleet.policy_store.publisher import PolicyPublisher  # the store's write side, re-exported
from rollfleet.trainer_client.client import RolloutClient
from rollfleet.trainer_client.fleet import FleetView
from rollfleet.trainer_client.handle import RolloutHandle
from rollfleet.trainer_client.sessions import Session

__all__ = ["FleetView", "PolicyPublisher", "RolloutClient", "RolloutHandle", "Session"]
