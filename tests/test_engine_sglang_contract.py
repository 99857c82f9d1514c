"""Contract tests: the sglang adapter against a stand-in that speaks SGLang 0.5.23's HTTP contract.

SGLang cannot run here; these tests pin the adapter's exact requests (paths, JSON bodies, order)
and its reading of SGLang's answers. Every body the adapter sends is checked against SGLang's own
types from the installed package (``GenerateRequest.from_json_value`` for ``/generate``,
io_struct's request classes for the control routes), and the stand-in's answers are built with
SGLang's ``GenerateResponse``/``GenerateMetaInfo``.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest
from sglang_contract import api_types, check_request
from sglang_standin import SGLangStandin

from rollfleet.schemas import RolloutPayload, SamplingParams, VersionSpan
from rollfleet.schemas.errors import EngineFailure, InvalidRequest
from rollfleet.workers.engines import make_engine
from rollfleet.workers.engines.server_gate import gate_decision
from rollfleet.workers.engines.server_restart import restart_suspected
from rollfleet.workers.engines.sglang import SGLangEngine
from rollfleet.workers.engines.sglang_protocol import parse_item

pytestmark = pytest.mark.contract

PROMPT = [3, 4, 5]


CONTROL_TYPES = {
    "/pause_generation": "PauseGenerationReqInput",
    "/continue_generation": "ContinueGenerationReqInput",
    "/update_weights_from_disk": "UpdateWeightFromDiskReqInput",
    "/pull_weights": "PullWeightsReqInput",
    "/abort_request": "AbortReq",
    "/close_session": "CloseSessionReqInput",
}


def check_against_sglang(standin: SGLangStandin) -> None:
    """Every body the adapter sent fits SGLang's own request types."""
    for call in standin.state.calls:
        if call.path == "/generate":
            api_types().GenerateRequest.from_json_value(call.body)
        elif call.path in CONTROL_TYPES:
            check_request(CONTROL_TYPES[call.path], call.body)
        elif call.path == "/flush_cache":
            assert call.body is None  # SGLang takes a query parameter, not a body
        else:
            assert call.method == "GET" and call.body is None, call
    assert standin.state.contract_errors == []


@pytest.fixture
def standin() -> Iterator[SGLangStandin]:
    with SGLangStandin(weight_version="0") as s:
        yield s
        check_against_sglang(s)


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
                "sampling_seed": gen.seed,  # drawn for an unseeded sampled request, and recorded
            },
            "return_logprob": True,
            "stream": False,
            "cache_salt": "rollfleet-v0",  # the radix cache never matches KV of other weights
        }
    ]
    assert isinstance(gen.seed, int)
    out = gen.outputs[0]
    # the stand-in's (sum(prompt) + i + seed * 7919) % vocab
    assert out.token_ids == [(12 + i + gen.seed * 7919) % 1000 for i in range(6)]
    assert out.logprobs == [-0.5] * 6 and out.finish_reason == "length"
    assert (gen.version_start, gen.version_end, gen.prompt_tokens) == (0, 0, 3)


class KeepAliveCloser:
    """A loopback proxy in front of a keep-alive server that closes a connection, unanswered, when
    a second request arrives on it: what uvicorn does when its keep-alive timer fires as a request
    comes in (the timer fires late when the server's loop was held, by a reload, say)."""

    def __init__(self, upstream: str) -> None:
        host, port = upstream.removeprefix("http://").split(":")
        self._upstream = (host, int(port))
        self.connections = 0
        self.closed_on_reuse = 0
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> KeepAliveCloser:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def _serve(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        self.connections += 1
        ur, uw = await asyncio.open_connection(*self._upstream)
        answered = False

        async def down() -> None:
            nonlocal answered
            while data := await ur.read(65536):
                answered = True
                cw.write(data)
                await cw.drain()

        relay = asyncio.ensure_future(down())
        try:
            while data := await cr.read(65536):
                if answered:  # a second request on this connection: closed unanswered
                    self.closed_on_reuse += 1
                    break
                uw.write(data)
                await uw.drain()
        finally:
            relay.cancel()
            for w in (cw, uw):
                w.close()


async def test_a_connection_the_server_closes_on_reuse_fails_no_request() -> None:
    """Each request goes on a fresh connection: a kept-alive one that the server closes as the next
    request arrives (vLLM's uvicorn after a long reload) failed that request with ReadError."""
    with SGLangStandin(weight_version="0", keep_alive=True) as standin:
        async with KeepAliveCloser(standin.url) as proxy:
            eng = SGLangEngine(url=proxy.url)
            await eng.start(None, 0)
            try:
                for i in range(4):
                    gen = await eng.generate(f"req-{i}", payload(max_tokens=3, temperature=0.0))
                    assert gen.outputs[0].token_ids == [12, 13, 14]
                    assert (await eng.health()).ok
            finally:
                await eng.close()
            assert proxy.closed_on_reuse == 0 and proxy.connections >= 8


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
    gen = await engine.generate("s", payload(max_tokens=20, stop_token_ids=[14], logprobs=False, temperature=0.0))
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
    assert (gen.version_start, gen.version_end) == (0, 1)  # read back from meta_info.weight_versions
    out = gen.outputs[0]
    assert len(out.token_ids) == 150 and out.finish_reason == "length"
    # Which tokens came from which version: SGLang's spans, with integer versions.
    [before, after] = out.weight_versions
    assert before == VersionSpan(version=0, start=0, end=before.end) and 0 < before.end < 150
    assert after == VersionSpan(version=1, start=before.end, end=150)
    control = [c for c in standin.state.calls if c.path != "/generate"]
    assert [(c.method, c.path) for c in control] == [
        ("POST", "/pause_generation"),
        ("POST", "/update_weights_from_disk"),
        ("POST", "/flush_cache"),
        ("GET", "/model_info"),
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


def test_the_gate_waits_during_an_activation_and_refuses_a_server_left_paused_outside_one() -> None:
    assert gate_decision(activating=False, server_paused=False) == ("send", None)
    assert gate_decision(activating=True, server_paused=True) == ("wait", None)
    verdict, problem = gate_decision(activating=False, server_paused=True)
    assert verdict == "refuse" and problem is not None and "paused" in problem


async def test_a_refused_pause_reopens_the_gate_and_the_server_keeps_serving(
    engine: SGLangEngine, standin: SGLangStandin
) -> None:
    """Item 6 of issue 30: a /pause_generation answered with an error once must not leave the gate
    closed (version sync calls no resume after a pause that raised)."""
    standin.state.fail_next_pause = "scheduler busy"
    with pytest.raises(EngineFailure, match="scheduler busy"):
        await engine.pause()
    gen = await asyncio.wait_for(engine.generate("after", payload(max_tokens=3)), 5)
    assert len(gen.outputs[0].token_ids) == 3
    assert (await engine.health()).ok and standin.state.paused is None
    # The next activation goes through as usual.
    await engine.pause()
    await engine.resume()
    assert (await asyncio.wait_for(engine.generate("next", payload(max_tokens=1)), 5)).outputs[0].token_ids


async def test_a_failed_continue_is_not_healthy_until_the_server_continues(
    engine: SGLangEngine, standin: SGLangStandin
) -> None:
    """A server still paused after the activation would hold every request forever. The activation
    itself stands (its weights are live: resume does not raise, so it is announced), but health
    says the server is paused, a request is refused at once (the job goes elsewhere), and each
    health look or request asks the server to continue again."""
    await engine.pause()
    await engine.load_weights(Path("/ckpt/v1"), [], 1)
    standin.state.fail_next_continue = "tokenizer manager gone"
    await engine.resume()
    assert standin.state.paused == "in_place" and engine.version == 1
    standin.state.fail_next_continue = "still gone"
    with pytest.raises(EngineFailure, match="paused"):
        await asyncio.wait_for(engine.generate("held", payload(max_tokens=1)), 5)
    standin.state.fail_next_continue = "gone for good?"
    health = await engine.health()
    assert not health.ok and "paused" in health.detail
    assert (await engine.health()).ok and standin.state.paused is None  # asked again: it continued
    gen = await asyncio.wait_for(engine.generate("ok", payload(max_tokens=2)), 5)
    assert gen.version_end == 1 and gen.outputs[0].token_ids


async def test_a_request_held_at_the_gate_can_be_aborted_there(engine: SGLangEngine, standin: SGLangStandin) -> None:
    """An activation's drain aborts the exact jobs it gave up on; one still waiting at the gate
    must return (aborted, never sent), or the drain waits for it forever."""
    await engine.pause()
    try:
        task = asyncio.create_task(engine.generate("held", payload(max_tokens=3)))
        await asyncio.sleep(0.05)
        assert not task.done()
        await engine.abort("held")
        gen = await asyncio.wait_for(task, 5)
        assert [o.finish_reason for o in gen.outputs] == ["abort"] and gen.outputs[0].token_ids == []
        assert "/generate" not in standin.state.paths()
    finally:
        await engine.resume()


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


def test_a_server_reporting_another_label_than_the_one_set_is_suspected_restarted() -> None:
    assert not restart_suspected(3, "3") and not restart_suspected(3, 3)
    assert restart_suspected(3, "default") and restart_suspected(3, None) and restart_suspected(3, "2")


async def test_an_attached_server_restarted_on_its_launch_checkpoint_is_reloaded_before_serving(
    tmp_path: Path,
) -> None:
    """Issue 30, item 2: the attached server is SIGKILLed and restarted on its launch checkpoint
    (label ``default``). The adapter must not take it back as the version it activated: tokens it
    labels ``default`` are refused (never relabelled with the adapter's version), the engine is
    down while it reloads the live version's directory, and it serves that version again after."""
    import signal
    import subprocess

    import httpx

    from harness import wait_until
    from rollfleet.workers.engines.server_process import free_port

    script = Path(__file__).with_name("sglang_standin.py")
    port = free_port("127.0.0.1")
    launch = [sys.executable, str(script), "--model-path", str(tmp_path / "launch"), "--port", str(port)]

    async def model_info() -> dict:
        async with httpx.AsyncClient() as http:
            return (await http.get(f"http://127.0.0.1:{port}/model_info")).json()  # type: ignore[no-any-return]

    async def answers() -> bool:
        try:
            return bool(await model_info())
        except httpx.HTTPError:
            return False

    server = subprocess.Popen(launch)
    eng = SGLangEngine(url=f"http://127.0.0.1:{port}", startup_timeout_s=30)
    try:
        await eng.start(tmp_path / "v0", 0)
        await eng.pause()
        await eng.load_weights(tmp_path / "v1", [], 1)
        await eng.resume()
        assert (await model_info())["weight_version"] == "1" and (await eng.health()).ok
        server.send_signal(signal.SIGKILL)
        server.wait(10)
        server = subprocess.Popen(launch)  # back on its launch checkpoint, as vLLM or SGLang would be
        await wait_until(answers, timeout=20)
        assert (await model_info())["weight_version"] == "default"
        with pytest.raises(EngineFailure, match="default"):
            await eng.generate("after-restart", payload(max_tokens=2))
        health = await eng.health()
        assert not health.ok or (await model_info())["weight_version"] == "1"

        async def healthy() -> bool:
            return (await eng.health()).ok

        await wait_until(healthy, timeout=20)
        info = await model_info()
        assert info["weight_version"] == "1" and info["model_path"] == str(tmp_path / "v1")
        gen = await eng.generate("reloaded", payload(max_tokens=2))
        assert gen.version_end == 1 and [s.version for s in gen.outputs[0].weight_versions] == [1]
        # Again, and this time a health look (the worker's, every health_s) is the first to see it.
        server.send_signal(signal.SIGKILL)
        server.wait(10)
        server = subprocess.Popen(launch)
        await wait_until(answers, timeout=20)
        await wait_until(healthy, timeout=20)
        assert (await model_info())["weight_version"] == "1"
    finally:
        await eng.close()
        server.kill()
        server.wait(10)


def test_parsing_tolerates_older_response_shapes() -> None:
    item = {"meta_info": {"finish_reason": "length", "output_token_logprobs": [[-0.1, 7, None], [-0.2, 8, "x"]]}}
    completion, version, prompt_tokens = parse_item(item, True, False)
    assert completion.token_ids == [7, 8] and completion.logprobs == [-0.1, -0.2]
    assert completion.finish_reason == "length" and version is None and prompt_tokens == 0
    aborted, _, _ = parse_item({"output_ids": [1], "meta_info": {"finish_reason": None}}, False, False)
    assert aborted.finish_reason == "abort" and aborted.logprobs is None


def meta(**fields: object) -> dict:
    """A /generate answer built with SGLang's own response types."""
    t = api_types()
    info = t.GenerateMetaInfo(finish_reason=t.FinishLength(length=3), **fields)
    return t.GenerateResponse(text="", output_ids=[7, 8, 9], meta_info=info).to_json_value()


def spans(*triples: tuple[str, int, int]) -> list:
    return [api_types().WeightVersionSpan(version=v, start=a, end=b) for v, a, b in triples]


def test_weight_version_spans_become_integer_spans() -> None:
    item = meta(weight_version="5", weight_versions=spans(("4", 0, 1), ("5", 1, 3)))
    completion, version, _ = parse_item(item, False, False)
    assert completion.weight_versions == [
        VersionSpan(version=4, start=0, end=1),
        VersionSpan(version=5, start=1, end=3),
    ]
    assert version == 5


@pytest.mark.parametrize(
    "bad",
    [
        spans(("default", 0, 3)),  # SGLang's version before any update: not a rollfleet version
        spans(("4", 0, 1), ("v5", 1, 3)),
        spans(("-1", 0, 3)),
        spans(("4", 0, 2)),  # does not cover the three tokens
        spans(("4", 1, 3)),  # does not start at 0
        spans(("4", 0, 2), ("5", 1, 3)),  # overlapping
    ],
)
def test_spans_that_are_not_rollfleet_versions_or_do_not_tile_the_tokens_are_unknown(bad: list) -> None:
    completion, _, _ = parse_item(meta(weight_versions=bad), False, False)
    assert completion.weight_versions == [] and completion.token_ids == [7, 8, 9]


async def test_a_server_at_a_non_integer_version_yields_unknown_spans_and_the_adapters_version(
    standin: SGLangStandin,
) -> None:
    eng = SGLangEngine(url=standin.url)
    await eng.start(None, 3)  # no checkpoint: the server keeps its weights and its "default" label
    standin.state.weight_version = "default"
    try:
        gen = await eng.generate("d", payload(max_tokens=4))
    finally:
        await eng.close()
    assert gen.outputs[0].weight_versions == [] and (gen.version_start, gen.version_end) == (3, 3)


async def test_an_extra_sampling_param_sglang_does_not_know_is_refused_by_its_contract(
    engine: SGLangEngine, standin: SGLangStandin
) -> None:
    p = payload(max_tokens=2)
    p.extra = {"sampling_params": {"no_such_param": 1}}
    with pytest.raises(InvalidRequest, match="no_such_param"):
        await engine.generate("x", p)
    assert standin.state.contract_errors and "no_such_param" in standin.state.contract_errors[0]
    standin.state.contract_errors.clear()  # the refusal was the point
    standin.state.calls.clear()


def test_the_contract_checks_can_fail() -> None:
    """The checks above are not vacuous: SGLang's types refuse what they should."""
    with pytest.raises(AssertionError, match="requires"):
        check_request("UpdateWeightFromDiskReqInput", {"weight_version": "1"})
    with pytest.raises(AssertionError, match="no fields"):
        check_request("PauseGenerationReqInput", {"mode": "in_place", "flush": True})
    with pytest.raises(AssertionError, match="mode"):
        check_request("PauseGenerationReqInput", {"mode": "sideways"})
    with pytest.raises(AssertionError, match="target_version"):
        check_request("PullWeightsReqInput", {"local_checkpoint_dir": "/a", "source_dir": "/b", "target_version": "7"})
    with pytest.raises(api_types().JsonContractError):
        api_types().GenerateRequest.from_json_value({"input_ids": [1], "sampling_params": {"max_new_tokens": "8"}})
    with pytest.raises(api_types().JsonContractError):
        api_types().GenerateRequest.from_json_value({"input_ids": [1], "session_id": 7})
    with pytest.raises(AssertionError, match="requires"):
        check_request("CloseSessionReqInput", {})


# -- sessions: SGLang's radix-native session hints, and a prefix cache salted by version -----------


def turn_payload(prompt: list[int], max_tokens: int = 5, n: int = 1) -> RolloutPayload:
    return RolloutPayload(prompt_token_ids=prompt, sampling=SamplingParams(max_tokens=max_tokens), n=n)


async def test_session_turns_carry_the_session_hints_and_report_sglangs_cached_tokens(
    engine: SGLangEngine, standin: SGLangStandin
) -> None:
    first = await engine.generate("t1", turn_payload(PROMPT), session_id="sess-1")
    assert (first.cached_tokens, first.cache_rebuilt) == (0, False)
    context = PROMPT + first.outputs[0].token_ids + [7, 8, 9]  # the tool's answer follows the output
    second = await engine.generate("t2", turn_payload(context), session_id="sess-1")
    # The server held the first turn's prompt and output but its last token (never fed back).
    assert second.cached_tokens == len(PROMPT) + len(first.outputs[0].token_ids) - 1
    assert second.cache_rebuilt is False
    plain = await engine.generate("p", turn_payload(PROMPT))
    assert plain.cached_tokens == len(PROMPT) - 1  # the radix cache matches by content, session or not
    bodies = standin.state.bodies("/generate")
    for body in bodies[:2]:
        assert body["session_id"] == body["routing_key"] == "sess-1" and "session_params" not in body
        # The keys are the ones SGLang reads (its GenerateRequest ignores unknown keys).
        decoded = api_types().GenerateRequest.from_json_value(body)
        assert (decoded.session_id, decoded.routing_key, decoded.cache_salt) == ("sess-1", "sess-1", "rollfleet-v0")
        assert decoded.session_params is None  # the prompt is the whole context: nothing to rebuild
    assert "session_id" not in bodies[2] and "routing_key" not in bodies[2]


async def test_after_an_activation_the_next_turn_is_rebuilt_even_when_the_flush_was_refused(
    engine: SGLangEngine, standin: SGLangStandin, tmp_path: Path
) -> None:
    first = await engine.generate("t1", turn_payload(PROMPT), session_id="s")
    context = PROMPT + first.outputs[0].token_ids
    busy = asyncio.create_task(engine.generate("busy", payload(max_tokens=150)))
    await wait_running(standin)
    await engine.pause()
    await engine.load_weights(tmp_path, ["lm_head.weight"], 1)
    await engine.resume()
    assert engine.last_flush_ok is False  # the old prefixes are still in the server's cache...
    grown = [*context, 11]  # the tool's answer
    second = await engine.generate("t2", turn_payload(grown), session_id="s")
    # ... but under the old version's salt: nothing computed with v0 is reused for v1.
    assert standin.state.bodies("/generate")[-1]["cache_salt"] == "rollfleet-v1"
    assert (second.cached_tokens, second.cache_rebuilt) == (0, True)
    third = await engine.generate("t3", turn_payload([*grown, *second.outputs[0].token_ids]), session_id="s")
    assert third.cached_tokens == len(grown) + len(second.outputs[0].token_ids) - 1
    assert third.cache_rebuilt is False
    retry = await engine.generate("t2-again", turn_payload(grown, n=2), session_id="s")  # n samples: one figure
    assert retry.cached_tokens == len(grown) - 1 and retry.cache_rebuilt is False
    assert (await busy).outputs[0].finish_reason == "length"


async def test_without_the_version_salt_nothing_is_claimed_rebuilt(standin: SGLangStandin, tmp_path: Path) -> None:
    engine = SGLangEngine(url=standin.url, version_cache_salt=False)
    await engine.start(None, 0)
    try:
        first = await engine.generate("t1", turn_payload(PROMPT), session_id="s")
        await engine.pause()
        await engine.load_weights(tmp_path, [], 1)
        await engine.resume()
        second = await engine.generate("t2", turn_payload(PROMPT + first.outputs[0].token_ids), session_id="s")
        assert "cache_salt" not in standin.state.bodies("/generate")[-1]
        assert second.cache_rebuilt is False  # the adapter cannot know what the server reused
    finally:
        await engine.close()


async def test_end_session_closes_it_on_the_server(engine: SGLangEngine, standin: SGLangStandin) -> None:
    await engine.generate("t1", turn_payload(PROMPT), session_id="s")
    await engine.end_session("s")
    assert standin.state.bodies("/close_session") == [{"session_id": "s"}]
    assert standin.state.closed_sessions == ["s"]
    # Forgotten here too: a later turn under the same id is a first turn, not a rebuilt one.
    await engine.pause()
    await engine.load_weights(Path("/unused"), [], 1)
    await engine.resume()
    again = await engine.generate("t2", turn_payload(PROMPT), session_id="s")
    assert again.cache_rebuilt is False
    await engine.close()
    await engine.end_session("s")  # closed: nothing sent, no error
    assert len(standin.state.bodies("/close_session")) == 1


# -- activation through SGLang's own /pull_weights -----------------------------------------------


@pytest.fixture
def store(tmp_path: Path) -> Path:
    for v in (0, 1, 2):
        (tmp_path / "store" / f"weight_v{v:06d}").mkdir(parents=True)
    return tmp_path / "store"


async def test_pull_weights_prepares_while_serving_and_the_activation_reloads_the_pulled_dir(
    standin: SGLangStandin, store: Path, tmp_path: Path
) -> None:
    eng = SGLangEngine(url=standin.url, pull_dir=tmp_path / "pulled", store_dir=store)
    await eng.start(None, 0)
    standin.state.calls.clear()
    try:
        task = asyncio.create_task(eng.generate("busy", payload(max_tokens=100)))
        await wait_running(standin)
        await eng.prepare_weights(tmp_path / "unused", ["w"], 2)  # the server pulls; generation goes on
        assert standin.state.running and standin.state.weight_version == "0"
        await eng.pause()
        await eng.load_weights(tmp_path / "unused", ["w"], 2)
        await eng.resume()
        gen = await asyncio.wait_for(task, 10)
    finally:
        await eng.close()
    assert [c.path for c in standin.state.calls if c.path != "/generate"][:3] == [
        "/pull_weights",
        "/pause_generation",
        "/update_weights_from_disk",
    ]
    assert standin.state.bodies("/pull_weights") == [
        {"local_checkpoint_dir": str(tmp_path / "pulled"), "source_dir": str(store), "target_version": 2}
    ]
    assert standin.state.bodies("/update_weights_from_disk")[0]["model_path"] == str(tmp_path / "pulled")
    assert eng.version == 2 and (gen.version_start, gen.version_end) == (0, 2)


async def test_a_refused_or_missing_pull_keeps_the_served_version(
    standin: SGLangStandin, store: Path, tmp_path: Path
) -> None:
    eng = SGLangEngine(url=standin.url, pull_dir=tmp_path / "pulled", store_dir=store)
    await eng.start(None, 0)
    try:
        standin.state.fail_next_pull = "checksum mismatch for 1 tensors"
        with pytest.raises(EngineFailure, match="checksum mismatch"):
            await eng.prepare_weights(None, [], 1)
        with pytest.raises(EngineFailure, match="missing"):
            await eng.prepare_weights(None, [], 9)  # not in the store
        await eng.pause()
        with pytest.raises(EngineFailure, match="was not pulled"):
            await eng.load_weights(None, [], 1)
        await eng.resume()
        assert eng.version == 0 and await eng.served_version() == 0
        assert "/update_weights_from_disk" not in standin.state.paths()
    finally:
        await eng.close()


async def test_a_launched_server_starts_on_the_stores_version_zero_and_pulls_the_current_one(
    store: Path, tmp_path: Path
) -> None:
    standin_script = Path(__file__).with_name("sglang_standin.py")
    eng = SGLangEngine(
        launch_cmd=[sys.executable, str(standin_script)],
        pull_dir=tmp_path / "pulled",
        store_dir=store,
        log_file=tmp_path / "server.log",
        startup_timeout_s=30,
    )
    await eng.start(tmp_path / "rollfleet-local", 2)
    try:
        assert eng.process is not None and await eng.served_version() == 2
        info = (await eng._http.get("/model_info")).json()
        assert info["model_path"] == str(tmp_path / "pulled")  # reloaded from what the server pulled
        cmdline = Path(f"/proc/{eng.process.pid}/cmdline").read_bytes().split(b"\0")
        assert cmdline[cmdline.index(b"--model-path") + 1] == str(store / "weight_v000000").encode()
    finally:
        await eng.close()


async def test_without_pull_weights_route_the_error_says_so(
    standin: SGLangStandin, store: Path, tmp_path: Path
) -> None:
    from sglang_standin import _ROUTES

    route = _ROUTES.pop(("POST", "/pull_weights"))
    eng = SGLangEngine(url=standin.url, pull_dir=tmp_path / "pulled", store_dir=store)
    try:
        await eng.start(None, 0)
        with pytest.raises(EngineFailure, match="no /pull_weights"):
            await eng.prepare_weights(None, [], 1)
    finally:
        _ROUTES[("POST", "/pull_weights")] = route
        await eng.close()


# -- resumable jobs ---------------------------------------------------------------------------------


async def test_a_resumable_job_runs_in_segments_and_continues_another_runs_tokens(
    standin: SGLangStandin, nats_url: str, namespace: str, tmp_path: Path
) -> None:
    """SGLang answers whole requests, so a resumable job runs in segments of ``checkpoint_tokens``:
    each a /generate whose input_ids are the prompt plus every token so far (SGLang's radix cache
    holds that prefix: the stand-in reports it cached), each checkpointed. A job another run had
    checkpointed 8 tokens of (that run died) starts from them. Every body fits SGLang's types."""
    import signal

    from harness import running_worker, start_worker_process, terminate, wait_until
    from rollfleet.broker.topology import TopologyConfig
    from rollfleet.schemas import encode
    from rollfleet.schemas.progress import MAC_HEADER, SampleDelta, TokensRecord, record_mac
    from rollfleet.schemas.seeds import job_seed
    from rollfleet.trainer_client import RolloutClient

    topology = TopologyConfig(ack_wait_s=1.0)  # the frozen replica may have pulled the job: redelivered soon
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c", topology=topology) as client:
        # A frozen replica lets the job be stored without running; the dead run's record goes in.
        frozen = start_worker_process(
            nats_url, namespace, "frozen", "--ack-wait", "1.0", log_path=tmp_path / "frozen.log"
        )
        try:
            # Ready, not only registered: a replica still starting serves nothing (fail fast).
            await wait_until(lambda: [r.state for r in client.fleet.replicas()] == ["ready"], timeout=20)
            frozen.send_signal(signal.SIGSTOP)
            handle = await client.submit(payload(max_tokens=40), min_version=0, retry_policy="resume", timeout=60)
        finally:
            terminate(frozen, 10.0, signal.SIGKILL)
        dead = SampleDelta(
            index=0,
            start=0,
            token_ids=[900 + i for i in range(8)],
            logprobs=[-0.25] * 8,
            spans=[VersionSpan(version=0, start=0, end=8, replica="dead")],
        )
        data = encode(TokensRecord(run="dead:1", samples=[dead]))
        subject = client.names.progress_subject("c", handle.job_id)
        await client.js.publish(subject, data, headers={MAC_HEADER: record_mac(handle.job_id, data)})
        engine = SGLangEngine(url=standin.url)
        async with running_worker(
            nats_url, namespace, engine=engine, worker_id="sgl", checkpoint_tokens=8, topology=topology
        ):
            result = await handle.result(30)
    out = result.outputs[0]
    bodies = standin.state.bodies("/generate")
    assert len(bodies) == 4  # 32 tokens left, 8 per segment
    made = list(dead.token_ids)
    # The job gave no seed: every segment, of this run or any other, draws the job's one stream,
    # and the answer's replay coordinate names it (a seed drawn per request would name none).
    stream = job_seed(handle.job_id)
    for body in bodies:
        assert body["input_ids"] == PROMPT + made and body["sampling_params"]["max_new_tokens"] == 8
        assert body["sampling_params"]["sampling_seed"] == stream
        made += [(sum(body["input_ids"]) + i + stream * 7919) % standin.state.vocab for i in range(8)]
    assert out.token_ids == made and len(out.token_ids) == 40 and out.finish_reason == "length"
    assert result.replay is not None and result.replay.sampling.seed == stream
    assert out.logprobs[:8] == [-0.25] * 8 and result.kept_tokens == 8 and result.engine == "sglang"
    assert [(s.replica, s.start, s.end) for s in out.weight_versions] == [("dead", 0, 8), ("sgl", 8, 40)]


async def test_a_seeded_resumable_job_in_segments_returns_samples_that_are_not_copies(
    standin: SGLangStandin, nats_url: str, namespace: str
) -> None:
    """Issue 30, item 4: a resumable job on SGLang runs each sample alone, in segments; sample i must
    draw its own stream (``sampling_seed`` 7 + i, as in one /generate of n), not sample 0's."""
    from harness import running_worker
    from rollfleet.trainer_client import RolloutClient

    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
        engine = SGLangEngine(url=standin.url)
        async with running_worker(nats_url, namespace, engine=engine, worker_id="sgl", checkpoint_tokens=4):
            job = payload(max_tokens=8, n=4, seed=7, temperature=1.0)
            result = await (await client.submit(job, min_version=0, retry_policy="resume", timeout=30)).result(30)
    seqs = [o.token_ids for o in result.outputs]
    assert len({tuple(s) for s in seqs}) == 4, seqs
    vocab = standin.state.vocab
    for i, seq in enumerate(seqs):  # the first segment is the stand-in's stream for seed 7 + i
        assert seq[:4] == [(sum(PROMPT) + j + (7 + i) * 7919) % vocab for j in range(4)]
    seeds = sorted(b["sampling_params"]["sampling_seed"] for b in standin.state.bodies("/generate"))
    assert seeds == [7, 7, 8, 8, 9, 9, 10, 10]  # two segments of each sample


async def test_a_worker_whose_server_fails_a_pause_or_a_continue_keeps_serving_and_announces_what_is_live(
    standin: SGLangStandin, nats_url: str, namespace: str, tmp_path: Path
) -> None:
    """Issue 30, item 6 through a worker: a /pause_generation answered with an error fails that
    activation (still at version 0) and jobs are served as before. A /continue_generation that
    fails after a successful reload does not leave the registry at the old version: version 2 is
    live, announced, and served once a health look got the server going again."""
    from harness import running_worker, tensors_at, wait_until, write_base_checkpoint
    from rollfleet.trainer_client import PolicyPublisher, RolloutClient

    publisher = PolicyPublisher(tmp_path / "store", write_base_checkpoint(tmp_path / "base"), keep_last=None)
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="c") as client:
        await client.publish_policy(publisher, tensors_at(0))
        async with running_worker(
            nats_url, namespace, engine=SGLangEngine(url=standin.url), worker_id="sgl", store_dir=tmp_path / "store",
            local_dir=tmp_path / "local", health_s=0.2,
        ) as worker:  # fmt: skip
            await client.wait_for_version(0, replicas=1, timeout=30)
            assert worker.sync is not None
            standin.state.fail_next_pause = "scheduler busy"
            await client.publish_policy(publisher, tensors_at(1))
            await wait_until(lambda: worker.sync is not None and worker.sync.failures, timeout=20)
            assert "scheduler busy" in worker.sync.failures[-1]
            served = await (await client.submit(payload(max_tokens=2), min_version=0, timeout=10)).result(10)
            assert served.version_end == 0
            standin.state.fail_next_continue = "tokenizer manager gone"
            await client.publish_policy(publisher, tensors_at(2))
            await client.wait_for_version(2, replicas=1, timeout=30)
            result = await (await client.submit(payload(max_tokens=2), exact_version=2, timeout=20)).result(20)
            assert result.version_start == result.version_end == 2 and standin.state.paused is None


# -- deterministic inference --------------------------------------------------------------------


async def test_deterministic_inference_is_launched_read_from_the_server_and_unseeded_samples_stay_distinct(
    tmp_path: Path, standin: SGLangStandin
) -> None:
    """``deterministic`` launches SGLang with ``--enable-deterministic-inference``; whether a
    server runs it is read from its own ``/server_info``. Under it SGLang seeds every unseeded
    request with 42, so the adapter draws each request's seed itself and records it: ``n``
    unseeded samples are ``n`` streams, not one sample ``n`` times."""
    standin_script = Path(__file__).with_name("sglang_standin.py")
    eng = SGLangEngine(
        launch_cmd=[sys.executable, str(standin_script)], deterministic=True, startup_timeout_s=30,
        log_file=tmp_path / "server.log",
    )  # fmt: skip
    await eng.start(tmp_path / "ckpt", 0)
    try:
        # (the stand-in says so only where it was launched with the flag)
        assert eng.process is not None and eng.server_info["enable_deterministic_inference"] is True
        unseeded = payload(max_tokens=4, n=4)
        assert eng.deterministic_for(unseeded)
        gen = await eng.generate("d", unseeded)
        assert isinstance(gen.seed, int)
        assert len({tuple(o.token_ids) for o in gen.outputs}) == 4  # four streams, seed + 0..3
        again = await eng.generate("d2", payload(max_tokens=4, n=4, seed=gen.seed))
        assert [o.token_ids for o in again.outputs] == [o.token_ids for o in gen.outputs]  # drawn again
        build = eng.build(True)
        assert (build.engine, build.version, build.dtype, build.device) == ("sglang", "0.5.23", "bfloat16", "cuda")
    finally:
        await eng.close()
    # A server started without it (attached: it runs as it was started) is said not to be.
    attached = SGLangEngine(url=standin.url, deterministic=True)
    await attached.start(None, 0)
    try:
        assert not attached.deterministic_for(payload(max_tokens=4))
        assert attached.server_info["enable_deterministic_inference"] is False
    finally:
        await attached.close()


def test_an_abort_after_the_last_token_ends_nothing() -> None:
    """A request the adapter aborted (an activation) that had made every token asked for is
    whole: SGLang's own reason stands, and an ``abort`` with all tokens made is ``length``
    (campaign 7, seed 4242: a rollout loop trained a sample of 45 of 45 tokens labelled abort).
    One aborted short of its tokens is ``abort``, whatever SGLang said. The vLLM adapter's
    parser follows the same rule (``server_protocol.finish_reason``)."""
    from rollfleet.workers.engines.vllm_protocol import parse_choices

    def vllm(reason: str, made: int, aborted: bool, max_tokens: int) -> str:
        answer = {"choices": [{"index": 0, "token_ids": list(range(made)), "finish_reason": reason}]}
        return parse_choices(answer, False, aborted, max_tokens)[0].finish_reason

    assert vllm("length", 3, True, 3) == "length" and vllm("abort", 3, False, 3) == "length"
    assert vllm("length", 3, True, 4) == "abort" and vllm("abort", 2, False, 5) == "abort"
    done = {"output_ids": [7, 8, 9], "meta_info": {"finish_reason": {"type": "length", "length": 3}}}
    assert parse_item(done, False, True, max_tokens=3)[0].finish_reason == "length"
    said_abort = {"output_ids": [7, 8, 9], "meta_info": {"finish_reason": {"type": "abort"}}}
    assert parse_item(said_abort, False, True, max_tokens=3)[0].finish_reason == "length"
    assert parse_item(said_abort, False, False, max_tokens=3)[0].finish_reason == "length"
    assert parse_item(done, False, True, max_tokens=4)[0].finish_reason == "abort"
    assert parse_item(said_abort, False, False, max_tokens=5)[0].finish_reason == "abort"
