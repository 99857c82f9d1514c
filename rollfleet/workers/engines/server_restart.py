"""A server that lost the weights made live here, and the reload of the live version.

Once the adapter has set the server's version label, a server that reports another one (an
attached server restarted on its launch checkpoint: vLLM's ``default``) is checked for at every
health look, and tokens a server attributes to a label that is no rollfleet version are refused.
The engine is then down (no request is sent) while the adapter reloads the live version from
the directory it was loaded from, and serves again once that succeeded (``restart_suspected``).
Only while that directory still holds it: a worker materializes the next version into the same
directory while it serves, so after a failed activation (or during a prepare) it holds other
bytes. Its version marker must be what it was at the load (``reload_refusal``), else the engine
stays down until the version sync activates a version. Part of ``HTTPServerEngine``
(``http_server``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from pathlib import Path

import httpx

from rollfleet.policy_store import read_marker
from rollfleet.schemas.errors import EngineFailure
from rollfleet.workers.engines.server_protocol import parse_version


def restart_suspected(believed: int, reported: object) -> bool:
    """Whether a server whose version label the adapter set to ``believed`` no longer holds those
    weights: it reports another label (a restarted server reports its launch label)."""
    return parse_version(reported) != believed


def reload_refusal(loaded: int | None, now: int | None) -> str | None:
    """Why a directory must not be reloaded as the live version after a server restart (None: it
    may be): its version marker (``policy_store.read_marker``: the version materialized in it) is
    ``now``, no longer ``loaded``, what it was when the live version was loaded from it. A plain
    checkpoint directory, which has no marker, may be."""
    if now == loaded:
        return None
    if now is None:
        return "is being rewritten (its version marker is gone)"
    return f"now holds version {now}"


class RestartRecovery:
    """Noticing a server that no longer holds the live version, and reloading it."""

    def _init_restart_recovery(self) -> None:
        # Whether the server's version label is this adapter's ``version`` (set by start and every
        # load): a server reporting another one lost the weights made live here.
        self._labelled = False
        self._loaded_from: Path | None = None  # where the live version was loaded from (``_loaded_dir``)
        self._loaded_marker: int | None = None  # that directory's version marker when it was loaded
        self._stale = False  # a reload read a directory that moved on meanwhile: down until a new load
        self._recovering: asyncio.Task[None] | None = None

    @property
    def _loaded_dir(self) -> Path | None:
        return self._loaded_from

    @_loaded_dir.setter
    def _loaded_dir(self, directory: Path | None) -> None:
        """Every load records where from and that directory's version marker then: a worker
        materializes the next version into the same directory while it serves, so the directory
        may later hold other bytes than the live version's (``reload_refusal``)."""
        self._loaded_from = Path(directory) if directory is not None else None
        self._loaded_marker = read_marker(self._loaded_from) if self._loaded_from is not None else None
        self._stale = False

    async def _check_served(self) -> str | None:
        """None when the server holds the version made live here, as far as its label says (or
        the adapter set no label to compare); else why not, with a reload of the live version
        started where the adapter knows its directory (the engine stays down until it succeeded)."""
        if self._recovering is not None and not self._recovering.done():
            return self._down or f"reloading version {self.version}"
        if self._stale and not self._activation.locked():
            self._lost(f"was reloaded from {self._loaded_dir} while it changed")  # (its label says nothing)
            return self._down
        if not self._labelled or self._activation.locked():
            return None  # (during an activation the label is moving)
        believed = self.version
        try:
            reported = await asyncio.wait_for(self._read_label(), self.health_timeout_s)
        except (httpx.HTTPError, EngineFailure, TimeoutError):
            return self._down  # unconfirmed: one serving keeps serving, one that was down stays so
        if self._activation.locked() or self.version != believed or not restart_suspected(believed, reported):
            return None  # (an activation began meanwhile: the label read may be from either side of it)
        self._lost(f"reports weight version {reported!r}, not {self.version}")
        return self._down

    def _lost(self, what: str) -> None:
        """The server does not hold the version made live here (``what`` says how that showed):
        down at once (requests in flight fail, none is sent), and the live version reloaded."""
        if self._recovering is not None and not self._recovering.done():
            return
        detail = f"{self.server_name} server {what} (restarted on its launch checkpoint?)"
        if self._loaded_dir is None:
            detail += f"; nothing to reload version {self.version} from: not serving until it reports it"
        else:
            detail += f"; reloading version {self.version} from {self._loaded_dir}"
        self._down = None  # (this account replaces any earlier one)
        self._mark_down(detail)
        if self._loaded_dir is not None:
            self._recovering = asyncio.create_task(self._reload_live(self._loaded_dir), name="server-reload")

    async def _reload_live(self, directory: Path) -> None:
        """Make the live version the server's again (an activation to the same version); the
        engine serves again only once that succeeded. Only from a directory that still holds what
        the live version was loaded from (its marker unchanged, before and after the load): one a
        newer version was materialized into since holds that version's bytes, which labelled with
        the live version would be served as it; the engine then stays down until an activation
        loads a version (the version sync's next one, or its retry of one that failed)."""
        expected = self._loaded_marker
        refused = reload_refusal(expected, await asyncio.to_thread(read_marker, directory))
        if refused is not None:
            if not self._broken:
                self._down = (
                    f"{self.server_name} server lost version {self.version}, and {directory} {refused}: "
                    "not reloaded; not serving until a version is activated"
                )
            return
        try:
            await self.pause()
            try:
                await self.load_weights(directory, (), self.version)
                self._loaded_marker = expected  # (what the live version is, whatever the load read)
            finally:
                await self.resume()
        except Exception as exc:  # stays down; the next health look tries again
            if not self._broken:
                self._down = f"{self.server_name} server lost version {self.version} and reloading it failed: {exc}"
            return
        moved = reload_refusal(expected, await asyncio.to_thread(read_marker, directory))
        if moved is not None:  # (a version materialized into it during the load: mixed bytes, maybe)
            self._stale = True
            if not self._broken:
                self._down = (
                    f"{self.server_name} server reloaded version {self.version} from {directory}, which {moved}"
                )
            return
        if not self._broken:
            self._down = None

    def _refuse_foreign(self, labels: Sequence[object]) -> None:
        """Tokens a labelled server attributes to a label that is no rollfleet version (vLLM's
        ``default`` after a restart) did not come from the weights made live here: refused, never
        relabelled with the adapter's own version."""
        foreign = [label for label in labels if parse_version(label) is None]
        if self._labelled and foreign:
            self._lost(f"attributes tokens to weight version {foreign[0]!r}")
            raise EngineFailure(f"{self.server_name} attributes tokens to weight version {foreign[0]!r}: {self._down}")
