"""Shared fixtures: a real nats-server on a free loopback port with a temporary store."""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import nats
import pytest

from rollfleet.broker import EmbeddedBroker

os.environ.setdefault("ROLLFLEET_LOG_LEVEL", "warning")


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[EmbeddedBroker]:
    """A fresh nats-server with JetStream for one test."""
    b = EmbeddedBroker(store_dir=tmp_path / "nats-store", log_file=tmp_path / "nats.log")
    b.start()
    try:
        yield b
    finally:
        b.stop()


@pytest.fixture
def nats_url(broker: EmbeddedBroker) -> str:
    return broker.url


@pytest.fixture
def namespace() -> str:
    return "t" + uuid.uuid4().hex[:8]


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[nats.NATS]:
    conn = await nats.connect(nats_url)
    try:
        yield conn
    finally:
        await conn.close()


# `make test` runs test files on a few workers, a file on one worker (xdist --dist loadfile,
# --no-loadscope-reorder). The files that take longest go first, so that no long file starts
# last while the other workers idle: seconds per file, from a `--durations=0` run of the suite
# (`tests/file_seconds.json`; a file not listed counts as short). Only the order changes.
_FILE_SECONDS: dict[str, float] = json.loads((Path(__file__).parent / "file_seconds.json").read_text())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: -_FILE_SECONDS.get(item.path.name, 0.0))  # (stable: a file's tests keep their order)
