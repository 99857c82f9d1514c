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
- ``truncate(after_bytes, for_s)``: for ``for_s`` seconds every connection, open or new, carries
  at most ``after_bytes`` more bytes down (server to client) and is then closed: a response cut
  short (an object store's body ending early; the client sees fewer bytes than announced).
- ``drop(for_s)``: every open connection is reset, and for ``for_s`` seconds so is every new one
  as soon as it is accepted (a peer that refuses, a load balancer with no backend).

The same proxy stands between a worker and an object store (the adversary's ``--store s3``),
where it sees HTTP as it sees NATS: bytes.

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


@dataclass
class _Budget:
    """What one connection may still carry down while a truncate fault is on (per fault: a new
    fault, or a new connection, starts from the fault's full allowance)."""

    epoch: int = -1
    left: int = 0


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
        self.truncate_after: int | None = None  # bytes a connection may carry down while truncating
        self._truncate_epoch = 0
        self.dropping = False
        self._lags: list[float] = []  # the faults in force, of each kind
        self._truncations: list[int] = []
        self._drops = 0
        self.truncated = 0  # connections a truncate fault has closed (tests read it)
        self.dropped = 0  # connections a drop fault has reset

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

    # (Faults of one kind that overlap nest: the link is as bad as the worst one in force, until
    # the last ends; the first to end does not heal it while another's window is still open.)
    async def lag(self, seconds: float, for_s: float) -> None:
        self._lags.append(seconds)
        self.delay_s = max(self._lags)
        try:
            await asyncio.sleep(for_s)
        finally:
            if seconds in self._lags:  # (heal() may have cleared it meanwhile)
                self._lags.remove(seconds)
            self.delay_s = max(self._lags, default=0.0)

    async def truncate(self, after_bytes: int, for_s: float) -> None:
        """For ``for_s`` seconds, each connection carries at most ``after_bytes`` more bytes down
        (counted from the fault's start, or the connection's), then is closed."""
        limit = max(0, int(after_bytes))
        self._truncate_epoch += 1
        self._truncations.append(limit)
        self.truncate_after = min(self._truncations)
        try:
            await asyncio.sleep(for_s)
        finally:
            if limit in self._truncations:  # (heal() may have cleared it meanwhile)
                self._truncations.remove(limit)
            self.truncate_after = min(self._truncations, default=None)

    async def drop(self, for_s: float) -> None:
        """Reset every open connection now, and every new one for ``for_s`` seconds."""
        self._drops += 1
        self.dropping = True
        self.dropped += len(self._writers) // 2  # (each connection: the client's side and the server's)
        self.cut()
        try:
            await asyncio.sleep(for_s)
        finally:
            self._drops -= 1
            self.dropping = self._drops > 0

    def heal(self) -> None:
        """End every lag, truncate and drop fault at once (their tasks cancelled or not)."""
        self._lags.clear()
        self._truncations.clear()
        self._drops = 0
        self.delay_s, self.truncate_after, self.dropping = 0.0, None, False

    def cut(self) -> None:
        for writer in list(self._writers):
            with contextlib.suppress(Exception):
                writer.transport.abort()
        self._writers.clear()

    # -- forwarding -----------------------------------------------------------------------------
    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        if self.dropping:  # refused: reset before a byte passes
            self.dropped += 1
            with contextlib.suppress(Exception):
                writer.transport.abort()
            return
        self._conns.add(task)
        self._writers.add(writer)
        upstream: asyncio.StreamWriter | None = None
        try:
            up_reader, upstream = await asyncio.open_connection(*self.target)
            self._writers.add(upstream)
            budget = _Budget()
            await asyncio.gather(
                self._pump(reader, upstream, self._up), self._pump(up_reader, writer, self._down, budget)
            )
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            for w in (writer, upstream):
                if w is not None:
                    self._writers.discard(w)
                    with contextlib.suppress(Exception):
                        w.transport.abort()
            self._conns.discard(task)

    def _allowed(self, budget: _Budget | None, size: int) -> int | None:
        """How many of ``size`` bytes going down may pass now (None: all; fewer: then close)."""
        limit = self.truncate_after
        if budget is None or limit is None:
            return None
        if budget.epoch != self._truncate_epoch:
            budget.epoch, budget.left = self._truncate_epoch, limit
        if size < budget.left:
            budget.left -= size
            return None
        return budget.left

    async def _pump(
        self, src: asyncio.StreamReader, dst: asyncio.StreamWriter, way: _Direction, budget: _Budget | None = None
    ) -> None:
        """Read as bytes come, deliver each chunk ``delay_s`` after it was read, in order: latency,
        not a narrower link (chunks in flight overlap, as packets on a long link do). ``budget``:
        this is the way down, which a truncate fault cuts short."""
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
                allowed = self._allowed(budget, len(data))
                if allowed is not None:  # truncated: what fits, then the connection ends
                    dst.write(data[:allowed])
                    await dst.drain()
                    dst.close()  # a FIN after the bytes (the abort below then discards nothing)
                    self.truncated += 1
                    return
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
