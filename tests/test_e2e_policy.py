"""End to end with real processes: a trainer publishes versions while two hf workers serve."""

from __future__ import annotations

import asyncio
import signal
from pathlib import Path

import msgspec
import pytest
import torch

from harness import start_worker_process, terminate, wait_until
from rollfleet.models import build_model_dir, load_model_tensors
from rollfleet.policy_store.digest import weights_digest
from rollfleet.schemas import RolloutPayload, SamplingParams, VersionActivated, decode, served_within
from rollfleet.schemas.errors import RollfleetError
from rollfleet.trainer_client import PolicyPublisher, RolloutClient

pytestmark = pytest.mark.slow


def rl_step(tensors: dict[str, torch.Tensor], gen: torch.Generator, density: float = 0.01) -> None:
    """A small update to about ``density`` of the elements of every tensor, in place."""
    for t in tensors.values():
        flat = t.view(-1)
        k = max(1, int(flat.numel() * density))
        idx = torch.randint(0, flat.numel(), (k,), generator=gen)
        flat[idx] += torch.randn(k, generator=gen).to(flat.dtype) * 0.05


async def activations(client: RolloutClient) -> list[VersionActivated]:
    sub = await client.js.pull_subscribe(client.names.versions_activated, stream=client.names.events_stream)
    out: list[VersionActivated] = []
    try:
        while True:
            msgs = await sub.fetch(100, timeout=0.5)
            out += [a for m in msgs if not (a := decode(m.data, VersionActivated)).at_start]
    except TimeoutError:
        pass
    await sub.unsubscribe()
    return out


async def taken(client: RolloutClient, kind: str, version: int, count: int) -> bool:
    """Whether ``count`` jobs of a subject have been delivered to workers and none waits unpulled."""
    consumer = client.names.job_consumer(kind, version)  # type: ignore[arg-type]
    info = await client.js.consumer_info(client.names.jobs_stream, consumer)
    return info.num_pending == 0 and (info.num_ack_pending or 0) + (info.delivered.consumer_seq or 0) >= count


LONG = RolloutPayload(
    prompt_token_ids=[5, 6, 7, 8],
    sampling=SamplingParams(max_tokens=160, temperature=1.0, seed=1),
    extra={"ignore_eos": True},
)


async def test_fleet_follows_published_versions(nats_url: str, namespace: str, tmp_path: Path) -> None:
    base = build_model_dir(tmp_path / "base", preset="tiny", seed=0)
    store = tmp_path / "store"
    publisher = PolicyPublisher(store, base, keyframe_every=2)
    tensors = load_model_tensors(base)
    gen = torch.Generator().manual_seed(0)
    procs = []
    try:
        async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="trainer") as client:
            record = await client.publish_policy(publisher, tensors)
            assert record.version == 0
            for i in range(2):
                procs.append(
                    start_worker_process(
                        nats_url, namespace, f"hf{i}", "--engine", "hf", "--device", "cpu", "--store", str(store),
                        "--local-dir", str(tmp_path / f"local{i}"), "--verify-live", "--capacity", "4",
                        log_path=tmp_path / f"hf{i}.log",
                    )
                )  # fmt: skip
            await client.wait_for_version(0, replicas=2, timeout=60)
            handles, pinned = [], []
            for step in range(1, 4):
                # Exact jobs at the version about to be replaced: each runs entirely at it, or not at all.
                await client.wait_for_version(step - 1, replicas=2, timeout=60)
                pinned += [await client.submit(LONG, exact_version=step - 1, timeout=60) for _ in range(3)]
                handles += [await client.submit(LONG, max_staleness=1) for _ in range(4)]
                # Publish while those jobs are being generated, so activations land mid-request (and
                # the exact ones, all taken by now, hold each activation until they are done).
                await wait_until(lambda s=step: taken(client, "exact", s - 1, 3), timeout=30, retry_errors=True)
                rl_step(tensors, gen)
                record = await client.publish_policy(publisher, tensors)
                assert record.version == step and record.kind in ("delta", "full")
                handles += [await client.submit(LONG, max_staleness=1) for _ in range(2)]
            results = await asyncio.gather(*(h.result(120) for h in handles))
            exact = await asyncio.gather(*(h.result(120) for h in pinned), return_exceptions=True)
            await client.wait_for_version(3, replicas=2, timeout=60)
            for handle, result in zip(handles, results, strict=True):
                assert served_within(handle.job.constraint, result)
                assert len(result.outputs[0].token_ids) == 160
                assert all(lp <= 0.0 for lp in result.outputs[0].logprobs or [])
            for handle, outcome in zip(pinned, exact, strict=True):
                if isinstance(outcome, RollfleetError):
                    assert outcome.retryable, repr(outcome)  # never served, and told so
                    continue
                v = handle.job.constraint.version
                assert [(w.version, w.start, w.end) for w in outcome.outputs[0].weight_versions] == [(v, 0, 160)]
            served_exact = sum(not isinstance(o, BaseException) for o in exact)
            assert served_exact == len(pinned), f"only {served_exact}/{len(pinned)} exact jobs served"
            spans = [r for r in results if r.version_start < r.version_end]
            assert spans, "no request spanned an activation"
            for r in spans:  # the tokens say which version produced them (one activation or more)
                versions = [w.version for w in r.outputs[0].weight_versions]
                assert versions == sorted(set(versions))
                assert (versions[0], versions[-1]) == (r.version_start, r.version_end)
            assert {r.worker_id for r in results} == {"hf0", "hf1"}
            acts = await activations(client)
            final = {a.worker_id: a for a in acts if a.version == 3}
            assert set(final) == {"hf0", "hf1"}
            expected = weights_digest(publisher.checksums)
            for a in final.values():
                assert a.weights_digest == expected  # each worker serves exactly the trainer's bytes
            for a in acts:
                assert a.prepare_s > 0 and a.pause_s > 0 and a.wire_bytes > 0 and 0 < a.density <= 1
                print("activation", msgspec.to_builtins(a))
            print(f"{len(spans)}/{len(results)} requests spanned an activation; {served_exact}/{len(pinned)} exact")
    finally:
        for p in procs:
            terminate(p, 20.0, signal.SIGTERM)
