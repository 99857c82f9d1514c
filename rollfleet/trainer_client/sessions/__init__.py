"""Sessions: multi-turn conversations whose turns stick to the replica holding their context.

- ``session``: ``Session`` (a session's turns, answered once each)
- ``version_policy``: which versions a turn may be served at (``pinned``, ``monotonic``, ``free``)
- ``session_record``: the record's settings checked, and what it keeps of the turns (keys, the
  next index, failures)
- ``session_store``: the record in the sessions bucket, written compare-and-set
- ``turn_replica``: which replica a turn is sent to
- ``sticky``: when a sticky turn moves off its replica
- ``host``: what a session needs from its client (``SessionHost``); the client implements it,
  and nothing here imports the client
"""

from rollfleet.trainer_client.sessions.host import OpenSession, SessionHost, TurnPlacement
from rollfleet.trainer_client.sessions.session import Session, expire_idle
from rollfleet.trainer_client.sessions.session_record import turn_key
from rollfleet.trainer_client.sessions.sticky import await_turn
from rollfleet.trainer_client.sessions.version_policy import POLICIES

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
