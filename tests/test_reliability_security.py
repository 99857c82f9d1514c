"""Reliability scenario 9: hostile version paths, token and mutual-TLS authentication end to end.

The worker/trainer permission split is proven in tests/test_deploy_auth.py
(test_worker_is_refused_versions_and_jobs); it is not repeated here.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from reliability.scenarios.security import hostile_versions, tls_end_to_end, token_end_to_end

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


async def test_hostile_paths_never_write_outside_the_checkpoint_dir(tmp_path: Path) -> None:
    fig = await hostile_versions(tmp_path)
    print(fig.summary(), fig.notes)
    assert fig.passed, fig.problems
    assert fig.faults == 4 and fig.versions_activated == 4


async def test_token_auth_end_to_end_with_the_embedded_broker(tmp_path: Path) -> None:
    fig = await token_end_to_end(tmp_path)
    print(fig.summary(), fig.notes)
    assert fig.passed, fig.problems


@pytest.mark.skipif(shutil.which("openssl") is None, reason="openssl makes the test certificates")
async def test_mutual_tls_end_to_end_with_the_embedded_broker(tmp_path: Path) -> None:
    fig = await tls_end_to_end(tmp_path)
    print(fig.summary(), fig.notes)
    assert fig.passed, fig.problems
