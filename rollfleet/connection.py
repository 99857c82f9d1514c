"""Connecting to the broker: one place for reconnect policy, auth options and logging."""

from __future__ import annotations

import ssl
from typing import Any

import nats
from nats.aio.client import Client as NATS

from rollfleet.logs import get_logger
from rollfleet.schemas.errors import ServiceUnavailable

log = get_logger("rollfleet.connection")


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
    **extra: Any,
) -> NATS:
    """Connect with unlimited reconnects, so a broker restart never needs a process restart.

    ``url`` may list several servers separated by commas (a cluster) and may carry
    ``user:password@`` credentials.
    """
    servers = [u.strip() for u in url.split(",") if u.strip()]
    conn: dict[str, NATS] = {}

    async def on_error(exc: Exception) -> None:
        log.warning("nats error", error=str(exc), client=name)

    async def on_disconnect() -> None:
        nc = conn.get("nc")
        if nc is not None and not (nc.is_closed or nc.is_draining):
            log.warning("nats disconnected", client=name)

    async def on_reconnect() -> None:
        log.info("nats reconnected", client=name)

    opts: dict[str, Any] = dict(
        servers=servers,
        name=name,
        connect_timeout=connect_timeout,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        allow_reconnect=True,
        error_cb=on_error,
        disconnected_cb=on_disconnect,
        reconnected_cb=on_reconnect,
    )
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
    opts.update(extra)
    try:
        conn["nc"] = await nats.connect(**opts)
        return conn["nc"]
    except Exception as exc:  # nats raises several unrelated types here
        raise ServiceUnavailable(f"cannot connect to NATS at {url}: {exc}") from exc
