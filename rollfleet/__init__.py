"""rollfleet: an external rollout service for asynchronous RL."""

from rollfleet.runtime.logs import configure_default as _configure_default

_configure_default()
