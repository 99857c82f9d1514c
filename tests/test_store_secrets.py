"""Credentials inside a URL never reach an error, a log line, the registry or ``rollfleet status``.

A store URL with credentials (``s3://KEY:SECRET@bucket/p``, a signed query) is refused with a
typed error that names it redacted: credentials belong in the environment or ``store_options``.
Text that may quote some other URL (a replica's ``degraded_reason``) is redacted where it is
written and where it is shown. The rule of what is secret: ``runtime.secrets``.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import nats
import pytest
from policy_helpers import make_checkpoint

from rollfleet.broker import ensure_topology
from rollfleet.cli.status import collect_status, render_table
from rollfleet.policy_store.bucket import Bucket, check_store
from rollfleet.policy_store.publisher import PolicyPublisher
from rollfleet.policy_store.remote import open_store
from rollfleet.runtime.secrets import has_secrets, redact_url, redact_urls
from rollfleet.schemas import Names, ReplicaStatus, decode, encode
from rollfleet.schemas.errors import UnsupportedStore
from rollfleet.workers.registry import Registration

KEY, SECRET = "AKIAEXAMPLEKEY123456", "wJalr/XUtnFEMI+K7MDENG"  # an AWS secret may hold "/" and "+"


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        (f"s3://{KEY}:{SECRET}@bucket/p", "s3://***@bucket/p"),
        (f"s3://{KEY}@bucket/p", "s3://***@bucket/p"),
        ("nats://user:p@ss@host:4222", "nats://***@host:4222"),
        ("az://c/p?sv=2024&sig=c2VjcmV0&se=1", "az://c/p?sv=2024&sig=***&se=1"),
        (f"s3://b/p?X-Amz-Credential={KEY}&X-Amz-Signature=ab12", "s3://b/p?X-Amz-Credential=***&X-Amz-Signature=***"),
        ("s3://bucket/run@3/p", "s3://bucket/run@3/p"),  # an "@" in a key's path is no userinfo
        ("s3://bucket/prefix", "s3://bucket/prefix"),
    ],
)
def test_a_url_is_shown_without_its_credentials(url: str, shown: str) -> None:
    assert redact_url(url) == shown
    assert has_secrets(url) == (url != shown)
    assert redact_urls(f"cannot open {url!r}: refused") == f"cannot open {shown!r}: refused"


@pytest.mark.parametrize(
    "url",
    [
        f"s3://{KEY}:{SECRET}@bucket/p",
        f"s3:/{KEY}:{SECRET}@bucket/p",  # through pathlib
        f"gs://bucket/p?access_token={SECRET}",
        f"ftp://{KEY}:{SECRET}@host/p",  # refused for its scheme too: either way, not echoed
    ],
)
def test_a_store_url_with_credentials_is_refused_without_echoing_them(tmp_path: Path, url: str) -> None:
    make_checkpoint(tmp_path / "base")
    for open_it in (check_store, open_store, Bucket, lambda u: PolicyPublisher(u, tmp_path / "base")):
        with pytest.raises(UnsupportedStore) as info:
            open_it(url)
        text = f"{info.value} {info.value!r} {info.value.detail}"
        assert SECRET not in text and KEY not in text and "***" in text, text
        assert not info.value.retryable


def test_a_worker_given_a_store_url_with_credentials_says_so_without_them(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "rollfleet", "worker", "--nats", "nats://127.0.0.1:1", "--engine", "echo",
         "--store", f"s3://{KEY}:{SECRET}@bucket/p", "--local-dir", str(tmp_path / "local")],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    said = proc.stdout + proc.stderr
    assert proc.returncode == 2, said
    assert "s3://***@bucket/p" in said and "must not carry credentials" in said
    assert SECRET not in said and KEY not in said and "Traceback" not in said


def _status(worker_id: str, reason: str) -> ReplicaStatus:
    now = time.time()
    return ReplicaStatus(
        worker_id=worker_id, state="degraded", active_version=3, engine="echo", capacity=1, in_flight=0,
        heartbeat_at=now, heartbeat_interval_s=20.0, started_at=now, degraded_reason=reason,
    )  # fmt: skip


async def test_the_registry_and_status_never_show_a_url_s_credentials(nats_url: str, namespace: str) -> None:
    names = Names(namespace)
    reason = f"prepare of version 4 failed: StoreUnavailable: https://{KEY}:{SECRET}@minio:9000/b failed"
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        await ensure_topology(js, names)
        registration = Registration(js, names, _status("w-new", "starting"))
        await registration.start()
        await registration.write(state="degraded", degraded_reason=reason)
        kv = await js.key_value(names.fleet_bucket)
        stored = decode((await kv.get(names.replica_key("w-new"))).value, ReplicaStatus)
        assert stored.degraded_reason == reason.replace(f"{KEY}:{SECRET}@", "***@")
        # An entry an older worker wrote, credentials and all: `rollfleet status` still hides them.
        await kv.put(names.replica_key("w-old"), encode(_status("w-old", reason)))
        snapshot = await collect_status(nats_url, namespace)
        shown = render_table(snapshot) + json.dumps(snapshot)  # the table and `--json`
        assert "https://***@minio:9000/b" in shown
        assert SECRET not in shown and KEY not in shown
        await registration.stop()
    finally:
        await nc.close()
