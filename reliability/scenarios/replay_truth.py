"""Scenario 13: every sample of a faulted run generated again, and judged from raw facts.

An hf fleet (replicas following the store, fast checkpoints) makes seeded samples under
concurrent load while the trainer publishes versions and one replica is SIGKILLed
mid-generation, so that some samples are resumed on another replica and at another version.
Then every sample is replayed (``RolloutClient.replay``, segment by segment) on replicas that
hold each version (``--hold-version``), and checked against what no replica said:

- the replayed tokens and log-probs against the original's, bit for bit (a deterministic
  original), or the tokens and the mode named (a batched one: float32 rounding differs);
- each span's log-probs against transformers' own forward pass over the trainer's bytes of
  that span's version (the tensors the trainer published, kept here);
- each version's digest in the coordinates against the trainer's checksums of that version.

A sample that cannot be replayed must be refused with its reason (``NotReplayable.reason``);
only ``multi_span`` (an activation inside a sampled request, on an engine that cannot advance its
stream: vLLM) is a refusal this run may see; hf replays such a segment with its stream advanced
past the draws before it, and refuses nothing.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from pathlib import Path
from typing import Any

from harness import ProcessGroup
from reliability.scenarios.common import REPO, Figures, gather_outcomes, start_broker
from reliability.scenarios.policy import load_torch, rl_step
from rollfleet.broker.topology import TopologyConfig
from rollfleet.policy_store.digest import content_digest
from rollfleet.schemas import RolloutPayload, RolloutResult, SamplingParams
from rollfleet.schemas.errors import NotReplayable
from rollfleet.schemas.replay_rules import ReplayOutcome, replay_segments
from rollfleet.trainer_client import PolicyPublisher, RolloutClient

# Fast checkpoints, so that a kill at a random moment leaves kept tokens to resume from, and a
# short claim life, so that a killed replica's jobs are taken over in about a second.
FAST = ("--ack-wait", "1.0", "--checkpoint-tokens", "16", "--checkpoint-s", "0.2")
# |replica's log-prob - transformers' log-prob|, float32: the same maths in another kernel order
# (hf), or in vLLM's CPU kernels (as its engine tests state).
TOLERANCE = {"hf": 1e-4, "vllm": 2e-4}


def engine_args(engine: str, workdir: Path, name: str) -> list[str]:
    """A worker's engine flags: hf in the worker's process, or a vLLM server it launches."""
    if engine == "hf":
        return ["--engine", "hf", "--device", "cpu"]
    from harness import vllm

    server = [f"--vllm-arg={a}" for a in vllm.LAUNCH_ARGS]
    log = ["--vllm-log", str(workdir / f"{name}.vllm.log")]
    return ["--engine", "vllm", "--vllm-python", str(vllm.PYTHON), *server, *log]


def server_env(engine: str) -> dict[str, str] | None:
    """What a launched vLLM server needs on shared cores: few threads, a small KV cache."""
    if engine != "vllm":
        return None
    from harness import vllm

    return dict(vllm.SERVER_ENV_CPU)


def _prompt(i: int) -> list[int]:
    rng = random.Random(i)
    return [rng.randrange(3, 250) for _ in range(rng.randrange(4, 12))]


def _sampled_spans(result: RolloutResult, index: int) -> list[tuple[int, int, int]]:
    """(version, start, end) of each span of sample ``index``, from the result's raw spans."""
    return [(s.version, s.start, s.end) for s in result.outputs[index].weight_versions]


class TrainerBytes:
    """The trainer's own tensors of each version it published, as transformers models."""

    def __init__(self, base: Path) -> None:
        from transformers import AutoModelForCausalLM

        self._load = lambda: AutoModelForCausalLM.from_pretrained(str(base)).float().eval()
        self.tensors: dict[int, dict[str, Any]] = {}
        self.digests: dict[int, bytes] = {}
        self._models: dict[int, Any] = {}

    def keep(self, version: int, tensors: dict[str, Any], publisher: PolicyPublisher) -> None:
        self.tensors[version] = {n: t.clone() for n, t in tensors.items()}
        fmt = publisher.checksum_format
        self.digests[version] = content_digest({n: f"{fmt}:{h}" for n, h in publisher.checksums.items()})

    def model(self, version: int) -> Any:
        if version not in self._models:
            model = self._load()
            missing, unexpected = model.load_state_dict(self.tensors[version], strict=False)
            if unexpected or any(not n.endswith("lm_head.weight") for n in missing):
                raise AssertionError(f"v{version}: the published tensors are not the model's: {missing} {unexpected}")
            self._models[version] = model
        return self._models[version]

    def logprobs(self, version: int, prompt: list[int], tokens: list[int]) -> list[float]:
        """transformers' forward pass over the prompt and the whole sample at ``version``."""
        import torch

        with torch.no_grad():
            logits = self.model(version)(torch.tensor([prompt + tokens])).logits[0].float()
        logp = torch.log_softmax(logits, dim=-1)
        return [float(logp[len(prompt) - 1 + i, t]) for i, t in enumerate(tokens)]


async def replay_truth(
    workdir: Path,
    engine: str = "hf",
    jobs: int = 50,
    n: int = 4,
    load_jobs: int = 10,
    max_tokens: int = 96,
    versions: int = 3,
    workers: int = 3,
) -> Figures:
    """``jobs`` seeded deterministic jobs of ``n`` samples beside ``load_jobs`` batched ones."""
    import torch

    fig = Figures(
        "13a" if engine == "hf" else "13b",
        f"Every sample of a faulted {engine} run replayed; log-probs against the trainer's bytes",
        {"samples": jobs * n, "load_samples": load_jobs * n, "max_tokens": max_tokens, "versions": versions + 1},
    )
    t0 = time.monotonic()
    workdir.mkdir(parents=True, exist_ok=True)
    from rollfleet.models import build_model_dir

    if engine == "vllm":
        from harness import vllm

        if (why := vllm.unavailable()) is not None:
            fig.problems.append(f"no vLLM to run: {why}")
            return fig
        base = vllm.build_model(workdir / "base", seed=0)
    else:
        base = build_model_dir(workdir / "base", preset="tiny", seed=0)
    store = workdir / "store"
    broker = start_broker(workdir)
    procs = ProcessGroup(workdir, cwd=REPO)
    ns = "rel13"
    publisher = PolicyPublisher(store, base, keyframe_every=0, keep_last=None)
    trainer = TrainerBytes(base)
    tensors = load_torch(base)
    gen = torch.Generator().manual_seed(13)
    tolerance = TOLERANCE[engine]
    follower = ["--store", str(store), "--capacity", "8", *FAST]
    # (vLLM's CPU build reloading while it generates can hold a worker's loop for seconds)
    beat = ["--heartbeat", "5"] if engine == "vllm" else []

    def follow(name: str) -> None:
        local = ["--local-dir", str(workdir / f"local-{name}")]
        procs.worker(
            broker.url, ns, name, *engine_args(engine, workdir, name), *follower, *local, *beat, env=server_env(engine)
        )

    try:
        topo = TopologyConfig(ack_wait_s=1.0)
        async with await RolloutClient.connect(broker.url, namespace=ns, client_id="trainer", topology=topo) as client:
            await client.publish_policy(publisher, tensors)  # version 0, the base
            trainer.keep(0, tensors, publisher)
            for i in range(workers):
                follow(f"w{i}")
            await client.wait_for_version(0, replicas=workers, timeout=600)

            payloads: dict[str, RolloutPayload] = {}
            for j in range(jobs + load_jobs):
                payloads[f"{'det' if j < jobs else 'load'}-{j}"] = RolloutPayload(
                    prompt_token_ids=_prompt(j),
                    sampling=SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=1000 + 10 * j),
                    n=n,
                    deterministic=j < jobs,
                    extra={"ignore_eos": True},
                )
            order = list(payloads)
            random.Random(0).shuffle(order)  # the batched load among the deterministic jobs
            handles = {}
            for k in order:
                handles[k] = await client.submit(
                    payloads[k], min_version=0, retry_policy="resume", idempotency_key=k, timeout=600
                )
            fig.submitted = len(handles)

            async def train() -> None:
                for _ in range(versions):
                    await asyncio.sleep(3.0)
                    rl_step(tensors, gen)
                    record = await client.publish_policy(publisher, tensors)
                    trainer.keep(record.version, tensors, publisher)
                    fig.versions_published += 1

            async def kill() -> None:
                # Mid-run, a replica running jobs (their tokens checkpointed): SIGKILLed, its
                # resumable jobs taken over by the others, which go on from the kept tokens.
                victim = None
                while victim is None:
                    await asyncio.sleep(0.2)
                    done = sum(h.done() for h in handles.values())
                    if done >= len(handles) // 5:
                        running = [r.worker_id for r in client.fleet.replicas() if r.in_flight]
                        victim = running[0] if running else None
                procs.kill(victim)
                fig.faults += 1
                fig.notes["killed"] = victim
                follow(f"{victim}-again")

            await asyncio.gather(train(), kill())
            results, errors = await gather_outcomes(handles, timeout=600)
            fig.completed, fig.failed = len(results), len(errors)
            fig.lost = len(handles) - len(results) - len(errors)
            fig.expect(not errors, f"jobs failed: {sorted((k, type(e).__name__) for k, e in errors.items())[:5]}")

            # -- the raw facts: every span's log-probs against the trainer's bytes of its version.
            worst, spans, resumed, multi_version = 0.0, 0, 0, 0
            for key, result in results.items():
                prompt = list(payloads[key].prompt_token_ids or [])
                for i, out in enumerate(result.outputs):
                    sampled = _sampled_spans(result, i)
                    spans += len(sampled)
                    resumed += len({s.replica for s in out.weight_versions if s.replica}) > 1
                    multi_version += len({v for v, _, _ in sampled}) > 1
                    for version, start, end in sampled:
                        ref = trainer.logprobs(version, prompt, list(out.token_ids))[start:end]
                        got = (out.logprobs or [])[start:end]
                        if len(got) != len(ref):
                            fig.problems.append(f"{key}[{i}]: {len(got)} log-probs for span {start}:{end}")
                            continue
                        diff = max((abs(a - b) for a, b in zip(got, ref, strict=True)), default=0.0)
                        worst = max(worst, diff)
                        fig.expect(diff <= tolerance, f"{key}[{i}] v{version} {start}:{end}: |Δ logprob| {diff:.3g}")
                digests = {v.version: v.digest for v in (result.replay.versions if result.replay else ())}
                for version, digest in digests.items():
                    fig.expect(
                        digest in (b"", trainer.digests[version]),  # (b"": made before a resume, unrecorded)
                        f"{key}: v{version}'s digest {digest.hex()} is not the trainer's",
                    )
            fig.notes["spans"] = spans
            fig.notes["samples resumed on another replica"] = resumed
            fig.notes["samples made at more than one version"] = multi_version
            fig.notes["max |logprob - transformers'|"] = worst
            fig.versions_activated = len({v for r in results.values() for o in r.outputs for v in _versions(o)})

            # -- every sample replayed on replicas holding each version the samples name.
            for name in procs.alive("w"):
                await asyncio.to_thread(procs.stop, name)
            held = sorted({v for r in results.values() for o in r.outputs for v in _versions(o)})
            for v in held:
                procs.worker(
                    broker.url, ns, f"hold{v}", *engine_args(engine, workdir, f"hold{v}"), "--store", str(store),
                    "--local-dir", str(workdir / f"local-hold{v}"), "--hold-version", str(v), "--deterministic", *beat,
                    env=server_env(engine),
                )  # fmt: skip
            await replay_all(client, results, payloads, store, fig)
    finally:
        procs.close()
        broker.stop()
    fig.seconds = time.monotonic() - t0
    return fig


def _versions(out: Any) -> set[int]:
    return {s.version for s in out.weight_versions}


async def replay_all(
    client: RolloutClient,
    results: dict[str, RolloutResult],
    payloads: dict[str, RolloutPayload],
    store: Path,
    fig: Figures,
) -> None:
    """Replay every sample of ``results`` and count what each replay said."""
    gate = asyncio.Semaphore(16)
    outcomes: dict[tuple[str, int], ReplayOutcome | NotReplayable] = {}

    async def one(key: str, index: int) -> None:
        async with gate:
            try:
                outcomes[key, index] = await client.replay(
                    results[key], payloads[key], index=index, store=store, timeout=300, wait_for_replica=True
                )
            except NotReplayable as err:
                outcomes[key, index] = err

    await asyncio.gather(*(one(k, i) for k, r in results.items() for i in range(len(r.outputs))))
    refused: dict[str, int] = {}
    det_exact = det_total = load_exact = load_tokens = load_total = 0
    for (key, index), o in sorted(outcomes.items()):
        if isinstance(o, NotReplayable):
            refused[o.reason] = refused.get(o.reason, 0) + 1
            # (hf advances a sample's stream: a segment begun at an activation is replayed, never refused)
            fig.expect(
                o.reason == "multi_span" and results[key].engine != "hf", f"{key}[{index}]: refused as {o.reason}: {o}"
            )
            continue
        if payloads[key].deterministic:
            det_total += 1
            det_exact += o.matched
            fig.expect(o.matched, f"{key}[{index}]: a deterministic sample replayed differently: {o}")
        else:
            load_total += 1
            load_exact += o.matched
            load_tokens += o.first_token is None
            fig.expect(
                o.matched or o.differs == ("deterministic",),
                f"{key}[{index}]: a batched sample's replay names {o.differs}: {o}",
            )
    fig.notes["deterministic samples replayed bit-exact"] = f"{det_exact}/{det_total}"
    fig.notes["batched samples replayed: same tokens"] = f"{load_tokens}/{load_total}"
    fig.notes["batched samples replayed: bit-exact"] = f"{load_exact}/{load_total}"
    fig.notes["refused (reason: samples)"] = refused
    # Segments begun at an activation inside a sampled request: replayed with the stream advanced.
    advanced = 0
    for key, r in results.items():
        for i in range(len(r.outputs)):
            with contextlib.suppress(NotReplayable):
                prompt = payloads[key].prompt_token_ids
                advanced += sum(q.stream_offset > 0 for q in replay_segments(r, i, prompt=prompt))
    fig.notes["segments replayed from inside their request (stream advanced)"] = advanced
