"""Connecting to the broker: one place for reconnect policy, auth options and logging."""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Callable
from typing import Any

from nats.aio.client import Client as NATS

from rollfleet.broker.errors import refuses_credentials
from rollfleet.runtime.logs import get_logger
from rollfleet.runtime.secrets import has_secrets, redact_url, redact_urls
from rollfleet.schemas.errors import AuthorizationError, ServiceUnavailable

log = get_logger("rollfleet.broker.connection")

# A link that stops carrying bytes (a partition, a dead NAT entry, a host gone without a reset)
# is given up after PING_INTERVAL_S * (MAX_OUTSTANDING_PINGS + 1), about 20 s, and dialed again:
# nats-py's defaults (120 s, 2) leave a worker deaf, and its pull requests dead at the broker,
# for up to six minutes. One small PING every 5 s per connection is the whole cost.
PING_INTERVAL_S = 5.0
MAX_OUTSTANDING_PINGS = 3


class _Client(NATS):
    """nats-py's client with one defect of its own worked around (nats-py 2.16).

    A ``flush()`` (or ``sub.drain()``, which flushes) given up on, by its time-out or by a
    cancelled caller, leaves its PING's future cancelled in the queue of PONGs awaited. When that
    PONG arrives, nats-py sets the future's result, which raises ``InvalidStateError``; its read
    loop logs "encountered error" and ends. The connection then reads nothing, though it looks
    connected, until the ping bound (about 20 s) gives it up and dials again. Our pull requests
    give up a drain after a few seconds while a broker is paused, so every pause longer than
    that left the replicas deaf for up to 20 s after it ended."""

    def __init__(self) -> None:
        super().__init__()
        self._redial = asyncio.Event()  # set (and replaced) at each reconnect

    def redialed(self) -> asyncio.Event:
        """An event set at the next reconnect. A request sent before it (or held while the
        connection was down) may never be answered: the server it went to is gone, or the broker
        restarted and dropped it. Waiting out its time-out (5 s) then costs a caller that many
        seconds after a broker restart; one that watches this asks again at once."""
        return self._redial

    def note_redialed(self) -> None:
        self._redial.set()
        self._redial = asyncio.Event()

    async def _process_pong(self) -> None:
        if self._pongs:
            future = self._pongs.pop(0)  # (the oldest PING's: PONGs come back in order)
            if not future.done():
                future.set_result(True)
            self._pongs_received += 1
            self._pings_outstanding = 0


def logs_in(url: str, options: dict[str, Any]) -> bool:
    """Whether a connection to ``url`` with ``options`` (``connect``'s) logs in as somebody: a
    user or token in a server's URL, or a token, user or credentials file among the options."""
    in_url = any(has_secrets(server.strip()) for server in url.split(",") if server.strip())
    return in_url or any(options.get(k) for k in ("token", "user", "creds_file"))


def redialed(nc: NATS | None) -> asyncio.Event | None:
    """The event set at ``nc``'s next reconnect (``_Client.redialed``); None for a connection that
    is not rollfleet's (nats-py's own client says nothing of its reconnects per request)."""
    return nc.redialed() if isinstance(nc, _Client) else None


def _credentials(
    token: str | None,
    user: str | None,
    password: str | None,
    creds_file: str | None,
    tls_ca: str | None,
    tls_cert: str | None,
    tls_key: str | None,
) -> dict[str, Any]:
    """The nats client's options for the credentials and TLS given (none given: none)."""
    opts: dict[str, Any] = {}
    if token:
        opts["token"] = token
    if user:
        opts["user"], opts["password"] = user, password
    if creds_file:
        opts["user_credentials"] = creds_file
    if tls_ca or tls_cert:
        ctx = ssl.create_default_context(cafile=tls_ca)
        if tls_cert:
            ctx.load_cert_chain(tls_cert, tls_key)
        opts["tls"] = ctx
    return opts


async def connect(
    url: str,
    *,
    name: str,
    token: str | None = None,
    user: str | None = None,
    password: str | None = None,
    creds_file: str | None = None,
    tls_ca: str | None = None,
    tls_cert: str | None = None,
    tls_key: str | None = None,
    connect_timeout: float = 5.0,
    initial_timeout: float = 120.0,
    reconnect_hooks: list[Callable[[], None]] | None = None,
    log_errors: bool = True,
    **extra: Any,
) -> NATS:
    """Connect with unlimited reconnects, so a broker restart never needs a process restart.

    The first connection waits up to ``initial_timeout`` for the broker to come up, but fails
    at once with ``AuthorizationError`` if the broker refuses the credentials.

    ``url`` may list several servers separated by commas (a cluster) and may carry
    ``user:password@`` credentials.
    """
    servers = [u.strip() for u in url.split(",") if u.strip()]
    shown = ",".join(redact_url(server) for server in servers)  # what errors and logs say of the URL
    # Called after every reconnect; the list may be appended to after connecting.
    reconnect_hooks = reconnect_hooks if reconnect_hooks is not None else []
    conn: dict[str, NATS] = {}
    refused: asyncio.Future[Exception] = asyncio.get_running_loop().create_future()
    client = _Client()
    opts: dict[str, Any] = dict(
        servers=servers,
        name=name,
        connect_timeout=connect_timeout,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        allow_reconnect=True,
        ping_interval=PING_INTERVAL_S,
        max_outstanding_pings=MAX_OUTSTANDING_PINGS,
        **_callbacks(client, conn, name, reconnect_hooks, refused, log_errors=log_errors),
    )
    opts.update(_credentials(token, user, password, creds_file, tls_ca, tls_cert, tls_key), **extra)
    conn["nc"] = await _first_connect(client, opts, refused, initial_timeout, shown)
    return client


def _callbacks(
    client: _Client,
    conn: dict[str, NATS],
    name: str,
    reconnect_hooks: list[Callable[[], None]],
    refused: asyncio.Future[Exception],
    *,
    log_errors: bool,
) -> dict[str, Any]:
    """The connection's callbacks: errors said (wrong credentials before the first connection
    fail it: they never fix themselves), disconnects said, and every reconnect's hooks run."""

    async def on_error(exc: Exception) -> None:
        if "nc" not in conn and refuses_credentials(exc) and not refused.done():
            refused.set_result(exc)
        if log_errors:
            log.warning("nats error", error=redact_urls(str(exc)), client=name)

    async def on_disconnect() -> None:
        nc = conn.get("nc")
        if nc is not None and not (nc.is_closed or nc.is_draining):
            log.warning("nats disconnected", client=name)

    async def on_reconnect() -> None:
        log.info("nats reconnected", client=name)
        client.note_redialed()
        for hook in reconnect_hooks:
            hook()

    return {"error_cb": on_error, "disconnected_cb": on_disconnect, "reconnected_cb": on_reconnect}


async def _first_connect(
    client: NATS, opts: dict[str, Any], refused: asyncio.Future[Exception], initial_timeout: float, shown: str
) -> NATS:
    """The first connection: up to ``initial_timeout`` for the broker to come up, or at once
    ``AuthorizationError`` where it refused the credentials (``refused``, set by the error
    callback). ``shown``: the URL as errors may say it (no secrets)."""
    attempt = asyncio.ensure_future(client.connect(**opts))
    try:
        done, _ = await asyncio.wait({attempt, refused}, timeout=initial_timeout, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:  # e.g. a worker stopped while still connecting
        attempt.cancel()
        raise
    if attempt in done:
        try:
            attempt.result()
        except Exception as exc:  # nats raises several unrelated types here
            # (from None: the chained exception's text and traceback may carry the URL as given)
            raise ServiceUnavailable(f"cannot connect to NATS at {shown}: {redact_urls(str(exc))}") from None
        return client
    attempt.cancel()
    if refused.done():
        raise AuthorizationError(f"NATS at {shown} refused these credentials: {redact_urls(str(refused.result()))}")
    raise ServiceUnavailable(f"cannot connect to NATS at {shown} within {initial_timeout:.0f}s")
