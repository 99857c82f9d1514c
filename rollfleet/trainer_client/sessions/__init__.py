"""Sessions: multi-turn conversations whose turns stick to the replica holding their context.

- ``session``: ``Session`` (turns, version policies, the record, answered-once turns)
- ``sticky``: when a sticky turn moves off its replica
- ``host``: what a session needs from its client (``SessionHost``); the client implements it,
  and nothing here imports the client
"""

from rollfleet.trainer_client.sessions.host import OpenSession, SessionHost, TurnPlacement
from rollfleet.trainer_client.sessions.session import POLICIES, Session, expire_idle, turn_key
from rollfleet.trainer_client.sessions.sticky import await_turn

__all__ = [
    "POLICIES",
    "OpenSession",
    "Session",
    "SessionHost",
    "TurnPlacement",
    "await_turn",
    "expire_idle",
    "turn_key",
]
