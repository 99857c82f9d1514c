"""What the broker says when it refuses an operation or does not answer it, read in one place.

nats-py raises its own exceptions, the JetStream API answers with numeric error codes, a request
nobody listens for comes back with a status header, and a few refusals are told only in text.
Each of those is written here once, and ``typed`` turns a nats exception into rollfleet's typed
error (``schemas/errors.py``), which is what every room outside ``broker/`` catches:

- a conditional write refused because its key or subject moved on: ``Fenced`` (the key and the
  revision the write was made over as fields);
- nothing lies there (a key, deleted or never written, a message, stream, consumer or bucket):
  ``NotFound``;
- nobody listens (no responders): ``NoResponders``; no answer in time: ``BrokerTimeout``; the
  broker restarting, paused, electing, the connection redialing: ``BrokerUnavailable``;
- the connection closed or no server reachable: ``ConnectionClosed``;
- anything else the library raises: ``BrokerError``, with the API's status and error code.

All but ``Fenced`` are ``BrokerError``: code that took any broker error for "the broker did not
say" catches ``BrokerError`` (and ``Fenced`` where the call was a conditional write).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import nats.errors
import nats.js.errors

from rollfleet.schemas.errors import (
    BrokerError,
    BrokerTimeout,
    BrokerUnavailable,
    ConnectionClosed,
    Fenced,
    NoResponders,
    NotFound,
    RollfleetError,
)

# -- JetStream API error codes (nats-server's errors.json) that rollfleet acts on ----------------
# A conditional write (expected last sequence, a KV create or update over a revision) refused
# because the subject's last message is another: JSStreamWrongLastSequenceErrF.
WRONG_LAST_SEQUENCE = 10071
# A stream created by a racing declarer first: JSStreamNameExistErr.
STREAM_NAME_IN_USE = 10058

# -- statuses and header names of the core protocol ---------------------------------------------
STATUS_HEADER = "Status"
DESCRIPTION_HEADER = "Description"
# A request to a subject nobody listens on is answered at once with this status (no responders);
# a pull request that reached no consumer is too.
NO_RESPONDERS_STATUS = "503"
# A pull request refused on arrival says so by these openings of its description ("Exceeded
# MaxWaiting", "Exceeded MaxRequestBatch", "Bad Request - ..."); a full waiting list by this word.
PULL_REFUSED_DESCRIPTIONS = ("Exceeded", "Bad Request")
MAX_WAITING_DESCRIPTION = "MaxWaiting"
# The server refuses credentials with an "-ERR 'Authorization Violation'" that nats-py hands to
# the error callback as text (no type of its own there).
_AUTHORIZATION_TEXT = "authorization"

# nats-py's exceptions for a broker that did not answer but may if asked again (restarting,
# paused, electing a leader, not yet running JetStream, the connection redialing).
_UNAVAILABLE: tuple[type[BaseException], ...] = (
    nats.errors.ConnectionReconnectingError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.StaleConnectionError,
    nats.js.errors.ServiceUnavailableError,
    nats.js.errors.ServerError,
    nats.js.errors.NoStreamResponseError,
)
_CLOSED: tuple[type[BaseException], ...] = (nats.errors.ConnectionClosedError, nats.errors.NoServersError)
# What a broker call meets while the broker recovers, and passes if asked again a moment later
# (``retry_call.call_retrying`` asks again; ``startup.not_ready`` waits a start out).
TRANSIENT_NATS: tuple[type[BaseException], ...] = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    *_UNAVAILABLE,
)


def typed(exc: nats.errors.Error, *, key: str = "", revision: int | None = None) -> RollfleetError:
    """``exc`` (any nats-py exception) as rollfleet's typed error. ``key`` and ``revision``: the
    key or subject a conditional write was made on and the revision it was made over, carried by
    the ``Fenced`` it may turn into."""
    said = str(exc) or type(exc).__name__
    if is_wrong_last_sequence(exc):
        where = f" past revision {revision}" if revision is not None else ""
        return Fenced(f"{key or 'the subject'} moved{where}: {said}", subject=key, expected_seq=revision)
    status, err_code = _api_codes(exc)
    if isinstance(exc, nats.js.errors.NotFoundError):
        deleted = isinstance(exc, nats.js.errors.KeyDeletedError)
        return NotFound(said, status=status, err_code=err_code, deleted=deleted)
    if isinstance(exc, nats.errors.NoRespondersError):
        return NoResponders(said, status=int(NO_RESPONDERS_STATUS))
    if isinstance(exc, nats.errors.TimeoutError):
        return BrokerTimeout(said)
    if isinstance(exc, _UNAVAILABLE):
        return BrokerUnavailable(said, status=status, err_code=err_code)
    if isinstance(exc, _CLOSED):
        return ConnectionClosed(said)
    error = BrokerError(said, status=status, err_code=err_code)
    # A request the broker refused as it was made (a bad request, a payload over its limit, a
    # subject it may not use) is refused again; one it failed to serve (5xx) may pass.
    error.retryable = status is not None and status >= 500
    return error


@contextmanager
def typed_errors(*, key: str = "", revision: int | None = None) -> Iterator[None]:
    """Within the block, any nats exception is raised as its typed error (``typed``); the
    library's own is its ``__cause__``."""
    try:
        yield
    except nats.errors.Error as exc:
        raise typed(exc, key=key, revision=revision) from exc


def is_wrong_last_sequence(exc: BaseException) -> bool:
    """Whether ``exc`` is the broker's refusal of a conditional write (the KV's own type, or an
    API error with its code: nats-py passes a conditional delete's refusal on as it came)."""
    if isinstance(exc, nats.js.errors.KeyWrongLastSequenceError):
        return True
    return isinstance(exc, nats.js.errors.APIError) and getattr(exc, "err_code", None) == WRONG_LAST_SEQUENCE


def is_stream_name_in_use(exc: BaseException) -> bool:
    """Whether ``exc`` says a stream of that name exists already (a racing declarer won)."""
    return isinstance(exc, nats.js.errors.APIError) and getattr(exc, "err_code", None) == STREAM_NAME_IN_USE


def no_responders(headers: Mapping[Any, Any] | None) -> bool:
    """Whether a reply with these headers says nobody listened (status 503)."""
    return bool(headers) and headers.get(STATUS_HEADER) == NO_RESPONDERS_STATUS  # type: ignore[union-attr]


def pull_refused(status: str, description: str) -> bool:
    """Whether a pull request's end status says it was refused on arrival (nothing delivered for
    it): no consumer answered (503), or the consumer turned it away."""
    return status == NO_RESPONDERS_STATUS or description.startswith(PULL_REFUSED_DESCRIPTIONS)


def refuses_credentials(exc: BaseException) -> bool:
    """Whether an error the connection reported says the server refused the credentials."""
    return _AUTHORIZATION_TEXT in str(exc).lower()


def _api_codes(exc: BaseException) -> tuple[int | None, int | None]:
    # (some of nats-py's subclasses, the KV's own errors among them, never set these)
    return getattr(exc, "code", None), getattr(exc, "err_code", None)
