"""The hf engine's live parameters, and the update staged for the next activation.

Activation copies only the changed tensors into the live parameters. ``prepare`` (while
serving) reads them, uploads them to the device and keeps only the elements that differ from the
live weights; the engine's ``load_weights`` (paused) then does device-side copies of those
elements only (``apply_staged``), or, when nothing usable is staged, copies the tensors it reads
(``copy_in``). Every activation bumps ``epoch``: an update staged against older live weights is
never applied.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from rollfleet.workers.engines import _weights


class LiveWeights:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.live: dict[str, torch.Tensor] = {}
        self.names: list[str] = []  # the tensor names the checkpoint stores
        self.staged: _weights.StagedUpdate | None = None
        self.epoch = 0  # bumps on every activation (staged updates must match it)
        self.stager = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-stage")

    def attach(self, model: Any, stored: Sequence[str]) -> None:
        """Serve ``model``'s parameters; ``stored``: the names its checkpoint stores."""
        self.live = dict(model.state_dict(keep_vars=True))
        self.names = [n for n in stored if n in self.live] or list(self.live)

    def clear(self) -> None:
        self.staged = None
        self.live = {}

    def shutdown(self) -> None:
        self.stager.shutdown(wait=True)

    async def prepare(self, checkpoint_dir: Path, changed: Sequence[str], version: int, stage_mode: str) -> None:
        """Read ``changed`` from ``checkpoint_dir`` and stage, on the device, the elements that
        differ from the live weights (of this epoch: an activation meanwhile discards them).
        ``stage_mode``: ``_weights.stage``'s "swap" or "scatter"."""
        names, epoch = tuple(changed), self.epoch
        _weights.live_names(names, self.live)

        def work() -> _weights.StagedUpdate:
            new = _weights.read_tensors(Path(checkpoint_dir), names)
            stream = torch.cuda.Stream(device=self.device) if self.device.type == "cuda" else None
            return _weights.stage(self.live, new, version, epoch, self.device, stream, stage_mode)

        self.staged = None  # a newer preparation replaces an older one
        staged = await asyncio.get_running_loop().run_in_executor(self.stager, work)
        if self.epoch == epoch:
            self.staged = staged

    def staged_for(self, names: Sequence[str], version: int) -> _weights.StagedUpdate | None:
        """The staged update, when it is ``version``'s of exactly ``names`` on the live weights."""
        staged = self.staged
        usable = (
            staged is not None
            and staged.version == version
            and set(staged.names) == set(names)
            and staged.epoch == self.epoch
        )
        return staged if usable else None

    async def read(self, checkpoint_dir: Path, names: Sequence[str]) -> dict[str, torch.Tensor]:
        """``names`` read from ``checkpoint_dir`` (each must be a live tensor)."""
        _weights.live_names(names, self.live)
        return await asyncio.get_running_loop().run_in_executor(
            self.stager, _weights.read_tensors, Path(checkpoint_dir), names
        )

    def apply_staged(self, staged: _weights.StagedUpdate) -> None:
        staged.apply()
        self._sync()

    def copy_in(self, new: dict[str, torch.Tensor]) -> None:
        _weights.copy_into(self.live, new)
        self._sync()

    def activated(self) -> None:
        """An activation happened: whatever was staged is spent or stale."""
        self.staged = None
        self.epoch += 1

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the pause must include the copies it started

    def checksums(self, names: Sequence[str] | None = None, fmt: str = "xxh3-128") -> dict[str, str]:
        """Checksum of each live parameter's raw bytes under its HF name (default: every tensor
        the checkpoint stores), comparable with the policy store's per-tensor checksums."""
        wanted = list(names) if names is not None else self.names
        _weights.live_names(wanted, self.live)
        return {name: _weights.checksum(self.live[name], fmt) for name in wanted}

    @property
    def staged_bytes(self) -> int:
        return self.staged.staged_bytes if self.staged is not None else 0
