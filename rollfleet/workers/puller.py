"""Pull jobs from one shared durable consumer without waiting when it is empty.

nats-py's ``fetch`` turns an empty pull into a long poll; a worker that serves several
subjects wants an immediate answer (``no_wait``) so it can try the next subject. One
request is outstanding at a time per puller, on its own inbox.
"""

from __future__ import annotations

import asyncio
import json

from nats.aio.client import Client as NATS
from nats.aio.msg import Msg

_STATUS = "Status"


class JobPuller:
    def __init__(self, nc: NATS, stream: str, consumer: str) -> None:
        self._nc = nc
        self._api = f"$JS.API.CONSUMER.MSG.NEXT.{stream}.{consumer}"
        self._inbox = nc.new_inbox()
        self._queue: asyncio.Queue[Msg] = asyncio.Queue()
        self._sub = None
        self._lock = asyncio.Lock()

    async def start(self) -> JobPuller:
        self._sub = await self._nc.subscribe(self._inbox, cb=self._queue.put)
        return self

    async def pull(self, batch: int, timeout: float = 2.0) -> list[Msg]:
        """Up to ``batch`` jobs available right now (possibly none)."""
        async with self._lock:
            msgs: list[Msg] = []
            # Messages that arrived after an earlier request gave up are still ours to run.
            while not self._queue.empty() and len(msgs) < batch:
                msg = self._queue.get_nowait()
                if not (msg.headers and _STATUS in msg.headers):
                    msgs.append(msg)
            if len(msgs) >= batch:
                return msgs
            request = json.dumps({"batch": batch - len(msgs), "no_wait": True}).encode()
            await self._nc.publish(self._api, request, reply=self._inbox)
            loop = asyncio.get_running_loop()
            deadline = loop.time() + timeout
            while len(msgs) < batch:
                remaining = deadline - loop.time()
                if remaining <= 0:
                    break
                try:
                    msg = await asyncio.wait_for(self._queue.get(), remaining)
                except TimeoutError:
                    break
                if msg.headers and _STATUS in msg.headers:
                    break  # 404 no messages, 408 expired, 409 consumer gone: this request is over
                msgs.append(msg)
            return msgs

    async def close(self) -> None:
        if self._sub is not None:
            try:
                await self._sub.unsubscribe()
            except Exception:  # connection already closed
                pass
            self._sub = None
