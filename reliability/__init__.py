"""The reliability suite: fault-injection and bad-input scenarios against the real system (see docs/reliability.md)."""
