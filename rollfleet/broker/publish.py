"""Storing a message on a JetStream stream, retried until the broker acknowledges it.

Both sides store with an idempotency key as ``Nats-Msg-Id`` (jobs by the client, results by
the worker), so a retry never stores a second copy.
"""

from __future__ import annotations

import asyncio
import time

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js.api import PubAck

from rollfleet.runtime.logs import get_logger
from rollfleet.schemas.errors import InvalidRequest, ServiceUnavailable

log = get_logger("rollfleet.broker.publish")

ATTEMPT_S = 1.5


async def publish_retrying(
    js: JetStreamContext, subject: str, data: bytes, headers: dict[str, str], *, until: float
) -> PubAck:
    """Publish until the broker acknowledges, or raise ``ServiceUnavailable`` once ``until`` (unix
    time) has passed; a message the broker refuses outright is ``InvalidRequest``.

    Short attempts, many of them: a publish sent to a stream leader that just died is never
    answered, and a retry (deduplicated by the message id) reaches the new leader as soon as
    there is one.
    """
    attempt = 0
    while True:
        try:
            return await js.publish(subject, data, headers=headers, timeout=ATTEMPT_S)
        except nats.js.errors.BadRequestError as exc:
            raise InvalidRequest(f"broker refused the message: {exc.description}") from exc
        except nats.errors.MaxPayloadError as exc:
            raise InvalidRequest(f"message of {len(data)} bytes is over the broker's max_payload") from exc
        except (nats.errors.Error, nats.js.errors.Error) as exc:
            if time.time() >= until:
                raise ServiceUnavailable(f"cannot store the message on {subject}: {exc}") from exc
            log.debug("publish failed; retrying", subject=subject, attempt=attempt, error=str(exc))
            await asyncio.sleep(min(0.1 * 2**attempt, 1.0))
            attempt += 1
