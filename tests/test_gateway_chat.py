"""The gateway's chat route and SGLang's batches: a conversation becomes the prompt that
``transformers``' own ``apply_chat_template`` makes from the model's tokenizer files (tool calls
and tool results included), asked through the official ``openai`` client; a batch of inputs to
``/generate`` is answered input by input, and a keyed batch retried runs once."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from sglang_contract import api_types

from harness import ProcessGroup, running_worker, wait_until, write_base_checkpoint
from harness.processes import rollfleet_command
from harness.weights import tensors_at
from reliability.adversary.truth import recompute, tensors_key
from rollfleet.broker import free_port
from rollfleet.gateway import protocol
from rollfleet.gateway.chat import ChatTemplate, ChatTemplateError
from rollfleet.schemas import AskedConstraint, coordinate_wire
from rollfleet.schemas.errors import InvalidRequest
from rollfleet.trainer_client import PolicyPublisher, RolloutClient
from tests.helpers import CountingEcho, stored_results
from tests.test_gateway import gateway

TEMPLATE = Path(__file__).parent / "fixtures" / "chatml_tools.jinja"

_ADD_ARGS = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}
TOOLS = [{"type": "function", "function": {"name": "add", "description": "Add <two> numbers", "parameters": _ADD_ARGS}}]
CONVERSATION: list[dict[str, Any]] = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "What is 2+2? ü"},
    {"role": "assistant", "content": None, "reasoning_content": "add them",
     "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 2}'}}]},
    {"role": "tool", "tool_call_id": "c1", "content": "4"},
    {"role": "user", "content": [{"type": "text", "text": "And "}, {"type": "text", "text": "3+3?"}]},
]  # fmt: skip


@pytest.fixture(scope="module")
def hf_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A tokenizer saved by ``transformers`` itself, with the test's chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({"<unk>": 0, "<s>": 1, "</s>": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")
    fast.chat_template = TEMPLATE.read_text()
    path = tmp_path_factory.mktemp("tokenizer")
    fast.save_pretrained(str(path))
    fast.saved_to = path
    return fast


def test_a_conversation_renders_as_transformers_renders_it(hf_tokenizer: Any, tmp_path: Path) -> None:
    """The same text as ``apply_chat_template`` for every shape of conversation: tools, a tool
    call and its result, reasoning, text parts, template kwargs; from ``chat_template.jinja`` (as
    transformers saves it now) and from ``tokenizer_config.json``'s ``chat_template`` (older)."""
    embedded = tmp_path / "embedded"
    shutil.copytree(hf_tokenizer.saved_to, embedded)
    (embedded / "chat_template.jinja").unlink()
    config = json.loads((embedded / "tokenizer_config.json").read_text())
    config["chat_template"] = TEMPLATE.read_text()
    (embedded / "tokenizer_config.json").write_text(json.dumps(config))
    cases: list[dict[str, Any]] = [
        {"messages": CONVERSATION, "tools": TOOLS},
        {"messages": CONVERSATION[1:2]},
        {"messages": CONVERSATION[:2], "kwargs": {"enable_thinking": False}},
        {"messages": CONVERSATION[:3], "add_generation_prompt": False},
    ]
    for path in (hf_tokenizer.saved_to, embedded):
        ours = ChatTemplate.from_dir(path)
        assert ours.special["bos_token"] == "<s>"
        for case in cases:
            want = hf_tokenizer.apply_chat_template(
                case["messages"], tools=case.get("tools"), tokenize=False,
                add_generation_prompt=case.get("add_generation_prompt", True), **case.get("kwargs", {}),
            )  # fmt: skip
            got = ours.render(case["messages"], tools=case.get("tools"),
                              add_generation_prompt=case.get("add_generation_prompt", True),
                              kwargs=case.get("kwargs"))  # fmt: skip
            assert got == want, case


def test_bad_chat_requests_are_typed_errors(hf_tokenizer: Any, tmp_path: Path) -> None:
    template = ChatTemplate.from_dir(hf_tokenizer.saved_to)

    def parse(body: Any, t: ChatTemplate | None = template) -> Any:
        return protocol.parse_chat(body, key_header=None, default_max_staleness=None, template=t)

    req = parse({"messages": CONVERSATION, "tools": TOOLS, "max_completion_tokens": 5, "logprobs": True, "n": 2,
                 "weight_version": {"exact_version": 3}, "stop": [],
                 "skip_special_tokens": False})  # fmt: skip
    assert req.route == "chat" and req.logprobs and req.payload.n == 2 and req.payload.sampling.max_tokens == 5
    assert req.payload.prompt_text is not None and req.payload.prompt_text.endswith("<|im_start|>assistant\n")
    assert req.constraint == AskedConstraint("exact", 3)
    assert req.payload.extra == {"sampling_params": {"skip_special_tokens": False}}
    with pytest.raises(InvalidRequest, match="--tokenizer"):
        parse({"messages": CONVERSATION}, None)
    bad_bodies: list[Any] = [
        {"messages": []},
        {"messages": "hi"},
        {"messages": [{"role": "wizard", "content": "x"}]},
        {"messages": [{"role": "user", "content": 3}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}]},
        {"messages": [{"role": "user", "content": "x"}], "tools": "add"},
        {"messages": [{"role": "user", "content": "x"}], "chat_template_kwargs": {"messages": []}},
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
        {"messages": [{"role": "user", "content": "x"}], "logprobs": 1},
        {"messages": [{"role": "user", "content": "x"}], "stop": ["\n"]},  # (no engine is told stop strings)
    ]
    for body in bad_bodies:
        with pytest.raises(InvalidRequest):
            parse(body)
    # The template's own refusal (raise_exception) is a typed 400, naming what it said.
    with pytest.raises(ChatTemplateError, match="system message must come first"):
        parse({"messages": [{"role": "user", "content": "x"}, {"role": "system", "content": "late"}]})
    assert protocol.error_reply(ChatTemplateError("x")).status == 400
    # A directory without a template says so when the gateway starts.
    (tmp_path / "tokenizer_config.json").write_text("{}")
    with pytest.raises(ChatTemplateError, match="no chat template"):
        ChatTemplate.from_dir(tmp_path)


def test_a_batch_of_inputs_becomes_one_request_an_input_with_its_own_key() -> None:
    body = {"text": ["a", "bb"], "sampling_params": [{"max_new_tokens": 2}, {"max_new_tokens": 3, "n": 2}],
            "rid": ["r0", "r1"]}  # fmt: skip
    api_types().GenerateRequest.from_json_value(body)  # a batch SGLang itself accepts
    reqs = protocol.parse_generate(body, key_header=None, default_max_staleness=None)
    assert isinstance(reqs, list) and [r.payload.prompt_text for r in reqs] == ["a", "bb"]
    assert [r.payload.sampling.max_tokens for r in reqs] == [2, 3] and reqs[1].payload.n == 2
    assert [r.idempotency_key for r in reqs] == ["r0", "r1"]
    ids = protocol.parse_generate({"input_ids": [[1], [2, 3]]}, key_header="k", default_max_staleness=None)
    assert isinstance(ids, list) and [r.idempotency_key for r in ids] == ["k/0", "k/1"]
    for bad in (
        {"text": []},
        {"text": ["a", 3]},
        {"text": ["a"] * (protocol.MAX_BATCH + 1)},
        {"text": ["a", "b"], "sampling_params": [{}]},
        {"text": ["a", "b"], "rid": "one"},
        {"text": ["a", "b"], "rid": ["x", "x"]},
        {"text": ["a", "b"], "stream": True},
        {"text": "a", "sampling_params": [{}]},
    ):
        with pytest.raises(InvalidRequest):
            protocol.parse_generate(bad, key_header=None, default_max_staleness=None)


async def test_the_openai_client_chats_through_the_models_template(
    nats_url: str, namespace: str, hf_tokenizer: Any
) -> None:
    """Chat, non-stream and stream, with logprobs and a constraint, through the official client.
    The fleet saw exactly transformers' rendering: the echo engine's tokens are a function of the
    prompt's bytes, recomputed here from ``apply_chat_template``'s text."""
    engine = CountingEcho(per_token_s=0.001)
    want = hf_tokenizer.apply_chat_template(CONVERSATION, tools=TOOLS, tokenize=False, add_generation_prompt=True)
    prompt = list(want.encode())
    async with (
        running_worker(nats_url, namespace, engine=engine),
        gateway(nats_url, namespace, chat_template=ChatTemplate.from_dir(hf_tokenizer.saved_to)) as base,
    ):
        oa = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        done = await oa.chat.completions.create(
            model="rollfleet", messages=CONVERSATION, tools=TOOLS, max_tokens=5, logprobs=True,  # type: ignore[arg-type]
            extra_body={"weight_version": {"min_required_version": 0}},
        )  # fmt: skip
        choice = done.choices[0]
        ids = (choice.model_extra or {})["token_ids"]
        assert ids == [(sum(prompt) + i) % engine.vocab for i in range(5)]  # the fleet's prompt was `want`
        assert done.usage is not None and done.usage.prompt_tokens == len(prompt)
        assert choice.message.role == "assistant" and choice.message.content == engine.detokenize(ids)
        assert choice.logprobs is not None and [c.token for c in choice.logprobs.content or []] == [str(t) for t in ids]
        assert (done.model_extra or {})["weight_version_end"] == 0 and choice.finish_reason == "length"
        facts = (choice.model_extra or {})["rollfleet"]
        (stored,) = await stored_results(nats_url, namespace, "gw", facts["idempotency_key"])
        assert stored.replay is not None and facts["replay"] == coordinate_wire(stored.replay, 0)
        chunks = [c async for c in await oa.chat.completions.create(
            model="rollfleet", messages=CONVERSATION[:2], max_tokens=4, stream=True, logprobs=True)]  # fmt: skip
        streamed = [t for c in chunks for ch in c.choices for t in (ch.model_extra or {}).get("token_ids", [])]
        short = list(hf_tokenizer.apply_chat_template(CONVERSATION[:2], tokenize=False,
                                                      add_generation_prompt=True).encode())  # fmt: skip
        assert streamed == [(sum(short) + i) % engine.vocab for i in range(4)]
        last = chunks[-1].choices[0]
        assert last.finish_reason == "length" and last.delta.content == engine.detokenize(streamed)
        # The template's refusal reaches the client as a 400 naming it; nothing ran.
        calls = len(engine.calls)
        with pytest.raises(openai.BadRequestError, match="system message must come first"):
            await oa.chat.completions.create(model="rollfleet", max_tokens=2, messages=[
                {"role": "user", "content": "x"}, {"role": "system", "content": "late"}])  # fmt: skip
        assert len(engine.calls) == calls


async def test_a_chat_session_stays_on_one_replica(nats_url: str, namespace: str, hf_tokenizer: Any) -> None:
    """An agent's conversation (``X-Session-Id`` through the openai client) on two replicas: each
    turn goes to the replica holding the context, streamed or not (a streamed turn comes whole:
    its tokens, then its text), and every turn's tokens are the echo of the rendered context."""
    template = ChatTemplate.from_dir(hf_tokenizer.saved_to)
    engines = {"a": CountingEcho(per_token_s=0.001), "b": CountingEcho(per_token_s=0.001)}
    async with (
        running_worker(nats_url, namespace, worker_id="a", engine=engines["a"]),
        running_worker(nats_url, namespace, worker_id="b", engine=engines["b"]),
        gateway(nats_url, namespace, chat_template=template) as base,
    ):
        oa = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0)
        messages: list[dict[str, Any]] = [{"role": "user", "content": "hello"}]
        served = []
        for turn in range(6):
            prompt = hf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True).encode()
            want = [(sum(prompt) + i) % engines["a"].vocab for i in range(3)]
            session = {"X-Session-Id": "agent-1"}
            if turn % 2:
                chunks = [c async for c in await oa.chat.completions.create(
                    model="rollfleet", messages=messages, max_tokens=3, stream=True,  # type: ignore[arg-type]
                    extra_headers=session)]  # fmt: skip
                ids = [t for c in chunks for ch in c.choices for t in (ch.model_extra or {}).get("token_ids", [])]
                content = chunks[-1].choices[0].delta.content
                replica = (chunks[-1].choices[0].model_extra or {})["rollfleet"]["replica"]
            else:
                done = await oa.chat.completions.create(model="rollfleet", messages=messages, max_tokens=3,  # type: ignore[arg-type]
                                                        extra_headers=session)  # fmt: skip
                ids = (done.choices[0].model_extra or {})["token_ids"]
                content = done.choices[0].message.content
                replica = (done.choices[0].model_extra or {})["rollfleet"]["replica"]
            assert ids == want and content == engines["a"].detokenize(want), (turn, ids)
            served.append(replica)
            messages += [{"role": "assistant", "content": content}, {"role": "user", "content": f"go on {turn}"}]
        assert len(set(served)) == 1, served


async def test_a_batch_is_answered_input_by_input_and_a_keyed_retry_runs_once(nats_url: str, namespace: str) -> None:
    engine = CountingEcho(per_token_s=0.001)
    body = {"input_ids": [[1, 2], [3, 4, 5]], "sampling_params": {"max_new_tokens": 3, "n": 2},
            "return_logprob": True}  # fmt: skip
    async with (
        running_worker(nats_url, namespace, engine=engine),
        gateway(nats_url, namespace) as base,
        httpx.AsyncClient(base_url=base, timeout=30) as http,
    ):
        first = await http.post("/generate", json=body, headers={"Idempotency-Key": "b-1"})
        assert first.status_code == 200, first.text
        items = first.json()
        assert len(items) == 4  # 2 inputs x 2 samples, input by input
        for i, prompt in enumerate(([1, 2], [3, 4, 5])):
            for sample in range(2):
                item = items[2 * i + sample]
                assert item["output_ids"] == [(sum(prompt) + sample + t) % engine.vocab for t in range(3)]
                assert item["meta_info"]["rollfleet"]["idempotency_key"] == f"b-1/{i}"
        again = await http.post("/generate", json=body, headers={"Idempotency-Key": "b-1"})
        assert again.json() == items and len(engine.calls) == 2  # two jobs, each run once
        # One input the fleet cannot serve fails the batch with its typed error.
        bad = await http.post("/generate", json={"text": ["a", "b"], "weight_version": {"exact_version": 7}})
        assert bad.status_code == 409 and bad.json()["error"]["code"] == "no_compatible_replica"
        await wait_until(lambda: engine.running == 0, timeout=5, what="nothing left running")
        await asyncio.sleep(0)


def readme_http_section() -> tuple[str, str, str]:
    """The HTTP endpoint guide's gateway command line, its curl line and its Python snippet."""
    guide = (Path(__file__).resolve().parents[1] / "docs" / "http-endpoint.md").read_text()
    section = guide.split("# From any trainer: the HTTP endpoint\n", 1)[1].split("\n## ", 1)[0]
    bash = re.search(r"```bash\n(.*?)```", section, re.DOTALL).group(1)  # type: ignore[union-attr]
    lines = [line for line in bash.replace("\\\n", " ").splitlines() if line and not line.startswith("#")]
    command = next(line for line in lines if line.startswith("rollfleet gateway"))
    curl = "\n".join(lines[lines.index(command) + 1 :])
    python = re.search(r"```python\n(.*?)```", section, re.DOTALL).group(1)  # type: ignore[union-attr]
    return command, curl, python


async def test_the_readmes_http_lines_work_as_written(
    nats_url: str, namespace: str, hf_tokenizer: Any, tmp_path: Path
) -> None:
    """The HTTP endpoint guide's gateway command (its broker address, namespace and port swapped for this
    test's; ``--tokenizer`` added for its chat line), its curl line as curl sends it, and its
    Python snippet, verbatim but for the port, against a real echo worker."""
    command, curl, python = readme_http_section()
    port = free_port()
    argv = shlex.split(command.rstrip("& "))
    assert argv[:2] == ["rollfleet", "gateway"] and "nats://127.0.0.1:4222" in argv and "8000" in argv
    swap = {"nats://127.0.0.1:4222": nats_url, "default": namespace, "8000": str(port)}
    procs = ProcessGroup(tmp_path)
    try:
        procs.worker(nats_url, namespace, "w")
        procs.spawn("gw", rollfleet_command(*[swap.get(a, a) for a in argv[1:]], "--tokenizer",
                                            str(hf_tokenizer.saved_to)))  # fmt: skip
        async with httpx.AsyncClient(timeout=30) as http:

            async def ready() -> bool:
                with contextlib.suppress(httpx.HTTPError):
                    return (await http.get(f"http://127.0.0.1:{port}/health")).json()["replicas"] == 1
                return False

            await wait_until(ready, timeout=60, what="the gateway and its worker")
            # curl -s URL -H 'K: V' -d DATA: a POST of DATA (form content type), as curl sends it.
            words = shlex.split(curl)
            assert words[:2] == ["curl", "-s"]
            url = words[2].replace("localhost:8000", f"127.0.0.1:{port}")
            options = dict(zip(words[3::2], words[4::2], strict=True))
            assert set(options) == {"-H", "-d"}, words
            name, value = options["-H"].split(": ", 1)
            headers, data = {name: value}, options["-d"]
            sent = await http.post(f"http://{url}", content=data.encode(), headers={
                **headers, "Content-Type": "application/x-www-form-urlencoded"})  # fmt: skip
        assert sent.status_code == 200, sent.text
        assert len(sent.json()["meta_info"]["output_token_logprobs"]) == 8
        env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])}
        script = tmp_path / "snippet.py"
        script.write_text(python.replace("127.0.0.1:8000", f"127.0.0.1:{port}") + "\nprint(len(tokens), spans)\n")
        run = await asyncio.to_thread(subprocess.run, [sys.executable, str(script)], capture_output=True, text=True,
                                      env=env, timeout=120)  # fmt: skip
        assert run.returncode == 0, run.stderr[-3000:]
        assert run.stdout.startswith("8 [[0, 0, 8, "), run.stdout
    finally:
        procs.close()


async def test_an_activation_during_a_stream_shows_in_its_spans_and_its_tokens(
    nats_url: str, namespace: str, tmp_path: Path
) -> None:
    """A stream through the gateway on a keyed replica (its tokens a function of the weight bytes
    it loaded) while the trainer commits version 1: the answer's spans name both versions, the
    streamed tokens are the answer's, and every token recomputes from the trainer's own bytes of
    the version its span names (a wrong label would show in the tokens)."""
    publisher = PolicyPublisher(tmp_path / "store", write_base_checkpoint(tmp_path / "base"), keep_last=None)
    body = {"input_ids": [4, 5, 6], "sampling_params": {"max_new_tokens": 60}, "stream": True}
    engine = CountingEcho(per_token_s=0.03, keyed=True)
    async with await RolloutClient.connect(nats_url, namespace=namespace, client_id="t") as trainer:
        await trainer.publish_policy(publisher, tensors_at(0))
        async with (
            running_worker(nats_url, namespace, engine=engine, worker_id="a", store_dir=tmp_path / "store",
                           local_dir=tmp_path / "local-a"),  # fmt: skip
            gateway(nats_url, namespace) as base,
            httpx.AsyncClient(base_url=base, timeout=60) as http,
        ):
            await trainer.wait_for_version(0, replicas=1, timeout=30)
            events: list[Any] = []

            async def read() -> None:
                async with http.stream("POST", "/generate", json=body) as r:
                    assert r.status_code == 200
                    async for line in r.aiter_lines():
                        if line == "data: [DONE]":
                            return
                        if line.startswith("data: "):
                            events.append(json.loads(line[6:]))

            reading = asyncio.create_task(read())
            await wait_until(lambda: engine.running == 1, timeout=10, what="the streamed job running")
            await trainer.publish_policy(publisher, tensors_at(1))  # while it generates
            await asyncio.wait_for(reading, 30)
    final = events[-1]
    spans = [(v, s, e) for v, s, e, _replica in final["meta_info"]["rollfleet"]["weight_versions"]]
    assert {v for v, _, _ in spans} == {0, 1}, spans
    streamed = [t for ev in events[:-1] for t in ev.get("output_ids", [])]
    assert streamed in ([], final["output_ids"])  # deltas, if any came, add up to the answer
    verdict = recompute(lambda v: tensors_key(tensors_at(v)), body["input_ids"], [final["output_ids"]], [spans],
                        seed=None)  # fmt: skip
    assert verdict.checked == 60 and not verdict.mismatches, verdict.mismatches
