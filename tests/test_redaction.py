"""Credentials in a broker URL never reach an error's text or a log line (the rule of what is
secret in a URL, and its redaction, is ``runtime.secrets``'s, tested in ``test_store_secrets``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import structlog

from rollfleet.broker import EmbeddedBroker, free_port
from rollfleet.broker.connection import connect
from rollfleet.schemas.errors import AuthorizationError, ServiceUnavailable


async def test_dead_broker_error_and_logs_lack_the_password() -> None:
    url = f"nats://user:secret@127.0.0.1:{free_port()}"
    with structlog.testing.capture_logs() as logs, pytest.raises(ServiceUnavailable) as caught:
        await connect(url, name="t", initial_timeout=1.0, connect_timeout=0.3)
    assert caught.value.retryable and "nats://***@127.0.0.1" in caught.value.message
    said = [str(caught.value), repr(caught.value), *(str(entry) for entry in logs)]
    assert logs and not any("secret" in s for s in said), said
    assert caught.value.__cause__ is None  # the chained original may repeat the URL as given


async def test_refused_password_is_not_repeated(tmp_path: Path) -> None:
    conf = tmp_path / "auth.conf"
    conf.write_text('authorization { users = [ { user: "u", password: "right-one" } ] }\n')
    broker = EmbeddedBroker(store_dir=tmp_path / "store", config=conf, log_file=tmp_path / "nats.log").start()
    try:
        url = broker.url.replace("nats://", "nats://u:wrong-secret@")
        with structlog.testing.capture_logs() as logs, pytest.raises(AuthorizationError) as caught:
            await connect(url, name="t", initial_timeout=5.0, connect_timeout=1.0)
        said = [str(caught.value), *(str(entry) for entry in logs)]
        assert "nats://***@127.0.0.1" in caught.value.message and not any("wrong-secret" in s for s in said), said
    finally:
        broker.stop()
