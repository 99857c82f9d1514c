"""Following keys of a KV bucket: one watcher loop, restarted after errors, for every reader."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from contextlib import suppress
from typing import Any

from nats.js.kv import KeyValue


async def watch_keys(kv: KeyValue, keys: str, on_entry: Callable[[Any, bool], None], log: Any) -> None:
    """Feed every update of ``keys`` to ``on_entry(entry, live)``, re-creating the watcher after
    errors (a reconnect can end it). Runs until cancelled. ``live``: written while this watcher
    watched (heard as it happened), not one of the values a new watcher is handed first."""
    while True:
        watcher = None
        try:
            watcher = await kv.watch(keys)
            if (task := asyncio.current_task()) is not None and task.cancelling():
                # Cancelled while the watcher was being set up: nats' own asyncio.wait_for can
                # swallow that on 3.11, and the loop below would then wait for updates for good
                # (a client closed right after it connected took its full stop time-out).
                raise asyncio.CancelledError
            live = False
            while True:
                # No time-out: asyncio.wait_for with one can swallow a cancellation on 3.11.
                entry = await watcher.updates(timeout=None)
                if entry is None:  # (the marker after the current values: what follows is new)
                    live = True
                    continue
                on_entry(entry, live)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.debug("watch restarting", keys=keys, error=str(exc))
            await asyncio.sleep(1.0)
        finally:
            if watcher is not None:
                with suppress(Exception):
                    await asyncio.shield(watcher.stop())
