"""A TCP proxy between one client (a worker) and the broker: partitions and latency on one link.

Each worker of the adversary's fleet (and a test's client) dials the broker through a proxy of
its own, so a fault on the link hits that worker alone:

- ``stall(direction, for_s)``: a partition as TCP lives it. Bytes in that direction (``up``:
  worker to broker, ``down``: broker to worker, ``both``) are held, not lost, and delivered in
  order when it heals (a TCP peer retransmits until the link comes back). Connections made
  meanwhile stall the same way. A stall longer than the client's ping bound makes the client
  give the connection up and dial again; the broker sees the same from its side.
- ``lag(seconds, for_s)``: every chunk in both directions arrives this much later (latency;
  chunks in flight overlap, so the link is slower to answer, not narrower).
- ``cut()``: every connection through the proxy is closed at once (a reset link).

The proxy is the harness's code, in the harness's process; it never parses the protocol.
"""

from __future__ import annotations

import asyncio
import contextlib
from dataclasses import dataclass, field

_CHUNK = 64 * 1024


@dataclass
class _Direction:
    open: asyncio.Event = field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.open.set()


class LinkProxy:
    """One listening port on loopback, forwarding every connection to ``target``."""

    def __init__(self, target_host: str, target_port: int) -> None:
        self.target = (target_host, target_port)
        self.port = 0
        self.delay_s = 0.0
        self._up, self._down = _Direction(), _Direction()
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()
        self._writers: set[asyncio.StreamWriter] = set()

    async def start(self) -> LinkProxy:
        self._server = await asyncio.start_server(self._accept, "127.0.0.1", 0)
        self.port = self._server.sockets[0].getsockname()[1]
        return self

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for way in (self._up, self._down):
            way.open.set()  # (a stalled pump would otherwise wait for the heal that never comes)
        self.cut()  # the pumps end on their own once their sockets are gone
        if self._conns:
            await asyncio.wait(list(self._conns), timeout=2.0)
        for task in list(self._conns):
            task.cancel()

    # -- faults ---------------------------------------------------------------------------------
    async def stall(self, direction: str, for_s: float) -> None:
        """Hold every byte going ``direction`` (up, down, both) for ``for_s`` seconds."""
        ways = {"up": [self._up], "down": [self._down], "both": [self._up, self._down]}[direction]
        for way in ways:
            way.open.clear()
        try:
            await asyncio.sleep(for_s)
        finally:
            for way in ways:
                way.open.set()

    async def lag(self, seconds: float, for_s: float) -> None:
        self.delay_s = seconds
        try:
            await asyncio.sleep(for_s)
        finally:
            self.delay_s = 0.0

    def cut(self) -> None:
        for writer in list(self._writers):
            with contextlib.suppress(Exception):
                writer.transport.abort()
        self._writers.clear()

    # -- forwarding -----------------------------------------------------------------------------
    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        self._writers.add(writer)
        upstream: asyncio.StreamWriter | None = None
        try:
            up_reader, upstream = await asyncio.open_connection(*self.target)
            self._writers.add(upstream)
            await asyncio.gather(self._pump(reader, upstream, self._up), self._pump(up_reader, writer, self._down))
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            for w in (writer, upstream):
                if w is not None:
                    self._writers.discard(w)
                    with contextlib.suppress(Exception):
                        w.transport.abort()
            self._conns.discard(task)

    async def _pump(self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, way: _Direction) -> None:
        """Read as bytes come, deliver each chunk ``delay_s`` after it was read, in order: latency,
        not a narrower link (chunks in flight overlap, as packets on a long link do)."""
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await chunks.get()
                if not data:
                    return
                if due > loop.time():
                    await asyncio.sleep(due - loop.time())
                await way.open.wait()  # a stalled direction holds its bytes, in order
                dst.write(data)
                await dst.drain()

        writer = asyncio.ensure_future(deliver())
        try:
            while not writer.done():
                data = await src.read(_CHUNK)
                chunks.put_nowait((loop.time() + self.delay_s, data))
                if not data:
                    break
            await writer
        finally:
            writer.cancel()
            with contextlib.suppress(Exception):
                dst.transport.abort()  # one side gone: the link is gone (as a reset would end it)
