"""Replicas sample independently: the same prompt sent as many n=1 jobs to two real hf worker
processes gives distinct completions, across replicas and across a restart; a job with an
explicit seed gives the same tokens on every replica. The sglang adapter draws a seed for an
unseeded sampled job and sends each sample its own stream (SGLang seeds every unseeded request
alike, 42, under deterministic inference, and ignores seeds otherwise)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from harness import start_worker_process, stop_all, wait_until
from rollfleet.models import build_model_dir
from rollfleet.schemas import RolloutPayload, RolloutResult, SamplingParams
from rollfleet.trainer_client import RolloutClient
from rollfleet.workers.engines.sglang import SGLangEngine
from tests.sglang_standin import SGLangStandin

PROMPT = [5, 6, 7, 8]
JOBS = 16  # per fleet start: a GRPO group of 16 split into n=1 jobs
WORKERS = ("hf-0", "hf-1")


def job(seed: int | None = None) -> RolloutPayload:
    # Ten tokens from a random tiny model (vocabulary 1024, nearly flat): independent draws
    # collide with probability ~1e-30, so any repeat is a shared random stream.
    sampling = SamplingParams(max_tokens=10, temperature=1.0, seed=seed)
    return RolloutPayload(prompt_token_ids=PROMPT, sampling=sampling, extra={"ignore_eos": True})


async def run_jobs(client: RolloutClient, payloads: list[RolloutPayload]) -> list[RolloutResult]:
    handles = [await client.submit(p, min_version=0, timeout=120) for p in payloads]
    return list(await asyncio.gather(*(h.result(120) for h in handles)))


@pytest.mark.slow
async def test_unseeded_jobs_differ_across_replicas_and_restarts(nats_url: str, namespace: str, tmp_path: Path) -> None:
    model = build_model_dir(tmp_path / "model", preset="tiny", seed=0)
    completions: list[tuple[str, tuple[int, ...]]] = []
    seeded: dict[str, set[tuple[int, ...]]] = {}
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
        for start in range(2):  # the second start is a restart of both replicas
            procs = [
                start_worker_process(
                    nats_url, namespace, worker_id, "--engine", "hf", "--device", "cpu", "--model-dir", str(model),
                    "--capacity", "2", log_path=tmp_path / f"{worker_id}-{start}.log",
                )
                for worker_id in WORKERS
            ]  # fmt: skip
            try:
                await client.wait_for_version(0, replicas=2, timeout=120)
                results = await run_jobs(client, [job() for _ in range(JOBS)])
                completions += [(r.worker_id, tuple(r.outputs[0].token_ids)) for r in results]
                assert {r.worker_id for r in results} == set(WORKERS), "both replicas must serve"
                # Jobs with an explicit seed, until each replica has answered some (placement is
                # the fleet's choice, not the test's).
                for _ in range(10):
                    for r in await run_jobs(client, [job(seed=1234) for _ in range(4)]):
                        seeded.setdefault(r.worker_id, set()).add(tuple(r.outputs[0].token_ids))
                    if set(seeded) == set(WORKERS):
                        break
            finally:
                stop_all(procs)
            # The restart must not be judged by the stopped replicas' entries (their deregistration
            # can reach this client's view after the new processes were started).
            await wait_until(lambda: not client.fleet.replicas(), timeout=60, what="the stopped replicas gone")
    distinct = len({tokens for _, tokens in completions})
    print(f"distinct unseeded completions: {distinct} of {len(completions)}")
    assert distinct == len(completions), sorted(completions)
    assert set(seeded) == set(WORKERS)
    assert len(set().union(*seeded.values())) == 1, seeded  # reproducible on every replica and start


@pytest.mark.contract
async def test_the_sglang_adapter_sends_each_sample_its_own_stream_seeded_or_drawn() -> None:
    with SGLangStandin(weight_version="0") as standin:
        engine = SGLangEngine(url=standin.url)
        await engine.start(None, 0)
        try:
            unseeded = RolloutPayload(prompt_token_ids=PROMPT, n=3, sampling=SamplingParams(max_tokens=2))
            drawn = (await engine.generate("u", unseeded)).seed
            greedy = RolloutPayload(prompt_token_ids=PROMPT, sampling=SamplingParams(max_tokens=2, temperature=0.0))
            await engine.generate("g", greedy)
            await engine.generate("s", job(seed=7))
        finally:
            await engine.close()
        first, plain, seeded = standin.state.bodies("/generate")
    assert isinstance(drawn, int)  # (recorded: the replay coordinate names it)
    assert [params["sampling_seed"] for params in first["sampling_params"]] == [drawn, drawn + 1, drawn + 2]
    assert "sampling_seed" not in plain["sampling_params"]  # greedy: no stream to seed
    assert seeded["sampling_params"]["sampling_seed"] == 7
