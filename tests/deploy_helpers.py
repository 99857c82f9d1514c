"""Repository facts the deployment tests need: where broker_config/ is, the secrets its configs read.

The harness that runs those configs (on free ports, with temporary stores) is ``harness``.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

from harness import rollfleet_command

REPO = Path(__file__).resolve().parents[1]
BROKER_CONFIG = REPO / "broker_config"
CLUSTER_DIR = BROKER_CONFIG / "cluster"
DEV_CERTS_SCRIPT = BROKER_CONFIG / "tls" / "make-dev-certs.sh"

# Passwords and tokens the auth configs read from the environment.
TEST_SECRETS = {
    "ROLLFLEET_PASSWORD_TRAINER": "trainer-secret",
    "ROLLFLEET_PASSWORD_W1": "w1-secret",
    "ROLLFLEET_PASSWORD_W2": "w2-secret",
    "ROLLFLEET_PASSWORD_SYS": "sys-secret",
    "ROLLFLEET_TOKEN": "s3cr3t-token-for-tests",
}

ECHO_V0 = ("--engine", "echo", "--version", "0")  # a worker that needs no weights


def run_cli(*args: str, timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return subprocess.run(rollfleet_command(*args), capture_output=True, text=True, timeout=timeout, cwd=REPO)
