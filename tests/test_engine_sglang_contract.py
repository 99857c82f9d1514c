"""Contract tests: the sglang adapter against a stand-in that follows SGLang's documented HTTP shapes.

SGLang cannot run here; these tests pin the adapter's exact requests (paths, JSON bodies, order)
and its reading of SGLang's answers, not SGLang itself.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from sglang_standin import SGLangStandin

from rollfleet.schemas import RolloutPayload, SamplingParams
from rollfleet.schemas.errors import EngineFailure, InvalidRequest
from rollfleet.workers.engines import make_engine
from rollfleet.workers.engines.sglang import SGLangEngine

pytestmark = pytest.mark.contract

PROMPT = [3, 4, 5]


@pytest.fixture
def standin() -> Iterator[SGLangStandin]:
    with SGLangStandin(weight_version="0") as s:
        yield s


@pytest.fixture
async def engine(standin: SGLangStandin) -> AsyncIterator[SGLangEngine]:
    eng = SGLangEngine(url=standin.url)
    await eng.start(None, 0)
    standin.state.calls.clear()
    try:
        yield eng
    finally:
        await eng.close()


def payload(max_tokens: int = 8, n: int = 1, **sampling: object) -> RolloutPayload:
    return RolloutPayload(
        prompt_token_ids=list(PROMPT),
        sampling=SamplingParams(max_tokens=max_tokens, **sampling),  # type: ignore[arg-type]
        n=n,
    )


async def wait_running(standin: SGLangStandin, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not standin.state.running:  # noqa: ASYNC110 - state lives in the stand-in's threads
            await asyncio.sleep(0.005)


async def test_generate_sends_sglang_request_and_reads_output(engine: SGLangEngine, standin: SGLangStandin) -> None:
    gen = await engine.generate("req-1", payload(max_tokens=6, temperature=0.5, top_p=0.9, stop_token_ids=[999]))
    assert standin.state.bodies("/generate") == [
        {
            "rid": "req-1",
            "input_ids": PROMPT,
            "sampling_params": {
                "max_new_tokens": 6,
                "temperature": 0.5,
                "top_p": 0.9,
                "top_k": -1,
                "stop_token_ids": [999],
            },
            "return_logprob": True,
            "stream": False,
        }
    ]
    out = gen.outputs[0]
    assert out.token_ids == [12, 13, 14, 15, 16, 17]  # the stand-in's (sum(prompt) + i) % vocab
    assert out.logprobs == [-0.5] * 6 and out.finish_reason == "length"
    assert (gen.version_start, gen.version_end, gen.prompt_tokens) == (0, 0, 3)


async def test_n_samples_go_as_a_batch_with_one_rid_and_seed_each(engine: SGLangEngine, standin: SGLangStandin) -> None:
    gen = await engine.generate(
        "r", RolloutPayload(prompt_token_ids=PROMPT, n=3, sampling=SamplingParams(max_tokens=2, seed=10, top_k=5))
    )
    (body,) = standin.state.bodies("/generate")
    assert body["rid"] == ["r-0", "r-1", "r-2"]
    assert body["input_ids"] == [PROMPT] * 3
    assert [p["sampling_seed"] for p in body["sampling_params"]] == [10, 11, 12]
    assert all(p["top_k"] == 5 for p in body["sampling_params"])
    assert len(gen.outputs) == 3 and all(len(o.token_ids) == 2 for o in gen.outputs)


async def test_stop_token_and_logprobs_off(engine: SGLangEngine, standin: SGLangStandin) -> None:
    gen = await engine.generate("s", payload(max_tokens=20, stop_token_ids=[14], logprobs=False))
    out = gen.outputs[0]
    assert out.token_ids == [12, 13, 14] and out.finish_reason == "stop" and out.logprobs is None
    assert standin.state.bodies("/generate")[0]["return_logprob"] is False


async def test_extra_sampling_params_pass_through(engine: SGLangEngine, standin: SGLangStandin) -> None:
    p = payload(max_tokens=2)
    p.extra = {"ignore_eos": True, "sampling_params": {"min_new_tokens": 2}}
    await engine.generate("x", p)
    params = standin.state.bodies("/generate")[0]["sampling_params"]
    assert params["ignore_eos"] is True and params["min_new_tokens"] == 2


async def test_activation_pauses_in_place_updates_with_version_and_continues(
    engine: SGLangEngine, standin: SGLangStandin, tmp_path: Path
) -> None:
    task = asyncio.create_task(engine.generate("long", payload(max_tokens=150)))
    await wait_running(standin)
    await engine.pause()
    await engine.load_weights(tmp_path, ["model.layers.0.mlp.up_proj.weight"], 1)
    assert engine.version == 1
    await engine.resume()
    gen = await asyncio.wait_for(task, 10)
    assert (gen.version_start, gen.version_end) == (0, 1)  # read back from meta_info.weight_version
    assert len(gen.outputs[0].token_ids) == 150 and gen.outputs[0].finish_reason == "length"
    control = [c for c in standin.state.calls if c.path != "/generate"]
    assert [(c.method, c.path) for c in control] == [
        ("POST", "/pause_generation"),
        ("POST", "/update_weights_from_disk"),
        ("POST", "/flush_cache"),
        ("GET", "/get_model_info"),
        ("POST", "/continue_generation"),
    ]
    assert control[0].body == {"mode": "in_place"}
    assert control[1].body == {"model_path": str(tmp_path), "weight_version": "1", "flush_cache": False}
    assert engine.last_flush_ok is False  # refused while the in-place batch holds a request: tolerated


async def test_requests_wait_while_paused_and_start_on_the_new_version(
    engine: SGLangEngine, standin: SGLangStandin, tmp_path: Path
) -> None:
    await engine.pause()
    task = asyncio.create_task(engine.generate("late", payload(max_tokens=3)))
    await asyncio.sleep(0.1)
    assert "/generate" not in standin.state.paths() and not task.done()
    await engine.load_weights(tmp_path, [], 2)
    assert engine.last_flush_ok is True  # nothing running: the flush went through
    await engine.resume()
    gen = await asyncio.wait_for(task, 5)
    assert (gen.version_start, gen.version_end) == (2, 2)


async def test_refused_update_keeps_the_served_version(
    engine: SGLangEngine, standin: SGLangStandin, tmp_path: Path
) -> None:
    standin.state.fail_next_update = "Failed to get weights iterator: no such file"
    await engine.pause()
    with pytest.raises(EngineFailure, match="no such file"):
        await engine.load_weights(tmp_path, [], 1)
    await engine.resume()
    assert engine.version == 0 and await engine.served_version() == 0
    assert (await engine.generate("ok", payload(max_tokens=1))).version_end == 0


async def test_update_reporting_another_version_fails(engine: SGLangEngine, standin: SGLangStandin) -> None:
    original = standin.state.weight_version

    async def lying_update() -> None:
        await engine.pause()
        try:
            await engine.load_weights(Path("/nonexistent"), [], 7)
        finally:
            await engine.resume()

    # A server that ignores weight_version (an older SGLang) would keep reporting the old one.
    standin.state.fail_next_update = None
    real = engine._http.post

    async def drop_version(path: str, **kw: object):  # type: ignore[no-untyped-def]
        if path == "/update_weights_from_disk":
            kw["json"] = {k: v for k, v in kw["json"].items() if k != "weight_version"}  # type: ignore[union-attr]
        return await real(path, **kw)  # type: ignore[arg-type]

    engine._http.post = drop_version  # type: ignore[method-assign]
    with pytest.raises(EngineFailure, match="serves weight_version 0 after loading 7"):
        await lying_update()
    assert engine.version == 0 and standin.state.weight_version == original


async def test_abort_sends_abort_request_and_reports_abort(engine: SGLangEngine, standin: SGLangStandin) -> None:
    task = asyncio.create_task(engine.generate("doomed", payload(max_tokens=2000)))
    await wait_running(standin)
    await engine.abort("doomed")
    gen = await asyncio.wait_for(task, 5)
    assert gen.outputs[0].finish_reason == "abort" and len(gen.outputs[0].token_ids) < 2000
    assert standin.state.bodies("/abort_request") == [{"rid": "doomed"}]
    await engine.abort("never-sent")  # unknown ids are a no-op
    assert len(standin.state.bodies("/abort_request")) == 1


async def test_rejected_request_is_invalid(engine: SGLangEngine) -> None:
    with pytest.raises(InvalidRequest, match="input_ids"):
        await engine.generate("t", RolloutPayload(prompt_text="hello"))


async def test_health_follows_the_server(engine: SGLangEngine, standin: SGLangStandin) -> None:
    assert (await engine.health()).ok
    standin.state.healthy = False
    health = await engine.health()
    assert not health.ok and "503" in health.detail
    await engine.close()
    assert not (await engine.health()).ok


async def test_attach_to_a_server_with_other_weights_loads_the_checkpoint(
    standin: SGLangStandin, tmp_path: Path
) -> None:
    standin.state.weight_version = "default"
    eng = make_engine("sglang", url=standin.url)
    try:
        await eng.start(tmp_path, 4)
        assert eng.version == 4 and standin.state.weight_version == "4"
        assert standin.state.model_path == str(tmp_path)
        assert standin.state.paths()[-1] == "/continue_generation"
    finally:
        await eng.close()


async def test_launches_a_server_and_stops_it_on_close(tmp_path: Path) -> None:
    standin_script = Path(__file__).with_name("sglang_standin.py")
    eng = SGLangEngine(
        launch_cmd=[sys.executable, str(standin_script)],
        launch_args=["--tp-size", "1"],
        log_file=tmp_path / "server.log",
        startup_timeout_s=30,
    )
    await eng.start(tmp_path / "ckpt", 5)
    try:
        assert eng.process is not None and eng.url is not None
        assert await eng.served_version() == 5  # passed as --weight-version at launch
        gen = await eng.generate("a", payload(max_tokens=2))
        assert gen.version_end == 5 and len(gen.outputs[0].token_ids) == 2
    finally:
        await eng.close()
    assert eng.process.returncode is not None


def test_parsing_tolerates_older_response_shapes() -> None:
    item = {"meta_info": {"finish_reason": "length", "output_token_logprobs": [[-0.1, 7, None], [-0.2, 8, "x"]]}}
    completion, version, prompt_tokens = SGLangEngine._parse_item(item, True, False)
    assert completion.token_ids == [7, 8] and completion.logprobs == [-0.1, -0.2]
    assert completion.finish_reason == "length" and version is None and prompt_tokens == 0
    aborted, _, _ = SGLangEngine._parse_item({"output_ids": [1], "meta_info": {"finish_reason": None}}, False, False)
    assert aborted.finish_reason == "abort" and aborted.logprobs is None
