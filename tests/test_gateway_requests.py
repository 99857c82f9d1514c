"""The gateway's decisions as pure functions, in milliseconds: what becomes of a request at each
door (``RequestState``: the client leaving, the status, the metrics label), and what of a
request is honoured (``protocol``: every field read, passed, a hint, or refused naming it;
headers, keys, the model). The tables are checked against contracts nobody here wrote: SGLang's
own ``GenerateRequest`` and ``SamplingParams``, and the official ``openai`` client's parameters."""

from __future__ import annotations

import json
import typing
from typing import Any

import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sglang_contract import api_types

from rollfleet.gateway import protocol
from rollfleet.gateway.request_state import (
    CLIENT_CLOSED,
    CancelJob,
    EndStream,
    OpenStream,
    RequestState,
    RequestStateError,
    Respond,
    on_leaving,
)
from rollfleet.schemas import AskedConstraint, bounded_json
from rollfleet.schemas.errors import AuthorizationError, Cancelled, InvalidRequest, NoCompatibleReplica, SessionConflict

# -- RequestState: every door, every promise ---------------------------------------------------

DOORS = {  # door -> (stream, number of jobs)
    "plain": (False, 1),
    "stream": (True, 1),
    "batch": (False, 3),
    "turn": (False, 1),
    "turn-stream": (True, 1),
}


def state(door: str, keyed: bool) -> RequestState:
    stream, jobs = DOORS[door]
    keys = tuple(f"k/{i}" if keyed else None for i in range(jobs))
    return RequestState(door.split("-")[0] if door != "stream" else "plain", stream=stream, keys=keys)  # type: ignore[arg-type]


def test_a_job_whose_client_left_runs_on_only_under_the_clients_key() -> None:
    assert on_leaving(None) == "cancel" and on_leaving("k") == "run_on"


@pytest.mark.parametrize("door", list(DOORS))
@pytest.mark.parametrize("keyed", [False, True], ids=["keyless", "keyed"])
@pytest.mark.parametrize("when", ["storing", "waiting", "after_storing_started"])
def test_a_client_that_leaves_cancels_exactly_its_keyless_jobs_at_every_door(door: str, keyed: bool, when: str) -> None:
    """Wherever the client leaves (before any job is stored, with some stored and one still being
    stored, once all are stored and waiting or streaming), each of its keyless jobs is cancelled
    once, as soon as its handle is held; a keyed one never; the label is 499."""
    s = state(door, keyed)
    jobs = len(s.keys)
    cancelled: list[int] = []
    if when == "waiting":
        for i in range(jobs):
            assert s.job_stored(i) == []
        opened = s.all_stored()
        assert opened == ([OpenStream()] if door == "stream" else [])
    elif when == "after_storing_started":
        for i in range(jobs - 1):
            s.job_stored(i)
    left = s.client_left()
    cancelled += [a.index for a in left if isinstance(a, CancelJob)]
    assert all(isinstance(a, CancelJob) for a in left)
    for i in range(jobs):  # (the jobs still being stored when the client left are stored now)
        if i not in s.stored:
            actions = s.job_stored(i)
            cancelled += [a.index for a in actions if isinstance(a, CancelJob)]
    assert sorted(cancelled) == ([] if keyed else list(range(jobs)))
    assert s.status == CLIENT_CLOSED and s.label == "499"
    assert s.answered() == [] and s.failed(409) == [] and s.client_left() == []  # (nothing after)
    assert s.label == "499"


@pytest.mark.parametrize("door", list(DOORS))
def test_the_status_is_decided_before_anything_is_sent_and_labels_the_request(door: str) -> None:
    jobs = DOORS[door][1]
    # Answered: 200, the stream's opened when every job is stored (a turn's once answered).
    s = state(door, keyed=False)
    for i in range(jobs):
        s.job_stored(i)
    opened = s.all_stored()
    answered = s.answered()
    if door == "stream":
        assert opened == [OpenStream()] and answered == [EndStream(200)]
    elif door == "turn-stream":
        assert opened == [] and answered == [OpenStream(), EndStream(200)]
    else:
        assert opened == [] and answered == [Respond(200)]
    assert s.label == "200"
    # Refused before its stream opened (no replica for the constraint): the status itself.
    s = state(door, keyed=False)
    s.job_stored(0)
    failed = s.failed(409)
    assert failed[-1] == Respond(409) and s.label == "409"
    assert failed[:-1] == [CancelJob(0)]  # (the job refused at once: its cancel is a no-op "answered")


def test_an_error_after_a_streams_200_ends_the_stream_and_labels_it() -> None:
    s = state("stream", keyed=False)
    s.job_stored(0)
    assert s.all_stored() == [OpenStream()]
    assert s.failed(504) == [CancelJob(0), EndStream(504)] and s.label == "504"
    s = state("stream", keyed=True)
    s.job_stored(0)
    s.all_stored()
    assert s.client_left() == [] and s.label == "499"  # (a client gone mid-stream: 499, never 500)


def test_a_failed_batch_cancels_its_keyless_siblings_still_under_way() -> None:
    s = state("batch", keyed=False)
    for i in range(3):
        s.job_stored(i)
    s.all_stored()
    s.job_settled(0)
    assert s.failed(409) == [CancelJob(1), CancelJob(2), Respond(409)]
    keyed = state("batch", keyed=True)
    keyed.job_stored(0)
    assert keyed.failed(400) == [Respond(400)]  # (a keyed sibling runs on for its retry)
    assert keyed.job_stored(1) == []  # (stored after the failure: keyed, left alone)
    late = state("batch", keyed=False)
    late.job_stored(0)
    late.failed(503)
    assert late.job_stored(1) == [CancelJob(1)]  # (stored after the failure: nobody reads it)


def test_events_a_request_cannot_have_are_refused() -> None:
    s = state("plain", keyed=False)
    s.job_stored(0)
    with pytest.raises(RequestStateError):
        s.job_stored(0)
    with pytest.raises(RequestStateError):
        s.job_stored(1)
    with pytest.raises(RequestStateError):
        RequestState("batch", stream=True, keys=(None,))
    with pytest.raises(RequestStateError):
        RequestState("turn", stream=False, keys=(None, None))
    with pytest.raises(RequestStateError):
        state("batch", keyed=False).all_stored()  # (not every job stored yet)


# -- protocol: what is honoured, what is refused ---------------------------------------------------


def generate(body: dict[str, Any], key: str | None = None) -> Any:
    return protocol.parse_generate(body, key_header=key, default_max_staleness=None)


def completions(body: dict[str, Any], key: str | None = None) -> Any:
    return protocol.parse_completions(body, key_header=key, default_max_staleness=None, model_name="rollfleet")


ONE = {"input_ids": [1, 2]}


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"prompt": "x", "logit_bias": {"50256": -100}}, "logit_bias"),
        ({"prompt": "x", "presence_penalty": 0.5}, "presence_penalty"),
        ({"prompt": "x", "frequency_penalty": 1}, "frequency_penalty"),
        ({"prompt": "x", "best_of": 3}, "best_of"),
        ({"prompt": "x", "echo": True}, "echo"),
        ({"prompt": "x", "suffix": "tail"}, "suffix"),
        ({"prompt": "x", "logprobs": 5}, "logprobs"),
        ({"prompt": "x", "stop": 5}, "stop"),
        ({"prompt": "x", "stop": ["\n"]}, "stop"),
        ({"prompt": "x", "min_p": "x"}, "min_p"),
        ({"prompt": "x", "model": "gpt-4"}, "model"),
        ({"prompt": "x", "user": 7}, "user"),
        ({"prompt": "x", "weight_version": {}}, "weight_version"),
        ({"prompt": "x", "weight_version": {"exact_version": None}}, "weight_version"),
        ({"prompt": "x", "rid": "a"}, "rid"),  # (the header names another key)
        ({"prompt": "x", "max_new_tokens": 4}, "max_new_tokens"),  # (OpenAI's name is max_tokens)
        ({"prompt": "x", "stream_options": {"include_usage": "yes"}}, "stream_options"),
        ({"prompt": "x", "frobnicate": 1}, "frobnicate"),
    ],
)
def test_what_an_openai_completion_asks_and_is_not_honoured_is_refused_naming_it(body: dict[str, Any],
                                                                                  field: str) -> None:  # fmt: skip
    with pytest.raises(InvalidRequest) as refused:
        completions(body, key="b" if "rid" in body else None)
    reply = protocol.error_reply(refused.value)
    assert reply.status == (404 if field == "model" else 400) and reply.body["error"]["param"] == field
    if field == "model":
        assert reply.body["error"]["code"] == "model_not_found"


def test_what_changes_nothing_is_accepted_at_its_neutral_value() -> None:
    req = completions({"model": "rollfleet", "prompt": "x", "n": 2, "best_of": 2, "echo": False, "suffix": None,
                       "presence_penalty": 0, "frequency_penalty": 0.0, "logit_bias": {}, "stop": [], "logprobs": 0,
                       "user": "end-user-9", "stream_options": {"include_usage": True}, "top_k": 5,
                       "stop_token_ids": [2], "rid": "k"}, key="k")  # fmt: skip
    assert req.payload.n == 2 and req.logprobs and req.user == "end-user-9" and req.idempotency_key == "k"
    assert req.payload.sampling.top_k == 5 and req.payload.sampling.stop_token_ids == [2] and req.model == "rollfleet"


@pytest.mark.parametrize(
    ("body", "field"),
    [
        (ONE | {"sampling_params": []}, "sampling_params"),
        (ONE | {"sampling_params": 0}, "sampling_params"),
        (ONE | {"sampling_params": False}, "sampling_params"),
        (ONE | {"sampling_params": {"stop": 5}}, "sampling_params.stop"),
        (ONE | {"sampling_params": {"min_p": "x"}}, "sampling_params.min_p"),
        (ONE | {"sampling_params": {"frequency_penalty": 0.2}}, "sampling_params.frequency_penalty"),
        (ONE | {"sampling_params": {"logit_bias": {"1": 2.0}}}, "sampling_params.logit_bias"),
        (ONE | {"sampling_params": {"regex": "a+"}}, "sampling_params.regex"),
        (ONE | {"sampling_params": {"skip_special_tokens": "no"}}, "sampling_params.skip_special_tokens"),
        (ONE | {"sampling_params": {"max_tokens": 9}}, "sampling_params.max_tokens"),
        (ONE | {"weight_version": {}}, "weight_version"),
        (ONE | {"weight_version": {"min_required_version": None}}, "weight_version"),
        (ONE | {"top_logprobs_num": 5}, "top_logprobs_num"),
        (ONE | {"lora_path": "adapter"}, "lora_path"),
        (ONE | {"return_hidden_states": True}, "return_hidden_states"),
        (ONE | {"model": "rollfleet"}, "model"),  # (SGLang's /generate has no model field)
        ({"input_ids": [[1], [2]], "rid": ["a", "b"]}, "rid"),  # (the header names other keys)
    ],
)
def test_what_a_generate_body_asks_and_is_not_honoured_is_refused_naming_it(body: dict[str, Any], field: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        generate(body, key="h" if "rid" in body else None)
    assert protocol.error_reply(refused.value).body["error"]["param"] == field


def test_a_request_may_wait_for_a_replica_through_its_weight_version() -> None:
    """``weight_version.wait_for_replica``: true or false beside exactly one version field, on
    every route; anything else is a 400 naming it; a trajectory's turn may not wait."""
    waits = generate(ONE | {"weight_version": {"exact_version": 1, "wait_for_replica": True}})
    assert waits.wait_for_replica and waits.constraint == AskedConstraint("exact", 1)
    for spec in ({"min_required_version": 3, "wait_for_replica": False}, {"min_required_version": 3,
                 "wait_for_replica": None}, {"min_required_version": 3}):  # fmt: skip
        req = generate(ONE | {"weight_version": spec})
        assert not req.wait_for_replica and req.constraint == AskedConstraint("min", 3)
    assert not generate(ONE).wait_for_replica
    openai_way = completions({"prompt": "x", "weight_version": {"min_required_version": 0, "wait_for_replica": True}})
    assert openai_way.wait_for_replica
    batch = generate({"input_ids": [[1], [2]], "weight_version": {"exact_version": 2, "wait_for_replica": True}})
    assert all(r.wait_for_replica for r in batch)
    for bad in ("yes", 1, 0, [], {}):
        with pytest.raises(InvalidRequest) as refused:
            generate(ONE | {"weight_version": {"exact_version": 1, "wait_for_replica": bad}})
        assert protocol.error_reply(refused.value).body["error"]["param"] == "weight_version.wait_for_replica"
    with pytest.raises(InvalidRequest) as refused:  # (waiting is no constraint of its own)
        generate(ONE | {"weight_version": {"wait_for_replica": True}})
    assert protocol.error_reply(refused.value).body["error"]["param"] == "weight_version"
    protocol.check_turn(generate(ONE | {"weight_version": {"exact_version": 1}}))
    with pytest.raises(InvalidRequest) as refused:
        protocol.check_turn(waits)
    assert protocol.error_reply(refused.value).body["error"]["param"] == "weight_version.wait_for_replica"
    with pytest.raises(InvalidRequest, match="batch"):
        protocol.check_turn(batch)


def test_the_key_is_the_header_or_rid_and_both_must_agree() -> None:
    assert generate(ONE | {"rid": "r"}).idempotency_key == "r"
    assert generate(ONE, key="h").idempotency_key == generate(ONE | {"rid": "h"}, key="h").idempotency_key == "h"
    assert generate(ONE).idempotency_key is None
    batch = generate({"input_ids": [[1], [2]], "rid": ["h/0", "h/1"]}, key="h")
    assert [r.idempotency_key for r in batch] == ["h/0", "h/1"]
    with pytest.raises(InvalidRequest):
        generate(ONE | {"rid": ""})


def test_a_body_with_a_key_twice_is_refused_whole() -> None:
    with pytest.raises(InvalidRequest, match="'input_ids' appears twice"):
        protocol.read_body(b'{"input_ids": [1], "input_ids": [2]}', 1024)
    with pytest.raises(InvalidRequest, match="'max_new_tokens' appears twice"):
        protocol.read_body(b'{"sampling_params": {"max_new_tokens": 1, "max_new_tokens": 900}}', 1024)
    assert protocol.read_body(b'{"a": {"b": 1}, "b": {"a": 2}}', 1024) == {"a": {"b": 1}, "b": {"a": 2}}


def _json_text(draw: st.DrawFn, depth: int = 0) -> str:
    """A JSON text written by hand: objects from a few keys (so one often has a key twice),
    random spacing, escapes, numbers past float and int64 range, ``NaN``."""
    space = draw(st.sampled_from(["", " ", "\n\t "]))
    kind = draw(st.sampled_from(["scalar", "list", "dict"] if depth < 4 else ["scalar"]))
    if kind == "list":
        items = [_json_text(draw, depth + 1) for _ in range(draw(st.integers(0, 4)))]
        return "[" + f",{space}".join(items) + "]"
    if kind == "dict":
        pairs = []
        for _ in range(draw(st.integers(0, 4))):
            key = json.dumps(draw(st.sampled_from(["a", "b", "a:b", 'q"', "\\", "é", ":"])),
                             ensure_ascii=draw(st.booleans()))  # fmt: skip
            pairs.append(f"{key}{space}:{space}{_json_text(draw, depth + 1)}")
        return "{" + f",{space}".join(pairs) + "}"
    scalar = draw(st.one_of(st.none(), st.booleans(), st.integers(-(10**30), 10**30), st.floats(),
                            st.text(st.characters(codec="utf-8"), max_size=5)))  # fmt: skip
    return json.dumps(scalar, ensure_ascii=draw(st.booleans()))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.data())
def test_a_body_is_read_exactly_as_the_standard_library_reads_it(data: st.DataObject) -> None:
    """The body's fast decoder (msgspec) is kept only where it gives what ``json.loads`` gives:
    the same value, a key twice refused naming it, what it cannot read (``NaN``, a cut or
    corrupted text) the same error as ever."""
    raw = _json_text(data.draw).encode()
    if data.draw(st.booleans()):  # a corrupted text: a byte changed, or the text cut short
        at = data.draw(st.integers(0, max(0, len(raw) - 1)))
        raw = raw[:at] + data.draw(st.binary(max_size=1)) + raw[at + 1 :]
    try:
        expected: Any = json.loads(raw, object_pairs_hook=bounded_json._unique_keys)
    except bounded_json._DuplicateKey as exc:
        expected = InvalidRequest(f"the request body: {exc}")
    except (ValueError, UnicodeDecodeError) as exc:
        expected = InvalidRequest(f"the request body is not valid JSON: {exc}")
    try:
        got: Any = protocol.read_body(raw, 1 << 20)
    except InvalidRequest as exc:
        got = exc
    if isinstance(expected, InvalidRequest):
        assert isinstance(got, InvalidRequest) and got.message == expected.message, raw
    else:  # (repr: NaN equal to NaN, 0.0 told from -0.0, 1 from 1.0 and True)
        assert repr(got) == repr(expected), raw


def test_headers_must_be_text_and_are_never_echoed() -> None:
    for value in ("\udcff\udcfe", "a\x01b"):
        with pytest.raises(InvalidRequest) as refused:
            protocol.header_text({"Idempotency-Key": value}, "Idempotency-Key")
        assert "Idempotency-Key" in refused.value.message and value not in refused.value.message
    assert protocol.header_text({"Idempotency-Key": "ü-1"}, "Idempotency-Key") == "ü-1"
    with pytest.raises(InvalidRequest):
        protocol.session_of({"X-Session-Id": "\udcc3("})
    assert protocol.authorized({"Authorization": "Bearer k"}, "k")
    assert not protocol.authorized({"Authorization": "Bearer \udcffk"}, "k")
    assert not protocol.authorized({}, "k")


def test_errors_carry_what_a_client_acts_on() -> None:
    unauthorized = protocol.error_reply(AuthorizationError("no"))
    assert unauthorized.status == 401 and unauthorized.headers["WWW-Authenticate"].startswith("Bearer")
    assert protocol.error_reply(NoCompatibleReplica("x")).headers == {"Retry-After": "1"}
    assert protocol.error_reply(Cancelled("x")).status == CLIENT_CLOSED
    allowed = protocol.error_reply(protocol.MethodNotAllowed("GET /generate", ["POST"]))
    assert allowed.status == 405 and allowed.headers == {"Allow": "POST"}
    assert protocol.error_reply(protocol.RouteNotFound("x")).status == 404


def test_a_409_says_when_the_autoscaler_expects_a_replica_of_the_class_to_serve() -> None:
    """``Retry-After`` from the autoscaler's published status: the class the constraint needs (a
    held version's, or the followers'), when the status says a replica starts there; 1 whenever
    it says nothing of the kind, or cannot be trusted to."""
    now = 1_000_000.0

    def status(at: float = now, **classes: Any) -> bytes:
        rows = {name: {"desired": 1, "actual": 1, "serving_by": by} for name, by in classes.items()}
        return json.dumps({"at": at, "latest": 9, "classes": rows}).encode()

    exact3, at_least5 = AskedConstraint("exact", 3), AskedConstraint("min", 5)
    starting = status(**{"3": now + 22.4, "latest": now + 10})
    assert protocol.retry_after_s(exact3, starting, now) == 23
    assert protocol.retry_after_s(at_least5, starting, now) == 10
    assert protocol.retry_after_s(AskedConstraint("staleness", 1), starting, now) == 10
    assert protocol.retry_after_s(AskedConstraint("exact", 9), starting, now) == 10  # (latest: followers)
    assert protocol.retry_after_s(AskedConstraint("min", 12), starting, now) == 1  # (not published yet)
    assert protocol.retry_after_s(exact3, status(**{"3": None}), now) == 1  # (one serves, or none starts)
    assert protocol.retry_after_s(exact3, status(**{"4": now + 20}), now) == 1
    assert protocol.retry_after_s(exact3, status(**{"3": now - 5}), now) == 1  # (late: any moment)
    assert protocol.retry_after_s(exact3, status(at=now - 61, **{"3": now + 20}), now) == 1  # (its controller gone)
    assert protocol.retry_after_s(exact3, status(at=now + 2, **{"3": now + 20}), now) == 20  # (a clock ahead)
    listed = json.dumps({"at": now, "latest": 9, "classes": []}).encode()
    for unreadable in (None, b"", b"{", b"[]", b'{"at": "x", "latest": 9, "classes": {}}', b'{"at": 1}',
                       status(**{"3": True}), listed):  # fmt: skip
        assert protocol.retry_after_s(exact3, unreadable, now) == 1, unreadable
    assert protocol.error_reply(NoCompatibleReplica("x"), retry_after_s=23).headers == {"Retry-After": "23"}
    assert protocol.error_reply(SessionConflict("x"), retry_after_s=23).headers == {"Retry-After": "1"}


# -- the tables against contracts nobody here wrote ----------------------------------------------


def test_every_field_sglang_and_the_openai_client_send_is_known() -> None:
    """Every field of SGLang's own ``GenerateRequest`` and ``SamplingParams`` and of the openai
    client's completion and chat parameters is classified (read, passed, a hint, or neutral
    only): a field added upstream shows up here, not as a silent drop."""
    from openai.types import completion_create_params
    from openai.types.chat import completion_create_params as chat_create_params

    sglang = api_types()
    assert {f.name for f in msgspec.structs.fields(sglang.SamplingParams)} == protocol.SAMPLING_FIELDS
    generate_fields = {f.name for f in msgspec.structs.fields(sglang.GenerateRequest)}
    assert generate_fields - protocol.known_fields("generate") == set()
    openai_completions = set(typing.get_type_hints(completion_create_params.CompletionCreateParamsBase))
    assert openai_completions - protocol.known_fields("completions") == set()
    openai_chat = set(typing.get_type_hints(chat_create_params.CompletionCreateParamsBase))
    assert openai_chat - protocol.known_fields("chat") == set()


def test_a_body_the_gateway_accepts_sglang_accepts() -> None:
    body = {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 4, "stop": None, "presence_penalty": 0.0,
            "skip_special_tokens": False, "stream_interval": 2}, "return_logprob": True, "priority": 3}  # fmt: skip
    api_types().GenerateRequest.from_json_value(body)
    req = generate(body)
    assert req.payload.extra == {"sampling_params": {"skip_special_tokens": False, "stream_interval": 2}}
