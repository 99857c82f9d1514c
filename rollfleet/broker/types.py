"""The client library's types that other rooms name in their signatures: a connection, a
JetStream context, a delivered message, a subscription, a KV bucket. Re-exported here so that
``broker/`` stays the only room that imports nats (``tests/test_architecture.py``); what to do
with them, and the errors they raise, is the broker's ports' business (``buckets``,
``stream_reads``, ``requests``, ``errors``)."""

from __future__ import annotations

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import ConsumerInfo, PubAck, RawStreamMsg
from nats.js.kv import KeyValue

__all__ = ["NATS", "ConsumerInfo", "JetStreamContext", "KeyValue", "Msg", "PubAck", "RawStreamMsg", "Subscription"]
