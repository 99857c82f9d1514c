"""What every driver offers the controller (``Driver``) and says of its replicas (``Run``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class Run:
    """A replica a driver runs: its worker id, the version it was started to hold (None: it
    follows ``latest``), when it was started (unix time), and whether it was told to stop.
    ``host``: where the driver cannot name the worker id (a container whose worker calls itself
    ``<hostname>-<pid>``), the host name its registry entry carries instead."""

    worker_id: str
    held: int | None
    started_at: float
    retiring: bool = False
    host: str | None = None


class Driver(Protocol):
    name: str

    def owns(self, worker_id: str, host: str) -> bool:
        """Whether a replica of this id (on this host) would be this driver's (its process or
        container gone means the replica is gone, whatever its registry entry still says)."""
        ...

    async def runs(self) -> list[Run]:
        """The replicas it runs now (those it started, and those of an earlier controller)."""
        ...

    async def launch(self, held: int | None) -> str:
        """Start one replica; its worker id."""
        ...

    async def retire(self, worker_id: str, host: str) -> None:
        """Tell one replica to stop: it drains (finishes its jobs, hands resumable ones back)."""
        ...

    async def close(self) -> None: ...


class PlanOnly:
    """No driver: the controller plans and publishes (``/keda``, metrics, ``rollfleet status``) and
    something else carries the followers' size out (KEDA's metrics-api scaler)."""

    name = "none"

    def owns(self, worker_id: str, host: str = "") -> bool:
        return False

    async def runs(self) -> list[Run]:
        return []

    async def launch(self, held: int | None) -> str:
        raise RuntimeError("the plan-only driver launches nothing")

    async def retire(self, worker_id: str, host: str = "") -> None:
        return None

    async def close(self) -> None:
        return None
