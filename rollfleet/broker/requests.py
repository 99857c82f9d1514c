"""A core request whose silence means something: a probe of a replica's bell, a client asking
whether its id is in use. The broker answers "no responders" at once when nobody listens on the
subject; a listener that does not reply lets the request time out. Both typed
(``broker.errors.typed``): ``NoResponders``, ``BrokerTimeout``; a request that could not be made
(the connection down) is another ``BrokerError``."""

from __future__ import annotations

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

from rollfleet.broker.errors import typed_errors


async def ask(nc: NATS, subject: str, data: bytes, *, timeout: float) -> Msg:
    """The first reply to a request on ``subject``."""
    with typed_errors():
        return await nc.request(subject, data, timeout=timeout)
