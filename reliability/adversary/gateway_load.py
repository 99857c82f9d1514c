"""The adversary's HTTP callers of the gateways: trajectories (session turns) and keyless requests.

One lane of ``reliability.adversary.load`` per ``--gateway-sessions``. It drives the two
``rollfleet gateway`` processes (one client id) the way agent frameworks and careless HTTP callers
do:

- **trajectories**: 2-5 turns of one ``X-Session-Id``, each turn's prompt the context so far;
  a turn is keyed (``Idempotency-Key``) or keyless, asks for a version now and then
  (``weight_version``: a floor, the latest exactly, or one no replica can serve yet), and now and
  then is seeded (``sampling_seed``). A keyed turn whose try fails (connection refused, a 503, no
  answer within ``TRY_S``, or the caller leaving on purpose) is asked again with the same key
  through the other gateway; a keyed turn is sometimes followed by a try that reuses its key for
  another body (which must never get another answer). A keyless turn is a new request at every
  try (a new nonce at the end of its prompt: each try's jobs are told apart by their prompt);
- **keyless requests**: plain ``/generate`` calls, one input or a small batch, sometimes
  streamed, whose caller always leaves at a random moment (while the gateway parses, submits,
  waits or streams): their jobs must be cancelled (the oracle's ``gone``).

Every call (``gw_call``) is journaled, fsynced, before it is tried; every try before it is sent
(``gw_send``: which gateway, when, its key and prompt) and after it ends (``gw_try``: the same,
when the caller left, the status and the answer as ``journal.http_answer`` reads it). Nothing
here checks anything: ``reliability.adversary.oracle_gateway`` does.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from typing import Any

from reliability.adversary.journal import http_answer

TRY_S = 6.0  # one try waits this long for its answer, then its caller leaves (and maybe retries)
TURN_S = 25.0  # a turn is not tried again after this long
LEAVE_SHARE = 0.25  # of a trajectory's tries, those whose caller leaves on purpose at a random moment
PLAIN_SHARE = 0.4  # of the lane's calls, keyless requests whose caller leaves
KEYED_SHARE = 0.6  # of a trajectory's turns, keyed
CONFLICT_SHARE = 0.08  # of the keyed turns, followed by a try reusing their key for another body
LONG_SHARE = 0.4  # of the keyless turns, long ones (seconds of tokens)


def nonce_tokens(rng: random.Random) -> list[int]:
    """Three tokens that make a prompt (and so its jobs) one of a kind."""
    return [rng.randrange(1000, 30000) for _ in range(3)]


class GatewaySessions:
    """One lane (``load.Load``: its journal, its stop time, the gateways' addresses)."""

    def __init__(self, load: Any, lane: int) -> None:
        self.load = load
        self.lane = lane
        self.rng = random.Random(f"gateway-sessions:{load.args.seed}:{load.inc}:{lane}")
        self.http: Any = None
        self.calls = 0

    def log(self, record: dict[str, Any]) -> None:
        self.load.log(record)

    def rid(self) -> str:
        return f"{self.load.rid()}/gw"

    async def run(self) -> None:
        import aiohttp

        # A connection a request: a caller that leaves closes it, as a browser or an agent does.
        self.http = aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True))
        try:
            count = 0
            while time.time() < self.load.stop_at - 1.0:
                count += 1
                if not self.load.gateway_addresses():
                    await asyncio.sleep(0.5)
                    continue
                if self.rng.random() < PLAIN_SHARE:
                    await self.keyless_request()
                else:
                    await self.trajectory(count)
                await asyncio.sleep(self.rng.uniform(0.1, 0.8))
        finally:
            await self.http.close()

    def pick(self, avoid: str | None = None) -> str:
        names = sorted(self.load.gateway_addresses()) or ["g1", "g2"]
        others = [n for n in names if n != avoid]
        return self.rng.choice(others or names)

    # -- trajectories ------------------------------------------------------------------------
    def weight_version(self) -> dict[str, int] | None:
        rng, latest = self.rng, int(self.load.client.latest_version or 0)
        roll = rng.random()
        if roll < 0.55:
            return None
        if roll < 0.8:
            return {"min_required_version": rng.randint(max(0, latest - 2), latest)}
        if roll < 0.93:
            return {"exact_version": latest}
        # One no replica can serve yet: a 200 for it is served outside what was asked.
        return {rng.choice(("exact_version", "min_required_version")): latest + 5}

    async def trajectory(self, count: int) -> None:
        rng = self.rng
        traj = f"traj-{self.load.inc}-{self.lane}-{count}"
        context = [7, self.load.inc + 1, self.lane + 1, count % 500 + 1]
        answered_key: str | None = None
        for turn in range(rng.randint(2, 5)):
            if time.time() >= self.load.stop_at - 1.0:
                return
            keyed = rng.random() < KEYED_SHARE
            key = f"gt-{self.load.inc}-{self.lane}-{count}-{turn}" if keyed else None
            # (a keyless turn is now and then long: one its caller leaves runs seconds for nobody
            # unless the gateway cancels it)
            long = not keyed and rng.random() < LONG_SHARE
            params: dict[str, Any] = {"max_new_tokens": rng.randint(1500, 2500) if long else rng.randint(8, 120)}
            if rng.random() < 0.3:
                params["sampling_seed"] = rng.randrange(1, 2**31)
            body: dict[str, Any] = {"input_ids": [*context, *nonce_tokens(rng)], "sampling_params": params,
                                    "return_logprob": True}  # fmt: skip
            wv = self.weight_version()
            if wv is not None:
                body["weight_version"] = wv
            if keyed and answered_key is not None and rng.random() < CONFLICT_SHARE:
                # The last answered key reused for this turn's body: another request under that key.
                await self.call("conflict", body, answered_key, traj, turn, leave=False, retries=False)
            data, sent = await self.call("turn", body, key, traj, turn)
            if isinstance(data, dict) and data.get("output_ids"):
                # The conversation so far: this turn's prompt (as its answered try sent it), then its answer.
                context = [*sent["input_ids"], *list(data["output_ids"])]
                answered_key = key or answered_key
            await asyncio.sleep(rng.uniform(0.0, 0.6))

    # -- keyless requests whose caller leaves ------------------------------------------------------
    async def keyless_request(self) -> None:
        rng = self.rng
        inputs = [[11, self.load.inc + 1, *nonce_tokens(rng)] for _ in range(rng.choice((1, 1, 1, 2, 4)))]
        # Long enough (4.5-9 s of the echo's tokens) that one left running generates for nobody
        # well past the bound.
        params = {"max_new_tokens": rng.randint(1500, 3000)}
        body: dict[str, Any] = {"input_ids": inputs[0] if len(inputs) == 1 else inputs, "sampling_params": params}
        if len(inputs) == 1 and rng.random() < 0.3:
            body["stream"] = True
        await self.call("plain", body, None, None, None, leave=True, retries=False)

    # -- one call, tried until answered ---------------------------------------------------------
    async def call(
        self,
        kind: str,
        body: dict[str, Any],
        key: str | None,
        traj: str | None,
        turn: int | None,
        *,
        leave: bool | None = None,
        retries: bool = True,
    ) -> tuple[Any, dict[str, Any]]:
        """Send it (a keyless call: a new nonce at every try), through the other gateway after a
        failed try, until answered or ``TURN_S``: the answer's data (None: none) and the body the
        last try sent."""
        rng = self.rng
        rid = self.rid()
        t0 = time.time()
        self.log({"ev": "gw_call", "rid": rid, "kind": kind, "traj": traj, "turn": turn, "key": key, "body": body,
                  "t0": t0})  # fmt: skip
        name: str | None = None
        tries = 0
        while True:
            tries += 1
            name = self.pick(avoid=name)
            address = self.load.gateway_addresses().get(name)
            if key is None and tries > 1:  # a keyless retry is another request: another nonce
                body = {**body, "input_ids": [*body["input_ids"][:-3], *nonce_tokens(rng)]}
            leaving = leave if leave is not None else rng.random() < LEAVE_SHARE
            stay = rng.uniform(0.005, 1.5) if leaving else TRY_S
            headers = {"X-Session-Id": traj} if traj else {}
            if key is not None:
                headers["Idempotency-Key"] = key
            t_sent = time.time()
            record: dict[str, Any] = {"ev": "gw_try", "rid": rid, "try": tries, "gateway": name, "address": address,
                                      "t_sent": t_sent, "key": key, "input_ids": body["input_ids"]}  # fmt: skip
            if address is not None:
                # Journaled before it is sent: a trainer SIGKILLed while a try is under way never
                # writes its ``gw_try``, yet the try may have run a turn the wiretap sees.
                self.log({**record, "ev": "gw_send"})
            status, data, outcome = await self._post(address, body, headers, stay)
            now = time.time()
            if status is None and outcome == "left":
                record.update(gone=True, t_gone=now, on_purpose=leaving)
            record.update(t_end=now, outcome=outcome, status=status)
            if status is not None:
                record["answer"] = http_answer(status, data) if not body.get("stream") else {"kind": "stream"}
            self.log(record)
            if status is not None and status != 503:
                return (data if status == 200 else None), body
            if not retries or now - t0 > TURN_S or time.time() >= self.load.stop_at + 5.0:
                return None, body
            if key is None and outcome == "left" and rng.random() < 0.5:
                return None, body  # a keyless caller that left does not always come back
            await asyncio.sleep(0.2)

    async def _post(
        self, address: str | None, body: dict[str, Any], headers: dict[str, str], stay: float
    ) -> tuple[int | None, Any, str]:
        """(status, data, outcome): outcome "answered", "left" (the caller closed the connection
        after ``stay`` s without an answer) or the connection error."""
        import aiohttp

        if address is None:
            return None, None, "no address (not running)"

        async def post() -> tuple[int, Any]:
            async with self.http.post(f"{address}/generate", json=body, headers=headers) as resp:
                if body.get("stream"):
                    async for _ in resp.content:  # (read until the stream ends: the answer is not judged)
                        pass
                    return resp.status, None
                return resp.status, await resp.json(content_type=None)

        try:
            status, data = await asyncio.wait_for(post(), stay)
        except TimeoutError:
            return None, None, "left"
        except (aiohttp.ClientError, ValueError, json.JSONDecodeError) as exc:
            return None, None, f"{type(exc).__name__}: {str(exc)[:120]}"
        return status, data, "answered"
