"""Fault injection for the reliability suite: ``ROLLFLEET_FAULT=<point>`` kills the process there.

Real processes die for real (SIGKILL), so the tests exercise the broker's redelivery and
the store's recovery, not a simulation of them. Unset, this costs one dict lookup.
"""

from __future__ import annotations

import os
import signal


def point(name: str) -> None:
    """Die here with SIGKILL if ``ROLLFLEET_FAULT`` names this point."""
    if os.environ.get("ROLLFLEET_FAULT") == name:
        os.kill(os.getpid(), signal.SIGKILL)
