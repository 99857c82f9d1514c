"""Replaying samples through a real fleet: an hf worker and an echo worker (real processes, one
real broker, the tiny model built from a config), each result replayed and judged from raw
facts: its tokens and log-probs bit for bit, the hf log-probs against transformers' own forward
pass over the trainer's bytes of the version, and the version's digest against the trainer's
checksums. One process test covers every check (the suite's budget is nearly spent)."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import torch
from transformers import AutoModelForCausalLM

from harness import start_worker_process, stop_all
from rollfleet.models import build_model_dir, load_model_tensors
from rollfleet.policy_store.digest import content_digest
from rollfleet.policy_store.materialize import store_content_digest
from rollfleet.schemas import RolloutPayload, RolloutResult, SamplingParams
from rollfleet.schemas.errors import NotReplayable
from rollfleet.trainer_client import PolicyPublisher, RolloutClient

PROMPT = [5, 6, 7, 8, 9]


def ask(n: int = 1, seed: int | None = None, deterministic: bool = True, max_tokens: int = 24) -> RolloutPayload:
    return RolloutPayload(
        prompt_token_ids=PROMPT,
        sampling=SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed),
        n=n,
        deterministic=deterministic,
        extra={"ignore_eos": True},
    )


def reference_logprobs(model: torch.nn.Module, tokens: list[int]) -> list[float]:
    """transformers' own forward pass over the prompt and the sample, in one batch of one."""
    with torch.no_grad():
        logits = model(torch.tensor([PROMPT + tokens])).logits[0].float()
    logp = torch.log_softmax(logits, dim=-1)
    return [float(logp[len(PROMPT) - 1 + i, t]) for i, t in enumerate(tokens)]


async def test_results_replay_bit_for_bit_and_every_altered_part_is_named(nats_url: str, tmp_path: Path) -> None:
    base = build_model_dir(tmp_path / "base", preset="tiny", seed=0)
    store, other_store = tmp_path / "store", tmp_path / "other-store"
    publisher = PolicyPublisher(store, base)
    procs = []
    try:
        async with (
            await RolloutClient.connect(nats_url, namespace="rhf", client_id="trainer") as hf,
            await RolloutClient.connect(nats_url, namespace="recho", client_id="trainer") as echo,
        ):
            await hf.publish_policy(publisher, load_model_tensors(base))
            procs.append(start_worker_process(
                nats_url, "rhf", "hf0", "--engine", "hf", "--device", "cpu", "--store", str(store),
                "--local-dir", str(tmp_path / "local"), "--capacity", "8", log_path=tmp_path / "hf0.log",
            ))  # fmt: skip
            procs.append(start_worker_process(nats_url, "recho", "echo0", log_path=tmp_path / "echo0.log"))
            await asyncio.gather(
                hf.wait_for_version(0, replicas=1, timeout=120), echo.wait_for_version(0, replicas=1, timeout=120)
            )

            # -- hf: an unseeded request, run deterministic: the replica drew a seed and says which.
            unseeded = ask(n=2)
            original = await (await hf.submit(unseeded, exact_version=0)).result(60)
            coord = original.replay
            assert coord is not None and coord.sampling.seed is not None, coord
            assert coord.build.engine == "hf" and coord.build.deterministic and coord.build.device == "cpu"
            assert coord.build.dtype == "float32" and coord.build.torch == torch.__version__
            # The version's digest is the trainer's checksums', and the store's.
            trainer = content_digest({n: f"{publisher.checksum_format}:{h}" for n, h in publisher.checksums.items()})
            assert [(v.version, v.digest) for v in coord.versions] == [(0, trainer)]
            assert store_content_digest(store, 0) == trainer
            outcomes = [await hf.replay(original, unseeded, index=i, store=store) for i in range(2)]
            assert all(o.matched and o.replica == "hf0" for o in outcomes), outcomes
            assert original.outputs[0].token_ids != original.outputs[1].token_ids  # two streams, not one twice
            model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32).eval()
            for out in original.outputs:  # the behaviour policy is the trainer's bytes, not the replica's word
                ref = reference_logprobs(model, out.token_ids)
                assert max(abs(a - b) for a, b in zip(out.logprobs or [], ref, strict=True)) < 1e-4

            # -- hf under concurrent load, batched (not deterministic): replayed alone, each one
            # either matches bit for bit or names the mode it ran in; never a silent match.
            loaded = [ask(seed=100 + i, deterministic=False) for i in range(6)]
            handles = [await hf.submit(p, exact_version=0) for p in loaded]
            batched: list[RolloutResult] = [await h.result(60) for h in handles]
            assert all(r.replay is not None and not r.replay.build.deterministic for r in batched)
            under_load = [await hf.replay(r, p) for r, p in zip(batched, loaded, strict=True)]
            for o in under_load:
                assert o.matched or (
                    o.differs == ("deterministic",) and (o.first_token, o.first_logprob) != (None, None)
                )
            exact, tokens = sum(o.matched for o in under_load), sum(o.first_token is None for o in under_load)
            print(f"hf under load, replayed alone: {exact}/6 bit-exact, {tokens}/6 same tokens")

            # -- a coordinate altered: another seed, another version digest, another engine build.
            altered_seed = msgspec.structs.replace(coord, sampling=msgspec.structs.replace(coord.sampling, seed=12345))
            o = await hf.replay(original, unseeded, coordinate=altered_seed)
            assert not o.matched and "seed" in o.differs and o.first_token is not None, o
            altered_digest = msgspec.structs.replace(
                coord, versions=(msgspec.structs.replace(coord.versions[0], digest=b"\0" * 8),)
            )
            o = await hf.replay(original, unseeded, coordinate=altered_digest)
            assert not o.matched and o.differs == ("version_digest",) and o.first_token is None, o
            altered_build = msgspec.structs.replace(coord, build=msgspec.structs.replace(coord.build, version="0.0.1"))
            o = await hf.replay(original, unseeded, coordinate=altered_build)
            assert not o.matched and o.differs == ("engine_build",), o
            # A store re-created with other weights under the same version number.
            PolicyPublisher(other_store, build_model_dir(tmp_path / "other", preset="tiny", seed=1)).record_base()
            o = await hf.replay(original, unseeded, store=other_store)
            assert not o.matched and o.differs == ("version_digest",) and o.first_token is None, o
            # The prompt must be the one the coordinate digests.
            try:
                await hf.replay(original, msgspec.structs.replace(unseeded, prompt_token_ids=PROMPT[:-1]))
                raise AssertionError("a replay of another prompt was asked")
            except NotReplayable as err:
                assert err.reason == "prompt"

            # -- echo: trivially deterministic; an unseeded sample needs no seed.
            plain = RolloutPayload(prompt_token_ids=PROMPT, sampling=SamplingParams(max_tokens=16), n=3)
            said = await (await echo.submit(plain, exact_version=0)).result(30)
            assert said.replay is not None and said.replay.build.engine == "echo" and said.replay.build.deterministic
            assert said.replay.sampling.seed is None and said.replay.versions[0].digest == b""  # (no store)
            echoed = [await echo.replay(said, plain, index=i) for i in range(3)]
            assert all(o.matched for o in echoed), echoed
            # A stream offset asked of an engine that cannot advance its streams: refused, typed.
            offset = msgspec.structs.replace(plain, sampling=SamplingParams(max_tokens=16, seed=3), stream_offset=2)
            try:
                await (await echo.submit(offset, exact_version=0)).result(30)
                raise AssertionError("echo took a stream offset it cannot honour")
            except NotReplayable as err:
                assert "stream_offset" in str(err) and not err.retryable
    finally:
        stop_all(procs)
