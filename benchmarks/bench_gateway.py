"""The gateway's cost: the same fleet asked through ``rollfleet gateway`` (HTTP, SGLang's
``/generate``) and directly through ``RolloutClient``, in the same run.

One broker, one echo worker process (capacity 64), one ``rollfleet gateway`` process. From this
process, interleaved rounds of: sequential requests (1 in flight: p50 latency) and a window of
64 in flight (throughput), over HTTP to the gateway and through ``RolloutClient`` to the
fleet, the same prompt and length. The HTTP caller is aiohttp's client (httpx's own CPU per
request capped the window below what the gateway serves). Targets (issue 32): p50 through the
gateway within 1.1x plus 2 ms of the client's; throughput >= 0.9x. The gateway's CPU per
request (from /proc) is reported. A second gateway process on the same fleet runs on the other
loop (``ROLLFLEET_EVENT_LOOP``: asyncio's where the default is uvloop), measured in the same
interleaved rounds: what the gateway's default loop is worth.

Then a fresh gateway process (its own namespace, and an echo worker that generates slowly, with
a slot for every request) holds ``STREAMS`` server-sent-event streams open at once: its resident
memory at rest and at the peak (VmHWM, from /proc), per open stream, and its CPU per stream.
"""

from __future__ import annotations

import asyncio
import re
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import openai

from benchmarks._fleet import REPO, machine_load, percentile
from benchmarks.report import Row
from harness import cpu_seconds, spawn, stop_all, temp_broker, wait_until, worker_command
from harness.processes import rollfleet_command
from rollfleet.cli.event_loop import EVENT_LOOP_ENV, resolved
from rollfleet.schemas import RolloutPayload, SamplingParams
from rollfleet.trainer_client import RolloutClient

PROMPT = list(range(3, 35))
MAX_TOKENS = 16
WINDOW = 64
STREAMS = 1000
STREAM_TOKENS = 16
STREAM_TOKEN_S = 0.25  # each stream stays open >= 4 s: every one is open at the peak


def _payload() -> RolloutPayload:
    return RolloutPayload(prompt_token_ids=PROMPT, sampling=SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0))


_BODY = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": MAX_TOKENS, "temperature": 1.0}}


async def _direct_one(client: RolloutClient) -> None:
    await (await client.submit(_payload(), min_version=0, timeout=60))


async def _gateway_one(http: aiohttp.ClientSession) -> None:
    async with http.post("/generate", json=_BODY) as r:
        r.raise_for_status()
        await r.read()


async def _openai_one(oa: openai.AsyncOpenAI) -> None:
    await oa.completions.create(model="rollfleet", prompt=PROMPT, max_tokens=MAX_TOKENS, temperature=1.0)


async def _latencies(one: object, n: int) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        await one()  # type: ignore[operator]
        out.append(time.perf_counter() - t0)
    return out


async def _throughput(one: object, total: int) -> float:
    sem = asyncio.Semaphore(WINDOW)

    async def go() -> None:
        async with sem:
            await one()  # type: ignore[operator]

    t0 = time.perf_counter()
    await asyncio.gather(*(go() for _ in range(total)))
    return total / (time.perf_counter() - t0)


async def _gateway(
    url: str, namespace: str, name: str, tmp: Path, procs: list[Any], *args: str, env: dict[str, str] | None = None
) -> tuple[Any, str]:
    """A ``rollfleet gateway`` process on ``namespace``: its process and its address, once it listens."""
    gw_log = tmp / f"{name}-gw.log"
    cmd = rollfleet_command("gateway", "--nats", url, "-n", namespace, "--port", "0", *args)
    gw = spawn(cmd, gw_log, cwd=REPO, env=env)
    procs.append(gw)
    found = await wait_until(
        lambda: re.search(r"on (http://\S+)", gw_log.read_text()) if gw_log.exists() else None, timeout=60,
        what="the gateway listening",
    )  # fmt: skip
    return gw, found.group(1)


async def _fleet(
    client: RolloutClient, url: str, namespace: str, name: str, worker_args: list[str], tmp: Path, procs: list[Any]
) -> tuple[Any, str]:
    """One echo worker and one ``rollfleet gateway`` process on the client's namespace: the
    gateway's process and its address, once it listens and the worker serves version 0."""
    procs.append(spawn(worker_command(url, namespace, "w", *worker_args), tmp / f"{name}-w.log", cwd=REPO))
    gw = await _gateway(url, namespace, name, tmp, procs)
    await client.wait_for_version(0, replicas=1, timeout=60)
    return gw


async def bench(url: str, rounds: int, seq: int, total: int, tmp: Path) -> list[Row]:
    namespace = "gw" + uuid.uuid4().hex[:8]
    procs: list[Any] = []
    lat = {"direct": [], "gateway": [], "openai": [], "other": []}  # type: dict[str, list[float]]
    thr = {"direct": [], "gateway": [], "openai": [], "other": []}  # type: dict[str, list[float]]
    gw_cpu_per_req: list[float] = []
    other_cpu_per_req: list[float] = []  # the gateway on the other loop
    loop = resolved("gateway")
    other = "asyncio" if loop == "uvloop" else "uvloop"
    caller_cpu: list[float] = []  # this process's (the HTTP caller's) CPU per request
    async with await RolloutClient.connect(url, namespace=namespace, client_id="bench") as client:
        try:
            gw, base = await _fleet(client, url, namespace, "latency", ["--capacity", str(WINDOW)], tmp, procs)
            gw_o, base_o = await _gateway(url, namespace, other, tmp, procs, "--client-id", f"gw-{other}",
                                          env={EVENT_LOOP_ENV: other})  # fmt: skip
            # aiohttp's client as the caller: httpx spent 3.4 ms of this process's CPU a request,
            # capping the window at what the caller, not the gateway, could send.
            connector = aiohttp.TCPConnector(limit=WINDOW)
            # (For the record: the official openai client, as agent frameworks call the gateway.)
            async with (
                openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0) as oa,
                aiohttp.ClientSession(base_url=base, connector=connector) as http,
                aiohttp.ClientSession(base_url=base_o, connector=aiohttp.TCPConnector(limit=WINDOW)) as http_o,
            ):
                for _ in range(20):  # warm every path
                    await _direct_one(client)
                    await _gateway_one(http)
                    await _gateway_one(http_o)
                    await _openai_one(oa)
                for i in range(rounds):
                    lat["direct"] += await _latencies(lambda: _direct_one(client), seq)
                    lat["gateway"] += await _latencies(lambda: _gateway_one(http), seq)
                    lat["other"] += await _latencies(lambda: _gateway_one(http_o), seq)
                    lat["openai"] += await _latencies(lambda: _openai_one(oa), seq)
                    thr["openai"].append(await _throughput(lambda: _openai_one(oa), total))
                    thr["direct"].append(await _throughput(lambda: _direct_one(client), total))
                    # The two gateways in turn, which first alternating (the first of a pair tends to
                    # meet a different machine load).
                    for which in (("gateway", "other") if i % 2 == 0 else ("other", "gateway")):
                        proc, session = (gw, http) if which == "gateway" else (gw_o, http_o)
                        c0, me0 = cpu_seconds(proc.pid), cpu_seconds()
                        thr[which].append(await _throughput(lambda s=session: _gateway_one(s), total))
                        (gw_cpu_per_req if which == "gateway" else other_cpu_per_req).append(
                            (cpu_seconds(proc.pid) - c0) / total
                        )
                        if which == "gateway":
                            caller_cpu.append((cpu_seconds() - me0) / total)
        finally:
            stop_all(procs)
    p50 = {k: percentile(v, 50) for k, v in lat.items()}
    tput = {k: statistics.median(v) for k, v in thr.items()}
    extra = {"rounds": rounds, "sequential_per_round": seq, "window": WINDOW, "per_window_round": total,
             "p99_s": {k: percentile(v, 99) for k, v in lat.items()}, "load": machine_load(),
             "gateway_cpu_s_per_request": statistics.median(gw_cpu_per_req),
             "http_caller_cpu_s_per_request": statistics.median(caller_cpu), "gateway_loop": loop,
             "req_s_each_round": thr}  # fmt: skip
    cpu_extra = {"gateway_cpu_s_each_round": gw_cpu_per_req, f"{other}_cpu_s_each_round": other_cpu_per_req}
    return [
        Row("gateway/latency", "1 in flight, p50", "s", p50["gateway"], p50["direct"], "RolloutClient", False,
            "<= 1.1x + 2 ms", extra, p50["gateway"] <= 1.1 * p50["direct"] + 0.002),
        Row("gateway/throughput", f"{WINDOW} in flight", "req/s", tput["gateway"], tput["direct"], "RolloutClient",
            True, ">= 0.9x", {}, tput["gateway"] >= 0.9 * tput["direct"]),
        Row("gateway/cpu", f"gateway process, per request ({loop})", "ms", 1000 * statistics.median(gw_cpu_per_req),
            1000 * statistics.median(other_cpu_per_req), f"the gateway on {other}", False, "", cpu_extra),
        Row("gateway/latency", f"1 in flight, p50, on {other}", "s", p50["other"], p50["direct"],
            "RolloutClient", False, "", {}),
        Row("gateway/throughput", f"{WINDOW} in flight, on {other}", "req/s", tput["other"], tput["direct"],
            "RolloutClient", True, "", {}),
        Row("gateway/openai", "1 in flight, p50 (openai client, /v1/completions)", "s", p50["openai"],
            p50["direct"], "RolloutClient", False, "", {"p99_s": percentile(lat["openai"], 99)}),
        Row("gateway/openai", f"{WINDOW} in flight (openai client)", "req/s", tput["openai"], tput["direct"],
            "RolloutClient", True, "", {}),
    ]  # fmt: skip


def _status_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field):
            return int(line.split()[1])
    raise KeyError(field)


async def streams(url: str, count: int, tmp: Path) -> list[Row]:
    """``count`` streams open at once through one gateway: its memory at rest and at the peak."""
    namespace = "gs" + uuid.uuid4().hex[:8]
    procs: list[Any] = []
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": STREAM_TOKENS}, "stream": True}
    async with await RolloutClient.connect(url, namespace=namespace, client_id="bench-streams") as client:
        try:
            args = ["--capacity", str(count), "--echo-token-latency", str(STREAM_TOKEN_S)]
            gw, base = await _fleet(client, url, namespace, "streams", args, tmp, procs)
            open_now, peak_open, events = 0, 0, 0
            connector = aiohttp.TCPConnector(limit=0)  # no cap: every stream its own connection
            async with aiohttp.ClientSession(base_url=base, connector=connector,
                                             timeout=aiohttp.ClientTimeout(total=300)) as http:  # fmt: skip
                async with http.post("/generate", json=body | {"stream": False}) as r:  # warm
                    r.raise_for_status()
                    await r.read()
                rest_kib, hwm0 = _status_kib(gw.pid, "VmRSS:"), _status_kib(gw.pid, "VmHWM:")
                c0 = cpu_seconds(gw.pid)

                async def one() -> None:
                    nonlocal open_now, peak_open, events
                    async with http.post("/generate", json=body) as r:
                        r.raise_for_status()
                        open_now += 1
                        peak_open = max(peak_open, open_now)
                        async for line in r.content:
                            events += line.startswith(b"data:")
                        open_now -= 1

                t0 = time.perf_counter()
                await asyncio.gather(*(one() for _ in range(count)))
                wall = time.perf_counter() - t0
                cpu = cpu_seconds(gw.pid) - c0
                peak_kib = _status_kib(gw.pid, "VmHWM:")
        finally:
            stop_all(procs)
    per_stream_kib = (peak_kib - rest_kib) / count
    extra = {"streams": count, "peak_open_at_once": peak_open, "events": events, "wall_s": wall,
             "gateway_rss_at_rest_kib": rest_kib, "gateway_hwm_before_kib": hwm0, "gateway_hwm_peak_kib": peak_kib,
             "gateway_cpu_s_per_stream": cpu / count, "tokens_per_stream": STREAM_TOKENS,
             "token_latency_s": STREAM_TOKEN_S}  # fmt: skip
    return [
        Row("gateway/streams", f"{count} open at once, peak RSS", "MiB", peak_kib / 1024, rest_kib / 1024,
            "the gateway at rest", False, "", extra),
        Row("gateway/streams", "memory per open stream", "KiB", per_stream_kib, None, "", False, "", {}),
        Row("gateway/streams", "gateway CPU per stream", "ms", 1000 * cpu / count, None, "", False, "", {}),
    ]  # fmt: skip


def run(quick: bool = False) -> list[Row]:
    rounds, seq, total = (1, 20, 128) if quick else (5, 100, 1000)
    count = 100 if quick else STREAMS
    with temp_broker("bench-gw-") as broker, tempfile.TemporaryDirectory(prefix="bench-gw-") as tmp:
        rows = asyncio.run(bench(broker.url, rounds, seq, total, Path(tmp)))
        return rows + asyncio.run(streams(broker.url, count, Path(tmp)))
