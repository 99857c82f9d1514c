"""What a training loop imports: RolloutClient, RolloutHandle, FleetView (and PolicyPublisher)."""

from rollfleet.trainer_client.client import RolloutClient, RolloutHandle
from rollfleet.trainer_client.fleet import FleetView

__all__ = ["FleetView", "RolloutClient", "RolloutHandle"]
