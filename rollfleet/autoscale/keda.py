"""The controller's HTTP endpoint: ``/metrics`` (Prometheus) and ``/keda`` (for KEDA).

KEDA reads rollfleet's version-aware signal through its ``metrics-api`` scaler: it GETs a URL
and takes the number at ``valueLocation`` (a GJSON path) in the JSON it gets. ``/keda`` serves
the status document, so ``valueLocation: classes.latest.desired`` is the followers' desired
size (and ``classes.3.desired`` a held version's); with ``targetValue: "1"`` and the default
``AverageValue`` metric type, the HPA KEDA drives sets the Deployment to that many replicas.
Why this and not the external-scaler gRPC protocol: KEDA's own HTTP client and a JSON value is
all it takes (no gRPC server, no generated stubs, no TLS setup of a second protocol), the same
document serves ``rollfleet status`` and a human with curl, and the decision stays rollfleet's:
KEDA only carries the number out. What the gRPC protocol adds (pushing ``IsActive`` at once) a
``pollingInterval`` of a few seconds makes up for.

A standby controller (one waiting for the lease) serves the document the acting one last wrote
to the fleet bucket, so a Service in front of several controllers answers the same.

The server is a few lines of asyncio: one request per connection, GET only.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from typing import Any

_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 503: "Service Unavailable"}

Document = Callable[[], Awaitable[dict[str, Any] | None]]


async def _answer(metrics: Callable[[], bytes], document: Document, method: str, path: str) -> tuple[int, str, bytes]:
    if method != "GET":
        return 405, "text/plain", b"GET only\n"
    path = path.split("?", 1)[0]
    if path == "/metrics":
        return 200, "text/plain; version=0.0.4; charset=utf-8", metrics()
    if path == "/keda":
        doc = await document()
        if doc is None:
            return 503, "application/json", b'{"error": "no plan yet"}\n'
        return 200, "application/json", json.dumps(doc).encode()
    if path == "/healthz":
        return 200, "text/plain", b"ok\n"
    return 404, "text/plain", b"not found\n"


async def serve_http(
    metrics: Callable[[], bytes], document: Document, host: str, port: int
) -> tuple[asyncio.AbstractServer, int]:
    """``metrics``: the Prometheus text; ``document``: the status document (the acting
    controller's, or the one it last stored, for a standby)."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            line = await asyncio.wait_for(reader.readline(), 10)
            while await asyncio.wait_for(reader.readline(), 10) not in (b"\r\n", b"\n", b""):
                pass  # (headers are not read: nothing here depends on them)
            parts = line.decode("latin-1").split()
            if len(parts) < 2:
                return
            status, kind, body = await _answer(metrics, document, parts[0], parts[1])
            head = (
                f"HTTP/1.1 {status} {_REASONS.get(status, '')}\r\nContent-Type: {kind}\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            )
            writer.write(head.encode("latin-1") + body)
            await writer.drain()
        except (TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, host, port)
    return server, int(server.sockets[0].getsockname()[1])
