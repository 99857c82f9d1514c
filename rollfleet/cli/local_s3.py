"""A real S3 API server, moto's (``python -m moto.server``), in its own process: for trying a
bucket store without a cloud (``python -m rollfleet.cli.local_s3``, Compose's ``objects``
profile; the ``s3server`` extra), and for the tests and benchmarks of bucket stores.

``S3Server`` starts it on a free loopback port with IAM checks on (``INITIAL_NO_AUTH_ACTION_COUNT``:
the first few calls set up a user, its policy, its access key and the bucket; every later call
must be signed with that key), so wrong credentials are refused as by a real cloud. ``env`` is
what a trainer or worker process needs in its environment to reach the bucket: credentials and
the endpoint travel only there, never on a command line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

from rollfleet.broker import free_port
from rollfleet.broker.server import wait_for_port
from rollfleet.runtime.processes import die_with_parent, terminate

BUCKET = "rollfleet-weights"
_SETUP_CALLS = 5  # create_user, put_user_policy, create_access_key, create_bucket, (one spare)


def unavailable() -> str | None:
    """Why no S3 server can run here (None: it can)."""
    import importlib.util

    if importlib.util.find_spec("moto") is None or importlib.util.find_spec("flask") is None:
        return "moto's server is not installed (pip install 'moto[server]')"
    if importlib.util.find_spec("boto3") is None:
        return "boto3 is not installed"
    return None


@dataclass
class S3Server:
    workdir: Path
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None
    access_key: str = ""
    secret_key: str = ""
    buckets: list[str] = field(default_factory=list)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, bucket: str = BUCKET, *, auth: bool = True, host: str = "127.0.0.1") -> S3Server:
        """Start the server with ``bucket``; ``auth=False`` accepts any key (the compose profile's)."""
        self.port = self.port or free_port()
        self.workdir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ}
        if auth:
            env["INITIAL_NO_AUTH_ACTION_COUNT"] = str(_SETUP_CALLS)
        with open(self.workdir / "moto.log", "ab") as out:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "moto.server", "-H", host, "-p", str(self.port)],
                stdout=out,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=True,
                preexec_fn=die_with_parent,  # a test process that dies leaves no server behind
            )
        wait_for_port("127.0.0.1", self.port, 30.0, self.proc)
        if auth:
            self._setup_iam()
        else:
            self.access_key = self.secret_key = "local"
        self.client().create_bucket(Bucket=bucket)
        self.buckets.append(bucket)
        return self

    def _setup_iam(self) -> None:
        import boto3

        anon = {"endpoint_url": self.endpoint, "region_name": "us-east-1"}
        anon |= {"aws_access_key_id": "setup", "aws_secret_access_key": "setup"}
        iam = boto3.client("iam", **anon)
        iam.create_user(UserName="rollfleet")
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
        iam.put_user_policy(UserName="rollfleet", PolicyName="all", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName="rollfleet")["AccessKey"]
        self.access_key, self.secret_key = key["AccessKeyId"], key["SecretAccessKey"]

    def client(self):  # type: ignore[no-untyped-def]
        """A boto3 S3 client signed with the server's key (to inspect or damage objects in tests)."""
        import boto3

        return boto3.client(
            "s3",
            endpoint_url=self.endpoint,
            region_name="us-east-1",
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
        )

    def env(self, *, secret: str | None = None) -> dict[str, str]:
        """Environment variables a process needs to reach the server (``secret`` overrides the key's)."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key if secret is None else secret,
            "AWS_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ALLOW_HTTP": "true",
        }

    def url(self, prefix: str, bucket: str = BUCKET) -> str:
        return f"s3://{bucket}/{prefix}"

    def stop(self) -> None:
        if self.proc is not None:
            terminate(self.proc, 10.0)
            self.proc = None


def main(argv: list[str] | None = None) -> None:
    """``python -m rollfleet.cli.local_s3 [PORT]``: a local S3 API holding the bucket, any key
    accepted, until stopped; ``/tmp/rollfleet-s3-ready`` exists once the bucket does."""
    import argparse
    import signal
    import tempfile

    parser = argparse.ArgumentParser(
        prog="python -m rollfleet.cli.local_s3",
        description=f"A local S3 API (moto) with the bucket {BUCKET!r}; any key is accepted. For trying "
        "the compose `objects` profile, not for production.",
    )
    parser.add_argument("port", nargs="?", type=int, default=5000)
    args = parser.parse_args(argv)
    workdir = Path(tempfile.mkdtemp(prefix="rollfleet-s3-"))
    server = S3Server(workdir, port=args.port).start(auth=False, host="0.0.0.0")
    Path("/tmp/rollfleet-s3-ready").touch()
    print(f"S3 API on :{args.port}, bucket {BUCKET}", flush=True)
    signal.signal(signal.SIGTERM, lambda *_: (server.stop(), sys.exit(0)))
    assert server.proc is not None
    sys.exit(server.proc.wait())


if __name__ == "__main__":
    main()
