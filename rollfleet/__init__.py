"""rollfleet: an external rollout service for asynchronous RL."""
