"""An SGLang server restarted under an attached sglang engine never serves with a wrong label.

The server is the keyed stand-in (``harness.sglang_keyed``): its tokens are a function
of the tensor bytes it loaded, so each answer is checked token by token against the trainer's own
tensors at the version the answer is labelled with (``reliability.adversary.truth``'s key, computed here
from the tensors, never from the server or the checkpoint). A real process, SIGKILLed and started
again on its launch checkpoint, as its supervisor would (a few seconds).
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from harness import wait_until
from harness.weights import write_base_checkpoint
from reliability.adversary.trainer_weights import TrainerWeights
from reliability.adversary.truth import tensors_key
from rollfleet.policy_store import materialize
from rollfleet.schemas import RolloutPayload, SamplingParams
from rollfleet.schemas.errors import EngineFailure
from rollfleet.trainer_client import PolicyPublisher
from rollfleet.workers.engines.keyed import VOCAB, keyed_tokens
from rollfleet.workers.engines.server_process import free_port
from rollfleet.workers.engines.sglang import SGLangEngine

PROMPT = [5, 17, 301, 9]


def _payload() -> RolloutPayload:
    return RolloutPayload(prompt_token_ids=PROMPT, sampling=SamplingParams(max_tokens=6, seed=11))


async def _answers(url: str) -> bool:
    try:
        async with httpx.AsyncClient() as http:
            return (await http.get(f"{url}/health", timeout=2.0)).status_code == 200
    except httpx.HTTPError:
        return False


async def test_a_restarted_server_never_serves_a_newer_materialized_version_under_the_live_label(
    tmp_path: Path,
) -> None:
    """The worker materializes the next version into its checkpoint directory while it serves
    (prepare), so after an activation that failed (here: the server refused the pause) that
    directory holds version 2 while the server's live version is 1. Then the server dies and comes
    back on its launch checkpoint. Reloading "the live version" from that directory would serve
    version 2's weights labelled 1: every answer must be what its label's weights make, and the
    engine serves again once version 2 is activated."""
    base, store, local = tmp_path / "base", tmp_path / "store", tmp_path / "local"
    write_base_checkpoint(base)
    weights = TrainerWeights(base, seed=3)
    publisher = PolicyPublisher(store, base, keyframe_every=6, keep_last=None)
    for v in range(3):
        publisher.publish(weights.at(v))
    key = {v: tensors_key(weights.at(v)) for v in range(3)}
    assert len(set(key.values())) == 3
    await asyncio.to_thread(materialize, local, store, 1)

    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    launch = [sys.executable, "-m", "harness.sglang_keyed", "--model-path", str(base), "--port", str(port)]
    server = subprocess.Popen(launch)
    eng = SGLangEngine(url=url, startup_timeout_s=30, control_timeout_s=10)

    async def checked(what: str) -> int | None:
        """One answer (None when refused): every token is what its label's weights make."""
        try:
            gen = await eng.generate(what, _payload())
        except EngineFailure:
            return None
        out = gen.outputs[0]
        assert [s.version for s in out.weight_versions] == [gen.version_end], out.weight_versions
        want = keyed_tokens(key[gen.version_end], PROMPT, 6, seed=11, sample=0, vocab=VOCAB)
        assert out.token_ids == want, f"{what}: tokens labelled v{gen.version_end} are not v{gen.version_end}'s"
        return gen.version_end

    try:
        await eng.start(local, 1)  # attached: the server holds the base, so the engine loads v1
        assert await checked("at start") == 1
        # The next version is prepared into the same directory; its activation is refused.
        await asyncio.to_thread(materialize, local, store, 2)
        async with httpx.AsyncClient() as http:
            await http.post(f"{url}/_fault/pause_error", json={"for_s": 60.0})
        with pytest.raises(EngineFailure, match="pause_generation"):
            await eng.pause()
        assert await checked("activation refused") == 1  # still v1's weights, in the server's memory
        # The server dies; its supervisor starts it again on its launch checkpoint (the base).
        server.send_signal(signal.SIGKILL)
        server.wait(10)
        server = subprocess.Popen(launch)
        await wait_until(lambda: _answers(url), timeout=20, what="the restarted server")
        for i in range(12):  # health looks (the worker's, every 2 s) and requests, for a few seconds
            await eng.health()
            await checked(f"after the restart #{i}")
            await asyncio.sleep(0.25)
        # The version sync tries version 2 again: activated, the engine serves it.
        await eng.pause()
        try:
            await eng.load_weights(local, [], 2)
        finally:
            await eng.resume()

        async def healthy() -> bool:
            return (await eng.health()).ok

        await wait_until(healthy, timeout=10, what="the engine back")
        assert await checked("after the activation") == 2
    finally:
        await eng.close()
        server.kill()
        server.wait(10)


def test_a_directory_is_reloaded_as_the_live_version_only_while_its_marker_is_unchanged() -> None:
    from rollfleet.workers.engines.server_restart import reload_refusal

    assert reload_refusal(3, 3) is None and reload_refusal(None, None) is None  # (a plain checkpoint dir)
    assert reload_refusal(3, 4) == "now holds version 4"
    assert "rewritten" in str(reload_refusal(3, None))  # mid-materialize: its marker removed
    assert reload_refusal(None, 2) is not None  # a version materialized into it since


def test_the_keyed_standin_makes_the_keyed_echo_engines_tokens() -> None:
    from harness.sglang_keyed import stream_of
    from rollfleet.workers.engines.base import sample_seed
    from rollfleet.workers.engines.keyed import keyed_token

    key, ctx = bytes(32), bytes(16)
    for seed in (None, 0, 7):
        for i in range(3):
            params = {} if seed is None else {"sampling_seed": sample_seed(seed, i)}  # what the adapter sends
            s, sample = stream_of(params, i)
            for first in (True, False):
                mine = keyed_token(key, ctx, seed=s, sample=sample, first=first, vocab=VOCAB)
                assert mine == keyed_token(key, ctx, seed=seed, sample=i, first=first, vocab=VOCAB)


async def test_an_engine_attached_to_a_server_refusing_pauses_for_a_while_starts_once_it_takes_them(
    tmp_path: Path,
) -> None:
    """A worker restarted while its server answers ``/pause_generation`` with an error (a transient
    fault) used to fail its engine's start and exit, again and again; it starts once the server
    takes pauses again, and serves the version it loaded."""
    base, store, local = tmp_path / "base", tmp_path / "store", tmp_path / "local"
    write_base_checkpoint(base)
    weights = TrainerWeights(base, seed=3)
    publisher = PolicyPublisher(store, base, keyframe_every=6, keep_last=None)
    for v in range(2):
        publisher.publish(weights.at(v))
    await asyncio.to_thread(materialize, local, store, 1)
    port = free_port("127.0.0.1")
    url = f"http://127.0.0.1:{port}"
    launch = [sys.executable, "-m", "harness.sglang_keyed", "--model-path", str(base), "--port", str(port)]
    server = subprocess.Popen(launch)
    eng = SGLangEngine(url=url, startup_timeout_s=30, control_timeout_s=10)
    try:
        await wait_until(lambda: _answers(url), timeout=20, what="the server")
        async with httpx.AsyncClient() as http:
            await http.post(f"{url}/_fault/pause_error", json={"for_s": 1.5})
        await eng.start(local, 1)
        gen = await eng.generate("started", _payload())
        assert gen.version_end == 1
        assert gen.outputs[0].token_ids == keyed_tokens(tensors_key(weights.at(1)), PROMPT, 6, seed=11, sample=0,
                                                        vocab=VOCAB)  # fmt: skip
    finally:
        await eng.close()
        server.kill()
        server.wait(10)
