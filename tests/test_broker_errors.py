"""What the broker says, typed once (``broker/errors.py``): a nats exception in, rollfleet's typed
error out, with its facts as fields. Pure: no broker, milliseconds."""

from __future__ import annotations

import nats.errors
import nats.js.errors
import pytest

from rollfleet.broker.errors import (
    NO_RESPONDERS_STATUS,
    STREAM_NAME_IN_USE,
    WRONG_LAST_SEQUENCE,
    is_stream_name_in_use,
    no_responders,
    pull_refused,
    refuses_credentials,
    typed,
    typed_errors,
)
from rollfleet.broker.startup import not_ready
from rollfleet.schemas.errors import (
    BrokerError,
    BrokerTimeout,
    BrokerUnavailable,
    ConnectionClosed,
    Fenced,
    NoResponders,
    NotFound,
    ServiceUnavailable,
)


@pytest.mark.parametrize(
    ("raised", "kind"),
    [
        (nats.js.errors.KeyNotFoundError(), NotFound),
        (nats.js.errors.KeyDeletedError(), NotFound),
        (nats.js.errors.BucketNotFoundError(), NotFound),
        (nats.js.errors.NotFoundError(code=404, err_code=10037, description="no message found"), NotFound),
        (nats.errors.NoRespondersError(), NoResponders),
        (nats.errors.TimeoutError(), BrokerTimeout),
        (nats.errors.FlushTimeoutError(), BrokerTimeout),
        (nats.errors.ConnectionReconnectingError(), BrokerUnavailable),
        (nats.errors.StaleConnectionError(), BrokerUnavailable),
        (nats.js.errors.ServiceUnavailableError(code=503), BrokerUnavailable),
        (nats.js.errors.ServerError(code=500), BrokerUnavailable),
        (nats.js.errors.NoStreamResponseError(), BrokerUnavailable),
        (nats.errors.ConnectionClosedError(), ConnectionClosed),
        (nats.errors.NoServersError(), ConnectionClosed),
        (nats.errors.MaxPayloadError(), BrokerError),
        (nats.js.errors.BadRequestError(code=400, err_code=10052, description="invalid"), BrokerError),
    ],
    ids=lambda v: type(v).__name__ if isinstance(v, Exception) else v.__name__,
)
def test_each_nats_error_has_one_typed_error(raised: nats.errors.Error, kind: type[BrokerError]) -> None:
    error = typed(raised)
    assert type(error) is kind
    assert isinstance(error, BrokerError)  # one catch for "the broker refused or did not answer"


def test_a_conditional_write_refused_is_fenced_with_its_key_and_revision() -> None:
    for raised in (
        nats.js.errors.KeyWrongLastSequenceError("wrong last sequence: 7"),
        # (nats-py passes a conditional delete's refusal on as the API error it came as)
        nats.js.errors.APIError(code=400, err_code=WRONG_LAST_SEQUENCE, description="wrong last sequence: 7"),
    ):
        error = typed(raised, key="claim.abc", revision=5)
        assert type(error) is Fenced
        assert (error.subject, error.expected_seq, error.retryable) == ("claim.abc", 5, False)
        assert not isinstance(error, BrokerError)


def test_facts_travel_as_fields() -> None:
    deleted = typed(nats.js.errors.KeyDeletedError())
    assert isinstance(deleted, NotFound) and deleted.deleted and not deleted.retryable
    assert not typed(nats.js.errors.KeyNotFoundError()).deleted  # type: ignore[attr-defined]
    refused = typed(nats.js.errors.BadRequestError(code=400, err_code=10052, description="invalid"))
    assert isinstance(refused, BrokerError)
    assert (refused.status, refused.err_code, refused.retryable) == (400, 10052, False)
    failed = typed(nats.js.errors.APIError(code=500, err_code=10999))
    assert isinstance(failed, BrokerError) and failed.retryable
    assert typed(nats.errors.NoRespondersError()).status == int(NO_RESPONDERS_STATUS)  # type: ignore[attr-defined]
    # A time-out stays a TimeoutError, as nats' own was: code that catches its own and the broker's
    # time-outs alike (``except TimeoutError``, ``OSError``) still does.
    assert isinstance(typed(nats.errors.TimeoutError()), TimeoutError)


def test_typed_errors_raises_the_typed_error_with_the_library_s_as_its_cause() -> None:
    raised = nats.js.errors.KeyWrongLastSequenceError("wrong last sequence: 3")
    with pytest.raises(Fenced) as caught:
        with typed_errors(key="c.x", revision=2):
            raise raised
    assert caught.value.__cause__ is raised and caught.value.expected_seq == 2
    with pytest.raises(KeyError):  # what is not the library's passes through unchanged
        with typed_errors():
            raise KeyError("k")


def test_statuses_codes_and_texts_are_read_here() -> None:
    assert no_responders({"Status": "503"}) and not no_responders({"Status": "408"})
    assert not no_responders({}) and not no_responders(None)
    assert pull_refused("503", "") and pull_refused("409", "Exceeded MaxWaiting")
    assert pull_refused("400", "Bad Request - batch 0") and not pull_refused("408", "Request Timeout")
    assert not pull_refused("409", "Consumer Deleted")
    assert refuses_credentials(nats.errors.Error("nats: 'Authorization Violation'"))
    assert not refuses_credentials(nats.errors.Error("nats: stale connection"))
    in_use = nats.js.errors.BadRequestError(code=400, err_code=STREAM_NAME_IN_USE, description="name in use")
    assert is_stream_name_in_use(in_use)
    assert not is_stream_name_in_use(nats.js.errors.BadRequestError(code=400, err_code=10052))


def test_a_start_waits_out_the_typed_errors_as_it_does_nats_own() -> None:
    """``startup.not_ready`` judges a port's typed error as it judged the nats error it came
    from: not ready (waited out) or an answer (raised)."""
    for raised in (
        nats.js.errors.BucketNotFoundError(),
        nats.errors.TimeoutError(),
        nats.errors.NoRespondersError(),
        nats.errors.ConnectionClosedError(),
        nats.js.errors.ServiceUnavailableError(),
    ):
        assert isinstance(not_ready(raised, "x"), ServiceUnavailable)
        assert isinstance(not_ready(typed(raised), "x"), ServiceUnavailable)
    refused = nats.js.errors.BadRequestError(code=400, err_code=10052)
    assert not_ready(refused, "x") is None and not_ready(typed(refused), "x") is None
