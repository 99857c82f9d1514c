"""What a training loop imports: RolloutClient, RolloutHandle, FleetView, PolicyPublisher."""

from rollfleet.trainer_client.client import RolloutClient, RolloutHandle
from rollfleet.trainer_client.fleet import FleetView
from rollfleet.trainer_client.publisher import PolicyPublisher

__all__ = ["FleetView", "PolicyPublisher", "RolloutClient", "RolloutHandle"]
